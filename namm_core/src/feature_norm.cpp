#include "namm/feature_norm.h"

#include <algorithm>
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

namespace {
// Statistics are applied in float32, as the reference stores and applies them.
void AffineOf(const NormStats& stats, std::array<float, kStftBins>& mean, std::array<float, kStftBins>& scale) {
  for (std::size_t f = 0; f < mean.size(); ++f) {
    mean[f] = static_cast<float>(stats.mean[f]);
    scale[f] = std::max(std::sqrt(static_cast<float>(stats.var[f])), 1e-7f);
  }
}
}  // namespace

bool FeatureNormalizer::FrozenAffine(std::array<float, kStftBins>& mean, std::array<float, kStftBins>& scale) const {
  if (state_ != NormState::kFrozen || stats_.count == 0) return false;
  AffineOf(stats_, mean, scale);
  return true;
}

at::Tensor FeatureNormalizer::Normalize(const at::Tensor& ema) { return Normalize(ema, nullptr); }

at::Tensor FeatureNormalizer::Normalize(const at::Tensor& ema, const int64_t* vacant) {
  if (state_ == NormState::kCollecting && vacant == nullptr) stats_ = stats_.Merge(norm_stats_of(ema));
  if (state_ == NormState::kCollecting && vacant != nullptr) {
    for (int64_t h = 0; h < ema.size(0); ++h) {
      stats_ = stats_.Merge(norm_stats_of(ema[h].narrow(0, vacant[h], ema.size(1) - vacant[h])));
    }
  }
  // Frozen before anything was collected: the reference skips normalization (with a warning) in this state.
  if (stats_.count == 0) return ema.clone();
  const bool frozen = state_ == NormState::kFrozen;
  if (frozen && frozen_mean_.defined() && frozen_mean_.device() == ema.device()) {
    return (ema - frozen_mean_) / frozen_scale_;
  }
  at::Tensor mean = at::empty({kStftBins}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  at::Tensor scale = at::empty({kStftBins}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  std::array<float, kStftBins> mean_values{}, scale_values{};
  AffineOf(stats_, mean_values, scale_values);
  std::copy(mean_values.begin(), mean_values.end(), mean.data_ptr<float>());
  std::copy(scale_values.begin(), scale_values.end(), scale.data_ptr<float>());
  mean = mean.to(ema.device());
  scale = scale.to(ema.device());
  if (frozen) {
    frozen_mean_ = mean;
    frozen_scale_ = scale;
  }
  return (ema - mean) / scale;
}

}  // namespace namm
