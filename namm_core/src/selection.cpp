#include "namm/selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "aten.h"

namespace namm {

namespace {

// The ranking of the rules: ascending by score, NaN above everything (where torch's sort puts it), equal scores
// by slot (a stable ascending sort keeps chronological order, so the newer ranks higher).
bool RanksBelow(const float* score, int64_t a, int64_t b) {
  const float sa = score[a], sb = score[b];
  const bool nan_a = std::isnan(sa), nan_b = std::isnan(sb);
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && sa != sb) return sa < sb;
  return a < b;
}

bool OnHost(const at::Tensor& scores) { return scores.device().is_cpu() && scores.scalar_type() == at::kFloat; }

}  // namespace

int64_t count_not_below_on_host(const float* scores, int64_t heads, int64_t n, float threshold) {
  int64_t most = 0;
  for (int64_t h = 0; h < heads; ++h) {
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) kept += scores[h * n + i] < threshold ? 0 : 1;
    most = std::max(most, kept);
  }
  return most;
}

void keep_top_k_on_host(const float* scores, int64_t heads, int64_t n, int64_t k, int64_t* keep,
                        std::vector<int64_t>& order) {
  order.resize(static_cast<std::size_t>(n));
  for (int64_t h = 0; h < heads; ++h) {
    const float* score = scores + h * n;
    std::iota(order.begin(), order.end(), int64_t{0});
    // The top k by the ranking (a strict total order, so the same set a stable sort gives), then in slot order.
    const auto below = [&](int64_t a, int64_t b) { return RanksBelow(score, a, b); };
    std::nth_element(order.begin(), order.begin() + (n - k), order.end(), below);
    std::sort(order.begin() + (n - k), order.end());
    std::copy(order.begin() + (n - k), order.end(), keep + h * k);
  }
}

int64_t select_tokens_on_host(float* scores, int64_t heads, int64_t n, const SelectionConfig& config,
                              double log_threshold, std::vector<int64_t>& keep, std::vector<int64_t>& order) {
  for (int64_t h = 0; h < heads; ++h) scores[h * n + n - 1] = std::numeric_limits<float>::max();  // the newest
  int64_t k = n;
  switch (config.kind) {
    case SelectionKind::kBinary:
      k = count_not_below_on_host(scores, heads, n, config.threshold);
      break;
    case SelectionKind::kTopK:
      TORCH_CHECK(config.budget > 0, "top-k selection needs a budget > 0");
      k = std::min(n, config.budget);
      break;
    case SelectionKind::kDynamic: {
      // Compared in float32, as a float tensor is compared with a scalar.
      const auto threshold = static_cast<float>(std::exp(log_threshold));
      k = std::max<int64_t>(1, count_not_below_on_host(scores, heads, n, threshold));  // the newest, even at inf
      if (config.budget > 0) k = std::min(k, config.budget);
      break;
    }
  }
  keep.resize(static_cast<std::size_t>(heads * k));
  keep_top_k_on_host(scores, heads, n, k, keep.data(), order);
  return k;
}

int64_t select_own_counts_on_host(float* scores, int64_t heads, int64_t n, const int64_t* vacant,
                                  const SelectionConfig& config, double log_threshold, std::vector<int64_t>& keep,
                                  std::vector<int64_t>& order) {
  TORCH_CHECK(config.kind != SelectionKind::kTopK || config.budget > 0, "top-k selection needs a budget > 0");
  // Compared in float32, as a float tensor is compared with a scalar.
  const float threshold = config.kind == SelectionKind::kDynamic ? static_cast<float>(std::exp(log_threshold))
                                                                 : config.threshold;
  std::vector<int64_t> counts(static_cast<std::size_t>(heads));
  int64_t k = 0;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t first = vacant != nullptr ? vacant[h] : 0, held = n - first;
    TORCH_CHECK(first >= 0 && held >= 1, "KV head ", h, " holds no token of ", n, " slots");
    float* score = scores + h * n + first;
    score[held - 1] = std::numeric_limits<float>::max();  // the newest
    int64_t count = held;
    if (config.kind == SelectionKind::kTopK) {
      count = std::min(held, config.budget);
    } else {
      count = std::max<int64_t>(1, count_not_below_on_host(score, 1, held, threshold));  // the newest, even at inf
      if (config.kind == SelectionKind::kDynamic && config.budget > 0) count = std::min(count, config.budget);
    }
    counts[static_cast<std::size_t>(h)] = count;
    k = std::max(k, count);
  }
  keep.assign(static_cast<std::size_t>(heads * k), -1);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t first = vacant != nullptr ? vacant[h] : 0, count = counts[static_cast<std::size_t>(h)];
    int64_t* row = keep.data() + h * k + (k - count);
    keep_top_k_on_host(scores + h * n + first, 1, n - first, count, row, order);
    for (int64_t j = 0; j < count; ++j) row[j] += first;
  }
  return k;
}

