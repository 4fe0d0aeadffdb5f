#include "namm/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <memory>

namespace namm {

namespace {

// Bounds on one match attempt, far above what real patterns need on real text (PCRE2's defaults, 10 million
// steps and 20 GB, let a pattern from a file spend that at every start position of a text): catastrophic
// backtracking fails with "match limit exceeded" instead.
constexpr uint32_t kMatchLimit = 1'000'000;       // backtracking steps
constexpr uint32_t kDepthLimit = 1'000'000;       // nested backtracking points (the interpreter's frames)
constexpr PCRE2_SIZE kHeapLimitKiB = 256 * 1024;  // the interpreter's backtracking memory

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  pcre2_match_context* limits = nullptr;  // only read while matching, so shared by every thread
  ~Code() {
    pcre2_match_context_free(limits);
    pcre2_code_free(code);
  }
};

Result<Regex> Regex::Compile(const std::string& pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                                   &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    return Status::InvalidArgument("regex '" + pattern + "' does not compile at offset " + std::to_string(offset) +
                                   ": " + reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  Regex regex;
  regex.code_ = std::make_shared<Code>();
  regex.code_->code = code;
  regex.code_->limits = pcre2_match_context_create(nullptr);
  if (regex.code_->limits == nullptr) return Status::Internal("out of memory creating a PCRE2 match context");
  pcre2_set_match_limit(regex.code_->limits, kMatchLimit);
  pcre2_set_depth_limit(regex.code_->limits, kDepthLimit);
  pcre2_set_heap_limit(regex.code_->limits, kHeapLimitKiB);
  return regex;
}

Result<std::vector<std::pair<std::size_t, std::size_t>>> Regex::FindAll(const std::string& text) const {
  std::vector<std::pair<std::size_t, std::size_t>> matches;
  const std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> data(
      pcre2_match_data_create_from_pattern(code_->code, nullptr), pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t start = 0;
  while (start <= text.size()) {
    // The text is valid UTF-8 (callers sanitize it); without this flag PCRE2 re-validates the rest of the
    // subject on every call, which makes a long text quadratic.
    int rc =
        pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.get(), code_->limits);
    // The JIT's stack is small (32 KB); the interpreter keeps its backtracking on the heap.
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                       data.get(), code_->limits);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      return Status::FailedPrecondition("a regex match from byte " + std::to_string(start) + " of a " +
                                        std::to_string(text.size()) + "-byte text failed: " +
                                        reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const std::size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {  // an empty match: step over one character
      if (begin >= text.size()) break;
      start = begin + 1;
      while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
      continue;
    }
    matches.emplace_back(begin, end);
    start = end;
  }
  return matches;
}

}  // namespace namm
