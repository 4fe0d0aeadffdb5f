// Peak resident memory of a code region, from Linux's VmHWM (reset through /proc/self/clear_refs).
#pragma once

#include <cstdint>

namespace namm::bench {

class PeakMemory {
 public:
  // Resets the high-water mark and records the current resident size.
  void Start();
  // Bytes by which the resident size peaked above its value at Start().
  int64_t PeakAboveStartBytes() const;

 private:
  int64_t start_rss_ = 0;
};

}  // namespace namm::bench
