#include "namm/policies/l2_policy.h"

#include <limits>

#include "aten.h"
#include "namm/selection.h"
#include "torch_status.h"

namespace namm {

Result<std::unique_ptr<L2Policy>> L2Policy::Create(CacheBudget budget, int64_t skip_layers) {
  if (skip_layers < 0) return Status::InvalidArgument("L2 needs skip_layers >= 0, got " + std::to_string(skip_layers));
  return std::unique_ptr<L2Policy>(new L2Policy(budget, skip_layers));
}

std::string L2Policy::name() const {
  return "l2(" + budget().ToString() + (skip_layers_ > 0 ? ", skip_layers=" + std::to_string(skip_layers_) : "") + ")";
}

Result<at::Tensor> L2Policy::Select(int layer, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(int64_t budget, budget_tokens());
  const int64_t n = cache.size();
  if (n <= budget || layer < skip_layers_) return all_token_indices(cache);
  if (cache.head_dim() == 0) return Status::FailedPrecondition("the L2 policy needs the cache's keys");
  return internal::catch_torch_errors("L2 select", [&]() -> Result<at::Tensor> {
    // Norms compared on a log2 grid of 2^-10 (0.07%), a deliberate difference from the L2 paper: the keys of
    // one token at different positions have the same norm up to RoPE's rounding (a rotation keeps it), so a
    // repeated text's keys tie up to the last bits, and which of them survived depended on the device's
    // rounding (a GPU and the CPU kept different tokens). On the grid such near-ties are ties, which the
    // stable top-k breaks the same way everywhere: the newer is kept.
    // A zero key's norm is taken as the smallest normal float: log2(0) = -inf would score +inf, above the newest
    // token's forced maximum, which a budget smaller than the zero keys then evicted.
    const at::Tensor low_norm_first = cache.keys()
                                          .to(at::kFloat)
                                          .norm(2, {2})
                                          .clamp_min_(std::numeric_limits<float>::min())
                                          .log2_()
                                          .mul_(1024.0)
                                          .round_()
                                          .neg_();
    return keep_top_k_per_head(force_keep_newest(low_norm_first), budget);
  });
}

}  // namespace namm
