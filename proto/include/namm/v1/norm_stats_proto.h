// Normalization statistics between namm::NormStats and their protocol message (coordinator.proto's NormStats).
#pragma once

#include <optional>

#include "namm/norm_stats.h"
#include "namm/v1/coordinator.pb.h"

namespace namm::v1 {

void norm_stats_to_proto(const namm::NormStats& stats, v1::NormStats* out);
// None when the message does not hold kStftBins means and variances.
std::optional<namm::NormStats> norm_stats_from_proto(const v1::NormStats& message);

}  // namespace namm::v1
