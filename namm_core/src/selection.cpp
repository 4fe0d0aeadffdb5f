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
    // Counted as the reference counts (scores >= threshold): a NaN is not counted, though its sort then keeps it
    // (NaN orders highest), one finite token fewer.
    for (int64_t i = 0; i < n; ++i) kept += scores[h * n + i] >= threshold ? 1 : 0;
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
  const int64_t heads = scores.size(0), n = scores.size(1);
  if (OnHost(scores)) {
    const double log_threshold = dynamic ? selection_params.item<double>() : 0.0;
    at::Tensor forced = scores.clone(at::MemoryFormat::Contiguous);
    std::vector<int64_t> keep, order;
    const int64_t k = select_tokens_on_host(forced.data_ptr<float>(), heads, n, config, log_threshold, keep, order);
    at::Tensor out = at::empty({heads, k}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
    std::copy(keep.begin(), keep.end(), out.data_ptr<int64_t>());
    return out;
  }
  return select_tokens_padded(scores.unsqueeze(0), {n}, config, selection_params).front();
}

std::vector<at::Tensor> select_tokens_padded(const at::Tensor& scores, const std::vector<int64_t>& n,
                                             const SelectionConfig& config, const at::Tensor& selection_params) {
  TORCH_CHECK(scores.dim() == 3 && scores.size(0) == static_cast<int64_t>(n.size()) && scores.size(2) >= 1,
              "padded scores must be [", n.size(), " sets, kv_heads, n >= 1], got ", scores.sizes());
  const bool dynamic = config.kind == SelectionKind::kDynamic;
  TORCH_CHECK(!dynamic || (selection_params.defined() && selection_params.numel() == 1),
              "dynamic selection needs its log-threshold parameter");
  TORCH_CHECK(config.kind != SelectionKind::kTopK || config.budget > 0, "top-k selection needs a budget > 0");
  const auto count = static_cast<int64_t>(n.size());
  const int64_t n_max = scores.size(2);
  // The padding is below every threshold and first in the ascending order, so never kept; each set's newest
  // slot is raised as force_keep_newest raises it.
  at::Tensor forced = scores.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  for (int64_t c = 0; c < count; ++c) {
    const int64_t size = n[static_cast<std::size_t>(c)];
    TORCH_CHECK(size >= 1 && size <= n_max, "set ", c, " has ", size, " scores of ", n_max, " columns");
    if (size < n_max) forced[c].narrow(1, 0, n_max - size).fill_(-std::numeric_limits<float>::infinity());
  }
  forced.select(2, n_max - 1).fill_(std::numeric_limits<float>::max());
  std::vector<int64_t> k(n);
  if (config.kind != SelectionKind::kTopK) {
    const double threshold =
        dynamic ? std::exp(selection_params.item<double>()) : static_cast<double>(config.threshold);
    // Per set, the max over heads of the tokens not below the threshold (count_not_below_on_host): n_max less the
    // fewest below, the padding counting as below.
    const at::Tensor fewest_below = forced.ge(threshold).logical_not_().sum(2).amin(1).to(at::kCPU).contiguous();
    const int64_t* below = fewest_below.data_ptr<int64_t>();
    for (int64_t c = 0; c < count; ++c) {
      int64_t& kept = k[static_cast<std::size_t>(c)];
      kept = std::min(kept, n_max - below[c]);
      if (dynamic) kept = std::max<int64_t>(1, kept);  // the newest, even at an infinite threshold
    }
  }
  if (config.kind != SelectionKind::kBinary && config.budget > 0) {
    for (int64_t& kept : k) kept = std::min(kept, config.budget);
  }
  // keep_top_k_per_head over every set: a stable ascending sort keeps equal scores in chronological order.
  const at::Tensor order = std::get<1>(forced.sort(/*stable=*/true, /*dim=*/2, /*descending=*/false));
  std::vector<at::Tensor> retained;
  retained.reserve(n.size());
  for (int64_t c = 0; c < count; ++c) {
    const int64_t kept = k[static_cast<std::size_t>(c)], padding = n_max - n[static_cast<std::size_t>(c)];
    at::Tensor keep = std::get<0>(order[c].narrow(1, n_max - kept, kept).sort(1));
    retained.push_back(padding > 0 ? keep.sub_(padding) : keep);
  }
  return retained;
}

}  // namespace namm
