// Binary records for what the store keeps as blobs: the optimizer state, its eigensystem and the frozen
// normalization statistics. Each record is little-endian with a magic, a format version and a CRC-32, so a
// damaged or foreign blob is refused with a message instead of being restored.
//
// The optimizer state is stored without its eigensystem (at N = 4172 the basis is 139 MB and, under the lazy
// schedule, changes only every ~126 generations): the store keeps eigensystems apart, once per decomposition,
// and the state records which one it uses (state.eigen.generation).
#pragma once

#include <string>
#include <string_view>

#include "namm/coordinator/cma_es.h"
#include "namm/norm_stats.h"
#include "namm/status.h"

namespace namm::coordinator {

// m, sigma, C (only the lower triangle of a full C: N(N+1)/2 values), p_c, p_sigma, g, the eigensystem's
// generation, the best member and its fitness and generation.
std::string encode_cmaes_state(const CmaesState& state);
// Checks the record against `params` (dimension, covariance kind); the eigensystem comes back empty except for
// its generation. A full C's upper triangle is zero, as tell() leaves it.
Result<CmaesState> decode_cmaes_state(std::string_view record, const CmaesParams& params, const std::string& what);

std::string encode_eigensystem(const Eigensystem& eigen);
Result<Eigensystem> decode_eigensystem(std::string_view record, const CmaesParams& params, const std::string& what);

std::string encode_norm_stats(const NormStats& stats);
Result<NormStats> decode_norm_stats(std::string_view record, const std::string& what);

}  // namespace namm::coordinator
