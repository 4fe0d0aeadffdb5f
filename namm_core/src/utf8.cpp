#include "namm/utf8.h"

#include <algorithm>

namespace namm {

int utf8_sequence_length(const std::string& s, std::size_t i) {
  auto byte = [&](std::size_t k) { return k < s.size() ? static_cast<unsigned char>(s[k]) : 0x100u; };
  const unsigned b0 = byte(i);
  if (b0 < 0x80) return 1;
  // Allowed range of the second byte for each lead byte; later bytes are always 80..BF.
  unsigned lo = 0x80, hi = 0xBF;
  int length = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong form
    if (b0 == 0xED) hi = 0x9F;  // no surrogate
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlong form
    if (b0 == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return -1;
  }
  for (int k = 1; k < length; ++k) {
    const unsigned b = byte(i + static_cast<std::size_t>(k));
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return -k;
  }
  return length;
}

std::string utf8_encode(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

uint32_t utf8_decode(const std::string& c) {
  const auto b = [&](std::size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(c[k])); };
  switch (c.size()) {
    case 1: return b(0);
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default: return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

std::string sanitize_utf8(const std::string& bytes) { return utf8_prefix(bytes, std::string::npos); }

std::string utf8_prefix(const std::string& text, std::size_t max_bytes) {
  static const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  out.reserve(std::min(text.size(), max_bytes));
  for (std::size_t i = 0; i < text.size();) {
    const int n = utf8_sequence_length(text, i);
    const std::size_t length = n > 0 ? static_cast<std::size_t>(n) : kReplacement.size();
    if (out.size() + length > max_bytes) break;
    if (n > 0) {
      out.append(text, i, length);
    } else {
      out += kReplacement;
    }
    i += static_cast<std::size_t>(n > 0 ? n : -n);
  }
  return out;
}

}  // namespace namm
