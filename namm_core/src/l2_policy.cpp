#include "namm/l2_policy.h"

#include "aten.h"
#include "namm/selection.h"
#include "torch_status.h"

namespace namm {

Result<std::unique_ptr<L2Policy>> L2Policy::Create(int64_t budget) {
  if (budget <= 0) return Status::InvalidArgument("the L2 policy needs budget > 0, got " + std::to_string(budget));
  return std::unique_ptr<L2Policy>(new L2Policy(budget));
}

std::string L2Policy::name() const { return "l2(budget=" + std::to_string(budget_) + ")"; }

Result<at::Tensor> L2Policy::Select(int /*layer*/, LayerKVCache& cache) {
  const int64_t n = cache.size();
  if (n <= budget_) return all_token_indices(cache);
  if (cache.head_dim() == 0) return Status::FailedPrecondition("the L2 policy needs the cache's keys");
  return internal::catch_torch_errors("L2 select", [&]() -> Result<at::Tensor> {
    const at::Tensor low_norm_first = cache.keys().to(at::kFloat).norm(2, {2}).neg_();
    return keep_top_k_per_head(force_keep_newest(low_norm_first), budget_);
  });
}

}  // namespace namm
