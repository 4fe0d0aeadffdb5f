// UTF-8 and byte helpers for the tokenizers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace namm::worker::utf8 {

// Length of the well-formed UTF-8 sequence starting at s[i] (1-4), or, if there is none, minus the length of
// the maximal subpart of an ill-formed one (the Unicode "maximal subpart" rule used by Python and Rust).
int SequenceLength(const std::string& s, std::size_t i);

// The characters of a valid UTF-8 string, each as its own string.
std::vector<std::string> Characters(const std::string& s);

// UTF-8 encoding of a code point.
std::string Encode(uint32_t code_point);

// Code point of the valid single character `c`.
uint32_t Decode(const std::string& c);

// The byte a byte-fallback token "<0xXX>" (hex digits in either case) stands for, or -1.
int ByteTokenValue(const std::string& token);

}  // namespace namm::worker::utf8
