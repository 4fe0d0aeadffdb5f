// The benchmarks' command lines: --key value pairs, --help (or -h) printing the bench's usage, and errors that
// name the option (an unknown key, a key without a value, a value that is not a number).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace namm::bench {

// Comma-separated counts: "8192,32768" -> {8192, 32768}.
inline std::vector<int64_t> ParseCounts(const std::string& text) {
  std::vector<int64_t> counts;
  for (std::size_t begin = 0; begin < text.size();) {
    const std::size_t end = std::min(text.find(',', begin), text.size());
    counts.push_back(std::stoll(text.substr(begin, end - begin)));
    begin = end + 1;
  }
  return counts;
}

// Calls take(key, value) for each pair; take returns false for a key it does not know, and may throw (std::stoll
// on a bad number). Returns the exit code when the program should stop here: 0 after --help, 2 after an error
// (printed with the usage); nullopt to run.
inline std::optional<int> ParseArgs(int argc, char** argv, const char* usage,
                                    const std::function<bool(const std::string& key, const std::string& value)>& take) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::printf("%s", usage);
      return 0;
    }
  }
  for (int i = 1; i < argc; i += 2) {
    const std::string key = argv[i];
    if (i + 1 == argc) {
      std::fprintf(stderr, "%s needs a value\n\n%s", key.c_str(), usage);
      return 2;
    }
    try {
      if (!take(key, argv[i + 1])) {
        std::fprintf(stderr, "unknown option %s\n\n%s", key.c_str(), usage);
        return 2;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s %s: not a valid value (%s)\n\n%s", key.c_str(), argv[i + 1], e.what(), usage);
      return 2;
    }
  }
  return std::nullopt;
}

}  // namespace namm::bench
