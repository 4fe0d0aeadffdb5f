#include "namm/norm_stats.h"

namespace namm {

NormStats NormStats::Merge(const NormStats& other) const {
  if (other.count == 0) return *this;
  if (count == 0) return other;
  NormStats merged;
  merged.count = count + other.count;
  const double n = static_cast<double>(merged.count);
  const double wa = static_cast<double>(count) / n;
  const double wb = static_cast<double>(other.count) / n;
  for (std::size_t f = 0; f < mean.size(); ++f) {
    const double delta = other.mean[f] - mean[f];
    merged.mean[f] = wa * mean[f] + wb * other.mean[f];
    merged.var[f] = wa * var[f] + wb * other.var[f] + wa * wb * delta * delta;
  }
  return merged;
}

const char* norm_state_name(NormState state) {
  return state == NormState::kCollecting ? "collecting" : "frozen";
}

}  // namespace namm
