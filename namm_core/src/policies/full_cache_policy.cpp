#include "namm/policies/full_cache_policy.h"

namespace namm {

Result<at::Tensor> FullCachePolicy::Select(int /*layer*/, LayerKVCache& cache) {
  return all_token_indices(cache);
}

}  // namespace namm
