// A compiled PCRE2 pattern (UTF + Unicode properties, JIT when available) for the pre-tokenizers.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "namm/status.h"

namespace namm::worker {

class Regex {
 public:
  static Result<Regex> Compile(const std::string& pattern);
  // [begin, end) byte ranges of the successive non-overlapping matches in `text`, which must be valid UTF-8.
  std::vector<std::pair<std::size_t, std::size_t>> FindAll(const std::string& text) const;

 private:
  struct Code;
  std::shared_ptr<Code> code_;
};

}  // namespace namm::worker
