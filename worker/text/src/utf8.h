// Byte helpers for the tokenizers (UTF-8 itself is namm/utf8.h's).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace namm::worker::utf8 {

// The characters of a valid UTF-8 string, each as its own string.
std::vector<std::string> Characters(const std::string& s);

// The byte a byte-fallback token "<0xXX>" (hex digits in either case) stands for, or -1.
int ByteTokenValue(const std::string& token);

}  // namespace namm::worker::utf8
