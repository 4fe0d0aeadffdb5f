#include "namm/policies/l2_policy.h"

#include "aten.h"
#include "namm/selection.h"
#include "torch_status.h"

namespace namm {

Result<std::unique_ptr<L2Policy>> L2Policy::Create(CacheBudget budget) {
  return std::unique_ptr<L2Policy>(new L2Policy(budget));
}

std::string L2Policy::name() const { return "l2(" + budget().ToString() + ")"; }

Result<at::Tensor> L2Policy::Select(int /*layer*/, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(int64_t budget, budget_tokens());
  const int64_t n = cache.size();
  if (n <= budget) return all_token_indices(cache);
  if (cache.head_dim() == 0) return Status::FailedPrecondition("the L2 policy needs the cache's keys");
  return internal::catch_torch_errors("L2 select", [&]() -> Result<at::Tensor> {
    const at::Tensor low_norm_first = cache.keys().to(at::kFloat).norm(2, {2}).neg_();
    return keep_top_k_per_head(force_keep_newest(low_norm_first), budget);
  });
}

}  // namespace namm
