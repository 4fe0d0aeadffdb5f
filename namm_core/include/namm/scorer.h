// Token scorers over a flat parameter vector (spec §4).
//
// A scorer maps each cached token's 25 features ([8 recency dims, 17 normalized spectrogram bins]) to a score;
// tokens scoring below zero are candidates for eviction. Its parameters are a slice of the NAMM's flat vector
// (the vector CMA-ES evolves), in the reference layout: each linear layer stores its weight as (in, out)
// row-major, W[i, o] at offset i * out + o, followed by its bias.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "namm/recency_embedding.h"
#include "namm/status.h"
#include "namm/stft_features.h"

namespace namm {

constexpr int64_t kFeatureDim = kRecencyDims + kStftBins;  // 25

enum class ScorerKind {
  kBam,  // backward attention memory network (the paper's NAMM)
  kMlp,  // two-layer MLP, each token scored on its own features alone
};

struct ScorerConfig {
  ScorerKind kind = ScorerKind::kBam;
  // BAM: width of the single attention head (the reference's shipped runs use 32).
  // MLP: width of the hidden layer; must equal kFeatureDim because of the residual h = x + ReLU(x W1 + b1).
  int64_t hidden = 32;
  // BAM only: biases of the qkv and output projections (the reference's scoring_attn_bias).
  bool attention_bias = true;
  // Bias of the final linear layer, and for the MLP also of its hidden layer (the reference's scoring_mlp_bias).
  bool mlp_bias = true;
};

// Default configurations of the two architectures.
ScorerConfig default_scorer_config(ScorerKind kind);
const char* scorer_kind_name(ScorerKind kind);  // "bam" | "mlp"
Status validate_scorer_config(const ScorerConfig& config);

// A named block of the flat parameter vector.
struct ParamBlock {
  std::string name;            // e.g. "bam.qkv.weight"
  std::vector<int64_t> shape;  // e.g. {25, 96}: (in, out) for weights
  int64_t offset = 0;
  int64_t numel() const;
};

// The blocks of a scorer's parameters, in vector order. The BAM with hidden 32 and all biases has 4172
// parameters: qkv.weight [25, 96], qkv.bias [96], out.weight [32, 50], out.bias [50], final.weight [25, 1],
// final.bias [1].
std::vector<ParamBlock> scorer_param_layout(const ScorerConfig& config);
int64_t scorer_param_count(const ScorerConfig& config);

// The score every token gets when the scorer's output layer ignores its input (its weights are all zero):
// the output bias (0 without one), exactly, for any finite features. nullopt otherwise. The all-zero NAMM
// that CMA-ES starts from is such a scorer.
std::optional<float> constant_score(const ScorerConfig& config, const std::vector<float>& params);

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
