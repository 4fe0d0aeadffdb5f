// Feature-normalization statistics (spec §3.5) as plain data: what checkpoints and NAMM files store.
#pragma once

#include <array>
#include <cstdint>

#include "namm/feature_constants.h"

namespace namm {

// Count, mean and population variance (divide by count) of a set of 17-dim feature vectors, in float64.
struct NormStats {
  int64_t count = 0;
  std::array<double, kStftBins> mean{};
  std::array<double, kStftBins> var{};

  // Statistics of the union of the two sets:
  //   n = n_a + n_b, mean = (n_a mean_a + n_b mean_b) / n,
  //   var = (n_a/n) var_a + (n_b/n) var_b + (n_a/n)(n_b/n)(mean_b - mean_a)^2.
  NormStats Merge(const NormStats& other) const;
};

enum class NormState {
  kCollecting,  // every Normalize() call first folds its input into the statistics
  kFrozen,      // statistics are fixed
};
const char* norm_state_name(NormState state);  // "collecting" | "frozen"

}  // namespace namm
