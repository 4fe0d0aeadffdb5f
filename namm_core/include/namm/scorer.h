// Token scorers over a flat parameter vector (spec §4).
//
// A scorer maps each cached token's 25 features ([8 recency dims, 17 normalized spectrogram bins]) to a score;
// tokens scoring below zero are candidates for eviction. Its parameters are a slice of the NAMM's flat vector,
// laid out as scorer_config.h describes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "namm/scorer_config.h"
#include "namm/status.h"

namespace namm {

// A scorer bound to one parameter vector. Score() and ScoreOnHost() are const and safe to call from several
// threads.
class Scorer {
 public:
  virtual ~Scorer() = default;
  // features [kv_heads, n, 25] float32 -> scores [kv_heads, n] float32, on the parameters' device. A token's score
  // depends on its own features and those of newer tokens (later rows) alone, so rows put before a head's
  // tokens change none of theirs (NammPolicy scores a sequence's layers together so, left-padded).
  virtual at::Tensor Score(const at::Tensor& features) const = 0;
  // One KV head's scores[i], i < n, from features x [n][25] (rows x_stride floats apart) in host memory, with
  // our CPU kernels and no tensor operation: the computation Score() runs per head on the CPU, so the two give
  // the same bits. `workspace` is the caller's, reused across calls. False (nothing written) when the
  // parameters are not float32 on the host: call Score() instead.
  virtual bool ScoreOnHost(const float* x, int64_t x_stride, int64_t n, float* scores,
                           std::vector<float>& workspace) const = 0;
};

// params: [scorer_param_count(config)] float32, on the device where scoring will run.
Result<std::unique_ptr<Scorer>> make_scorer(const ScorerConfig& config, const at::Tensor& params);

}  // namespace namm