at::Tensor force_keep_newest(const at::Tensor& scores) {
  at::Tensor forced = scores.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  forced.select(1, forced.size(1) - 1).fill_(std::numeric_limits<float>::max());
  return forced;
}

int64_t max_count_not_below(const at::Tensor& scores, double threshold) {
  if (OnHost(scores)) {
    const at::Tensor s = scores.contiguous();
    return count_not_below_on_host(s.data_ptr<float>(), s.size(0), s.size(1), static_cast<float>(threshold));
  }
  return scores.size(1) - scores.lt(threshold).sum(1).min().item<int64_t>();
}

at::Tensor keep_top_k_per_head(const at::Tensor& scores, int64_t k) {
  const int64_t n = scores.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "cannot keep ", k, " of ", n, " tokens");
  if (OnHost(scores)) {
    const at::Tensor s = scores.contiguous();
    at::Tensor keep = at::empty({s.size(0), k}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
    std::vector<int64_t> order;
    keep_top_k_on_host(s.data_ptr<float>(), s.size(0), n, k, keep.data_ptr<int64_t>(), order);
    return keep;
  }
  // Stable ascending sort: equal scores stay in chronological order, so dropping the front keeps the newer.
  at::Tensor order = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/1, /*descending=*/false));
  return std::get<0>(order.narrow(1, n - k, k).sort(1));
}

at::Tensor select_tokens(const at::Tensor& scores, const SelectionConfig& config,
                         const at::Tensor& selection_params) {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) >= 1, "scores must be [kv_heads, n >= 1], got ", scores.sizes());
  const bool dynamic = config.kind == SelectionKind::kDynamic;
  TORCH_CHECK(!dynamic || (selection_params.defined() && selection_params.numel() == 1),
              "dynamic selection needs its log-threshold parameter");
  const double log_threshold = dynamic ? selection_params.item<double>() : 0.0;
  const int64_t heads = scores.size(0), n = scores.size(1);
  if (OnHost(scores)) {
    at::Tensor forced = scores.clone(at::MemoryFormat::Contiguous);
    std::vector<int64_t> keep, order;
    const int64_t k = select_tokens_on_host(forced.data_ptr<float>(), heads, n, config, log_threshold, keep, order);
    at::Tensor out = at::empty({heads, k}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
    std::copy(keep.begin(), keep.end(), out.data_ptr<int64_t>());
    return out;
  }
  const at::Tensor forced = force_keep_newest(scores);
  int64_t k = n;
  switch (config.kind) {
    case SelectionKind::kBinary:
      k = max_count_not_below(forced, static_cast<double>(config.threshold));
      break;
    case SelectionKind::kTopK:
      TORCH_CHECK(config.budget > 0, "top-k selection needs a budget > 0");
      k = std::min(n, config.budget);
      break;
    case SelectionKind::kDynamic:
      k = std::max<int64_t>(1, max_count_not_below(forced, std::exp(log_threshold)));  // the newest, even at inf
      if (config.budget > 0) k = std::min(k, config.budget);
      break;
  }
  return keep_top_k_per_head(forced, k);
}

}  // namespace namm
