// Recency ("oldness") embedding of cached tokens (spec §3.6).
//
// recency r = p_newest - p, where p is a token's absolute position and p_newest the position of the newest
// token in the same head's cache (its last slot), so the newest token has r = 0. With f_i = 50000^(-i/4):
//   emb(r) = [sin(r f_0), sin(r f_1), sin(r f_2), sin(r f_3), cos(r f_0), cos(r f_1), cos(r f_2), cos(r f_3)]
// computed in float64 and rounded to float32 (the reference tabulates it that way). Not normalized.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "namm/feature_constants.h"

namespace namm {

// positions: [kv_heads, n] int64, chronological per head (newest last), n >= 1 -> [kv_heads, n, 8] float32.
// On the host the values come from a table by distance (computed with the C library's sin and cos in float64;
// a device computes them element by element, which may differ in the last bit of a float64 before rounding).
at::Tensor recency_embedding(const at::Tensor& positions);

// One head's embeddings on the host: row j (out + j * out_stride, 8 floats) for positions[j], j < n, the
// newest last.
void recency_embedding_on_host(const int64_t* positions, int64_t n, float* out, int64_t out_stride);

}  // namespace namm
