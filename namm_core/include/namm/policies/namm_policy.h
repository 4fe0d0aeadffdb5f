// The NAMM memory policy (spec §2): at every memory update, for each layer and KV head,
//   spectrogram EMA (streamed by Observe) -> z-score normalization -> [recency embedding, features]
//   -> scorer -> selection,
// with one parameter vector shared by all layers and heads.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "namm/feature_norm.h"
#include "namm/policies/memory_policy.h"
#include "namm/namm_model.h"
#include "namm/scorer.h"

namespace namm {

class NammPolicy final : public MemoryPolicy {
 public:
  // Binds the model's parameters on `device` (where the caches and attention will live). The normalizer starts
  // from the model's statistics and, if they are still collecting, keeps folding in every update it sees.
  static Result<std::unique_ptr<NammPolicy>> Create(const NammModel& model, at::Device device = at::kCPU);

  // When the scorer is constant (constant_score: e.g. all-zero parameters), the features cannot change any
  // decision: Select skips them and the scorer, and Observe does nothing unless statistics are still being
  // collected. The kept tokens are exactly those of the full pipeline. Tracing disables the shortcut.
  std::string name() const override;
  // "namm.samples" [32] and "namm.ema" [17] float32 per token (see SpectrogramState); none when the
  // features are not needed (constant scorer, frozen statistics, no tracing).
  std::vector<TokenStateSpec> token_state() const override;
  bool needs_attention() const override { return true; }
  Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache) override;
  // Fails unless the sequence length is a multiple of the STFT hop (16), where every frame is complete.
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;

  // What the last Select() computed, kept only while tracing is on.
  struct Trace {
    at::Tensor features;  // [kv_heads, n, 25]: 8 recency dims, then 17 normalized spectrogram bins
    at::Tensor scores;    // [kv_heads, n]: raw scorer output, before the newest token is forced to be kept
    at::Tensor keep;      // [kv_heads, k] int64, ascending
  };
  // Enable before creating the caches (the constant-score shortcut may otherwise have dropped the features).
  void set_tracing(bool on) { tracing_ = on; }
  const Trace& last_trace() const { return trace_; }

  // The statistics in use, including any gathered by this policy while collecting.
  const FeatureNormalizer& normalizer() const { return normalizer_; }

 private:
  NammPolicy(const NammModel& model, std::unique_ptr<Scorer> scorer, at::Tensor selection_params);

  // The features are needed unless the scorer is constant and no statistics are being gathered.
  bool FeaturesNeeded() const;

  NammArchitecture architecture_;
  std::unique_ptr<Scorer> scorer_;
  std::optional<float> constant_score_;
  bool observe_skipped_ = false;
  at::Tensor selection_params_;
  FeatureNormalizer normalizer_;
  bool tracing_ = false;
  Trace trace_;
};

}  // namespace namm
