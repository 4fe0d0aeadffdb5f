// Online z-score normalization of the spectrogram features (spec §3.5).
//
// One 17-dim mean and variance is shared by all layers, heads and tokens. Statistics are gathered while the
// normalizer is "collecting" (in the reference: the stage-1, generation-0 evaluation of the all-zero NAMM) and
// then "frozen" and stored with every checkpoint. Statistics from different workers or updates merge exactly
// (Chan et al.), so the order in which they are gathered does not matter beyond floating-point rounding.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>

#include "namm/feature_constants.h"
#include "namm/norm_stats.h"

namespace namm {

// Statistics of `values` [..., 17] (any float dtype and device).
NormStats norm_stats_of(const at::Tensor& values);

// Not thread-safe: Normalize mutates the statistics while collecting and caches them once frozen.
class FeatureNormalizer {
 public:
  FeatureNormalizer(NormState state, NormStats stats) : state_(state), stats_(stats) {}

  // ema: [..., 17] float32 -> (ema - mean) / max(sqrt(var), 1e-7), float32, same shape and device.
  // While collecting, the statistics used already include `ema` (the reference normalizes with the running
  // statistics, current update included, until they are frozen). Frozen with no statistics (count 0), the
  // input is returned unnormalized, as the reference does.
  at::Tensor Normalize(const at::Tensor& ema);
  // The same for a ragged cache's ema [kv_heads, n, 17] (kv_cache.h): while collecting, only each head's own
  // slots, vacant[h] on, are counted (vacant null: all).
  at::Tensor Normalize(const at::Tensor& ema, const int64_t* vacant);

  // The map Normalize applies once frozen with statistics, (ema - mean[f]) / scale[f] in float32, for callers
  // that normalize host memory themselves. False while collecting or frozen without statistics (then Normalize
  // must run).
  bool FrozenAffine(std::array<float, kStftBins>& mean, std::array<float, kStftBins>& scale) const;
  NormState state() const { return state_; }
  const NormStats& stats() const { return stats_; }
  void Freeze() { state_ = NormState::kFrozen; }

 private:
  NormState state_;
  NormStats stats_;
  // Frozen statistics as float32 tensors on the device last normalized on: built once, not at every update.
  at::Tensor frozen_mean_, frozen_scale_;
};

}  // namespace namm
