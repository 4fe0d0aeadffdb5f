// UTF-8, decoded one way for every reader of outside bytes (tokenizers, task text, the worker's reports):
// well-formed sequences only (no overlong forms, no surrogates, nothing past U+10FFFF), ill-formed bytes
// replaced by U+FFFD one maximal subpart at a time, as Python's errors="replace" and Rust do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace namm {

// Length of the well-formed sequence starting at s[i] (1-4), or, if there is none, minus the length of the
// maximal subpart of an ill-formed one (at least 1).
int utf8_sequence_length(const std::string& s, std::size_t i);

// The encoding of a code point (callers pass scalar values: below U+D800, U+E000 to U+10FFFF).
std::string utf8_encode(uint32_t code_point);

// The code point of one well-formed character.
uint32_t utf8_decode(const std::string& character);

// `bytes` with every ill-formed part replaced by U+FFFD.
std::string sanitize_utf8(const std::string& bytes);

// At most `max_bytes` bytes of sanitize_utf8(text), never ending inside a character (protobuf strings and JSON
// must be valid UTF-8).
std::string utf8_prefix(const std::string& text, std::size_t max_bytes);

}  // namespace namm
