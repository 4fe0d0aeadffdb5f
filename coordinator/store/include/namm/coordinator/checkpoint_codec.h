// Binary records for what the store keeps as blobs: the optimizer state, its eigensystem and the frozen
// normalization statistics. Each record is little-endian with a magic, a format version and a CRC-32, so a
// damaged or foreign blob is refused with a message instead of being restored.
//
// The optimizer state is stored without its eigensystem (at N = 4172 the basis is 139 MB): the eigensystem is a
// function of the covariance it was computed from, which the store keeps in a snapshot. A state record holds its
// covariance (a snapshot) or not (a light checkpoint: every vector, O(N)).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "namm/coordinator/cma_es.h"
#include "namm/norm_stats.h"
#include "namm/status.h"

namespace namm::coordinator {

// m, sigma, C (only the lower triangle of a full C: N(N+1)/2 values) unless !with_covariance, p_c, p_sigma, g,
// the eigensystem's generation, the pending decomposition's generation (its covariance must be the state's C:
// snapshots are taken when a decomposition is requested), the best member and its fitness and generation.
std::string encode_cmaes_state(const CmaesState& state, bool with_covariance = true);
// Checks the record against `params` (dimension, covariance kind); the eigensystem comes back empty except for
// its generation, the covariance empty unless the record holds it (`has_covariance`). A full C's upper triangle
// is zero, as tell() leaves it. Reads version 1 records (always with their covariance) too.
Result<CmaesState> decode_cmaes_state(std::string_view record, const CmaesParams& params, const std::string& what,
                                      bool* has_covariance = nullptr);

// Eigensystems as older builds stored them (read when converting such a run).
std::string encode_eigensystem(const Eigensystem& eigen);
Result<Eigensystem> decode_eigensystem(std::string_view record, const CmaesParams& params, const std::string& what);
// A CRC-32 of the eigensystem's scales and basis: a recomputed eigensystem is checked against the original.
uint32_t eigensystem_checksum(const Eigensystem& eigen);

std::string encode_norm_stats(const NormStats& stats);
Result<NormStats> decode_norm_stats(std::string_view record, const std::string& what);

}  // namespace namm::coordinator
