// Token scorers over a flat parameter vector (spec §4).
//
// A scorer maps each cached token's 25 features ([8 recency dims, 17 normalized spectrogram bins]) to a score;
// tokens scoring below zero are candidates for eviction. Its parameters are a slice of the NAMM's flat vector,
// laid out as scorer_config.h describes.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

#include "namm/scorer_config.h"
#include "namm/status.h"

namespace namm {

// A scorer bound to one parameter vector. Score() is const and safe to call from several threads.
class Scorer {
 public:
  virtual ~Scorer() = default;
  // features [kv_heads, n, 25] float32 -> scores [kv_heads, n] float32, on the parameters' device.
  virtual at::Tensor Score(const at::Tensor& features) const = 0;
};

// params: [scorer_param_count(config)] float32, on the device where scoring will run.
Result<std::unique_ptr<Scorer>> make_scorer(const ScorerConfig& config, const at::Tensor& params);

}  // namespace namm
