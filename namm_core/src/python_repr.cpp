#include "namm/python_repr.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace namm {

std::string py_repr_float(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // Shortest round-trip significand, then CPython's layout: fixed notation for exponents -4..15.
  char buffer[40];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buffer, sizeof buffer, "%.*e", digits - 1, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  const std::string scientific = buffer;
  const std::size_t e = scientific.find('e');
  const bool negative = scientific[0] == '-';
  std::string significand;
  for (std::size_t i = negative ? 1 : 0; i < e; ++i) {
    if (scientific[i] != '.') significand += scientific[i];
  }
  while (significand.size() > 1 && significand.back() == '0') significand.pop_back();
  const int exponent = std::atoi(scientific.c_str() + e + 1);
  const int point = exponent + 1;  // digits before the decimal point
  std::string out = negative ? "-" : "";
  if (point > -4 && point <= 16) {
    if (point <= 0) {
      out += "0." + std::string(static_cast<std::size_t>(-point), '0') + significand;
    } else if (static_cast<std::size_t>(point) >= significand.size()) {
      out += significand + std::string(static_cast<std::size_t>(point) - significand.size(), '0') + ".0";
    } else {
      out += significand.substr(0, static_cast<std::size_t>(point)) + "." + significand.substr(static_cast<std::size_t>(point));
    }
    return out;
  }
  out += significand.substr(0, 1);
  if (significand.size() > 1) out += "." + significand.substr(1);
  std::snprintf(buffer, sizeof buffer, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return out + buffer;
}

}  // namespace namm
