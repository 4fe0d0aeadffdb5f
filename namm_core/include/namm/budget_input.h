// The budget as an input of the NAMM (issue 36; a deliberate difference: the reference's NAMM has no budget).
//
// A NAMM asked to keep at most B tokens per KV head (top-k, or a dynamic selection's cap) of the n its head holds
// sees the compression asked, pressure = log2(max(n, B) / B) (0 when nothing must go, 5.3 at 40x), through
// a learned embedding e [kFeatureDim] added to every token's features: x_j + pressure * e. One shift for all of a
// head's tokens still moves their ranking: in the BAM it shifts the queries, keys and values (q_i . k_j gains terms
// that depend on j), in the MLP the ReLU's inputs. So one NAMM may rank tokens differently at 8 tokens and at 64.
// Without a budget (pressure 0) the features are left untouched: the NAMM's own threshold scores exactly as the
// same NAMM without the input, and an embedding of zeros changes nothing anywhere.
#pragma once

#include <cstdint>
#include <vector>

#include "namm/selection_config.h"

namespace namm {

// The compression `selection` asks of a head holding n tokens (0 for binary selection, or when n <= its budget).
float budget_pressure(const SelectionConfig& selection, int64_t n);

// pressure * embedding, element by element in float32: the shift added to each token's features (host and
// device add these same floats, so both give the same bits).
std::vector<float> budget_shift(float pressure, const std::vector<float>& embedding);

// features[j * stride + c] += shift[c] for j < n, c < shift.size().
void add_budget_shift(const std::vector<float>& shift, float* features, int64_t n, int64_t stride);

}  // namespace namm
