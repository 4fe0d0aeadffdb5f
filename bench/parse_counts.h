// Comma-separated counts on the benchmarks' command lines: "8192,32768" -> {8192, 32768}.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace namm::bench {

inline std::vector<int64_t> ParseCounts(const std::string& text) {
  std::vector<int64_t> counts;
  for (std::size_t begin = 0; begin < text.size();) {
    const std::size_t end = std::min(text.find(',', begin), text.size());
    counts.push_back(std::stoll(text.substr(begin, end - begin)));
    begin = end + 1;
  }
  return counts;
}

}  // namespace namm::bench
