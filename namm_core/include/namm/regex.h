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
  // [begin, end) byte ranges of the successive non-overlapping matches in `text`, which must be valid UTF-8. A
  // match that outgrows the JIT's stack is done again by the interpreter; one that hits PCRE2's match, depth or
  // heap limit (1 million steps, 1 million nested backtracking points, 256 MiB per attempt: catastrophic
  // backtracking) is an error naming the reason and the offset: the rest of the text could not be matched,
  // and taking what was found as all of it would silently lose the rest.
  Result<std::vector<std::pair<std::size_t, std::size_t>>> FindAll(const std::string& text) const;

 private:
  struct Code;
  std::shared_ptr<Code> code_;
};

}  // namespace namm
