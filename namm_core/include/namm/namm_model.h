// A NAMM: its architecture, its flat parameter vector and its feature-normalization statistics — everything
// needed to run it as a memory policy, and what CMA-ES evolves (the parameter vector).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "namm/feature_constants.h"
#include "namm/norm_stats.h"
#include "namm/scorer_config.h"
#include "namm/selection_config.h"
#include "namm/status.h"

namespace namm {

struct NammArchitecture {
  ScorerConfig scorer;
  SelectionConfig selection;
  AttentionPrecision attention_precision = AttentionPrecision::kBf16;
  // The budget as an input (budget_input.h; a deliberate difference from the reference): kFeatureDim more
  // parameters, a learned embedding added to every token's features in proportion to the compression a budget
  // asks for. Without a budget the NAMM scores as without it.
  bool budget_input = false;

  // Length of the flat parameter vector: the scorer's parameters, then the selection's, then the budget
  // embedding's (when budget_input).
  int64_t param_count() const;
  Status Validate() const;

  // JSON form stored in NAMM files. It also records the fixed feature constants (STFT window 32, hop 16, EMA
  // 0.99, 8 recency dims, max frequency 50000) so that a file from a build with other constants is refused.
  std::string ToJson() const;
  static Result<NammArchitecture> FromJson(const std::string& json);
  // One line for people, e.g. "bam(hidden=32, attention_bias, mlp_bias) + binary selection, bf16 attention".
  std::string Describe() const;
};

struct NammModel {
  NammArchitecture architecture;
  // [architecture.param_count()], the reference's flat layout (see scorer_param_layout), selection last.
  std::vector<float> params;
  NormState norm_state = NormState::kCollecting;
  NormStats norm_stats;
  // Free-form provenance (who trained it, on what, at which generation). Keys must not start with "namm.".
  std::map<std::string, std::string> metadata;

  // Sizes match the architecture, every number is finite, variances are non-negative.
  Status Validate() const;
};

// The reference's initial vector: all zeros (every token scores 0 and is kept: the base model), except the
// dynamic selection's log-threshold, which starts at its configured initial value.
std::vector<float> initial_params(const NammArchitecture& architecture);

}  // namespace namm
