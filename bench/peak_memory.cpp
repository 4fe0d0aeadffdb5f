#include "peak_memory.h"

#include <malloc.h>

#include <fstream>
#include <string>

namespace namm::bench {

namespace {
// A "VmRSS:  1234 kB" style field of /proc/self/status, in bytes.
int64_t StatusField(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return 0;
}
}  // namespace

void PeakMemory::Start() {
  // Freed heap memory still resident would be reused without raising the high-water mark: give it back first.
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current RSS
  start_rss_ = StatusField("VmRSS");
}

int64_t PeakMemory::PeakAboveStartBytes() const { return StatusField("VmHWM") - start_rss_; }

}  // namespace namm::bench
