#include "namm/scorer_config.h"

#include <algorithm>

namespace namm {

ScorerConfig default_scorer_config(ScorerKind kind) {
  ScorerConfig config;
  config.kind = kind;
  config.hidden = kind == ScorerKind::kBam ? 32 : kFeatureDim;
  config.attention_bias = kind == ScorerKind::kBam;
  return config;
}

const char* scorer_kind_name(ScorerKind kind) { return kind == ScorerKind::kBam ? "bam" : "mlp"; }

Status validate_scorer_config(const ScorerConfig& config) {
  if (config.hidden < 1 || config.hidden > 4096) {
    return Status::InvalidArgument("scorer hidden size " + std::to_string(config.hidden) + " is outside [1, 4096]");
  }
  if (config.kind == ScorerKind::kMlp) {
    if (config.hidden != kFeatureDim) {
      return Status::InvalidArgument("the MLP scorer's hidden size must be " + std::to_string(kFeatureDim) +
                                     " (its residual adds the input), got " + std::to_string(config.hidden));
    }
    if (config.attention_bias) {
      return Status::InvalidArgument("the MLP scorer has no attention layer, so attention_bias must be false");
    }
  }
  return Status::Ok();
}

int64_t ParamBlock::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<ParamBlock> scorer_param_layout(const ScorerConfig& config) {
  std::vector<ParamBlock> blocks;
  int64_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    ParamBlock block{std::move(name), std::move(shape), offset};
    offset += block.numel();
    blocks.push_back(std::move(block));
  };
  // Each linear: weight (in, out), then bias.
  auto linear = [&](const std::string& name, int64_t in, int64_t out, bool bias) {
    add(name + ".weight", {in, out});
    if (bias) add(name + ".bias", {out});
  };
  if (config.kind == ScorerKind::kBam) {
    linear("bam.qkv", kFeatureDim, 3 * config.hidden, config.attention_bias);
    linear("bam.out", config.hidden, 2 * kFeatureDim, config.attention_bias);
    linear("bam.final", kFeatureDim, 1, config.mlp_bias);
  } else {
    linear("mlp.hidden", kFeatureDim, config.hidden, config.mlp_bias);
    linear("mlp.final", config.hidden, 1, config.mlp_bias);
  }
  return blocks;
}

int64_t scorer_param_count(const ScorerConfig& config) {
  int64_t total = 0;
  for (const auto& block : scorer_param_layout(config)) total += block.numel();
  return total;
}

std::optional<float> constant_score(const ScorerConfig& config, const std::vector<float>& params) {
  const std::string prefix = config.kind == ScorerKind::kBam ? "bam.final." : "mlp.final.";
  float bias = 0.0f;
  for (const auto& block : scorer_param_layout(config)) {
    if (block.offset + block.numel() > static_cast<int64_t>(params.size())) return std::nullopt;
    const auto begin = params.begin() + block.offset, end = begin + block.numel();
    if (block.name == prefix + "weight" && std::any_of(begin, end, [](float p) { return p != 0.0f; })) {
      return std::nullopt;
    }
    if (block.name == prefix + "bias") bias = *begin;
  }
  return bias;
}

}  // namespace namm
