#include "namm/feature_norm.h"

#include <cmath>

#include "aten.h"

namespace namm {

NormStats norm_stats_of(const at::Tensor& values) {
  TORCH_CHECK(values.size(-1) == kStftBins, "normalization expects ", kStftBins, " features, got ", values.sizes());
  NormStats stats;
  at::Tensor flat = values.reshape({-1, kStftBins}).to(at::kDouble);
  stats.count = flat.size(0);
  if (stats.count == 0) return stats;
  at::Tensor mean = flat.mean(0);
  at::Tensor var = (flat - mean).square_().mean(0);
  at::Tensor both = at::stack({mean, var}).cpu();  // one transfer of 34 numbers when on a GPU
  auto v = both.accessor<double, 2>();
  for (int64_t f = 0; f < kStftBins; ++f) {
    stats.mean[static_cast<std::size_t>(f)] = v[0][f];
    stats.var[static_cast<std::size_t>(f)] = v[1][f];
  }
  return stats;
}

at::Tensor FeatureNormalizer::Normalize(const at::Tensor& ema) {
  if (state_ == NormState::kCollecting) stats_ = stats_.Merge(norm_stats_of(ema));
  // Frozen before anything was collected: the reference skips normalization (with a warning) in this state.
  if (stats_.count == 0) return ema.clone();
  const bool frozen = state_ == NormState::kFrozen;
  if (frozen && frozen_mean_.defined() && frozen_mean_.device() == ema.device()) {
    return (ema - frozen_mean_) / frozen_scale_;
  }
  // Statistics are applied in float32, as the reference stores and applies them.
  at::Tensor mean = at::empty({kStftBins}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  at::Tensor scale = at::empty({kStftBins}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  auto mean_values = mean.accessor<float, 1>();
  auto scale_values = scale.accessor<float, 1>();
  for (std::size_t f = 0; f < stats_.mean.size(); ++f) {
    const auto i = static_cast<int64_t>(f);
    mean_values[i] = static_cast<float>(stats_.mean[f]);
    scale_values[i] = std::max(std::sqrt(static_cast<float>(stats_.var[f])), 1e-7f);
  }
  mean = mean.to(ema.device());
  scale = scale.to(ema.device());
  if (frozen) {
    frozen_mean_ = mean;
    frozen_scale_ = scale;
  }
  return (ema - mean) / scale;
}

}  // namespace namm
