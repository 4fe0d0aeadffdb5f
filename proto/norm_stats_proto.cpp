#include "namm/v1/norm_stats_proto.h"

namespace namm::v1 {

void norm_stats_to_proto(const namm::NormStats& stats, v1::NormStats* out) {
  out->set_count(stats.count);
  out->mutable_mean()->Add(stats.mean.begin(), stats.mean.end());
  out->mutable_var()->Add(stats.var.begin(), stats.var.end());
}

std::optional<namm::NormStats> norm_stats_from_proto(const v1::NormStats& message) {
  constexpr int kBins = static_cast<int>(kStftBins);
  if (message.mean_size() != kBins || message.var_size() != kBins) return std::nullopt;
  namm::NormStats stats;
  stats.count = message.count();
  std::copy(message.mean().begin(), message.mean().end(), stats.mean.begin());
  std::copy(message.var().begin(), message.var().end(), stats.var.begin());
  return stats;
}

}  // namespace namm::v1
