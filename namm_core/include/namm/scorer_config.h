// Scorer architectures and their flat parameter layout (spec §4.2), without the tensor code that runs them.
//
// A NAMM's parameters are one flat vector (the vector CMA-ES evolves), in the reference layout: each linear
// layer stores its weight as (in, out) row-major, W[i, o] at offset i * out + o, followed by its bias.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "namm/feature_constants.h"
#include "namm/status.h"

namespace namm {

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

}  // namespace namm
