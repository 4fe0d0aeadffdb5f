// A compiled PCRE2 pattern: UTF-8, Unicode properties for \d \w \s \b (as Python 3's re does for str),
// JIT when available. Immutable and safe to share between threads.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "namm/status.h"

namespace namm {

class Regex {
 public:
  static Result<Regex> Compile(const std::string& pattern);
  // [begin, end) byte ranges of the successive non-overlapping matches in `text`, which must be valid UTF-8.
  std::vector<std::pair<std::size_t, std::size_t>> FindAll(const std::string& text) const;

 private:
  struct Code;
  std::shared_ptr<Code> code_;
};

}  // namespace namm
