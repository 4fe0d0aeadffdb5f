#include "namm/selection.h"

#include <limits>

#include "aten.h"

namespace namm {

at::Tensor force_keep_newest(const at::Tensor& scores) {
  at::Tensor forced = scores.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  forced.select(1, forced.size(1) - 1).fill_(std::numeric_limits<float>::max());
  return forced;
}

int64_t max_count_not_below(const at::Tensor& scores, double threshold) {
  return scores.size(1) - scores.lt(threshold).sum(1).min().item<int64_t>();
}

at::Tensor keep_top_k_per_head(const at::Tensor& scores, int64_t k) {
  const int64_t n = scores.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "cannot keep ", k, " of ", n, " tokens");
  // Stable ascending sort: equal scores stay in chronological order, so dropping the front keeps the newer.
  at::Tensor order = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/1, /*descending=*/false));
  return std::get<0>(order.narrow(1, n - k, k).sort(1));
}

at::Tensor select_tokens(const at::Tensor& scores, const SelectionConfig& config,
                         const at::Tensor& selection_params) {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) >= 1, "scores must be [kv_heads, n >= 1], got ", scores.sizes());
  const int64_t n = scores.size(1);
  const at::Tensor forced = force_keep_newest(scores);
  int64_t k = n;
  switch (config.kind) {
    case SelectionKind::kBinary:
      k = max_count_not_below(forced, 0.0);
      break;
    case SelectionKind::kTopK:
      TORCH_CHECK(config.budget > 0, "top-k selection needs a budget > 0");
      k = std::min(n, config.budget);
      break;
    case SelectionKind::kDynamic: {
      TORCH_CHECK(selection_params.defined() && selection_params.numel() == 1,
                  "dynamic selection needs its log-threshold parameter");
      const double threshold = std::exp(selection_params.item<double>());
      k = std::max<int64_t>(1, max_count_not_below(forced, threshold));  // the newest, even if theta = inf
      if (config.budget > 0) k = std::min(k, config.budget);
      break;
    }
  }
  return keep_top_k_per_head(forced, k);
}

}  // namespace namm
