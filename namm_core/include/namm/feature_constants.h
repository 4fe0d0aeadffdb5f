// The fixed constants of the NAMM token features (spec §3), shared by the feature code, the scorers and the
// NAMM file format. Torch-free, so that code which only stores or describes NAMMs needs no tensor library.
#pragma once

#include <cstdint>

namespace namm {

constexpr int64_t kStftWindow = 32;                 // n_fft = win_length
constexpr int64_t kStftHop = 16;                    // = kStftWindow - kStftHop samples carried between hops
constexpr int64_t kStftBins = kStftWindow / 2 + 1;  // 17 one-sided bins
constexpr double kEmaCoefficientPerQuery = 0.99;    // the EMA decays by this per query, 0.99^16 per frame

constexpr int64_t kRecencyDims = 8;
constexpr double kRecencyMaxFrequency = 50000.0;

constexpr int64_t kFeatureDim = kRecencyDims + kStftBins;  // 25: [8 recency dims, 17 spectrogram bins]

// Precision of the attention probabilities the features are computed from. The reference hands bfloat16
// probabilities to the NAMM and averages them over query heads in bfloat16 (spec §9.7); kBf16 reproduces
// that rounding bit for bit, kF32 keeps full precision.
enum class AttentionPrecision { kBf16, kF32 };

}  // namespace namm
