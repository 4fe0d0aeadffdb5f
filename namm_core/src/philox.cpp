#include "namm/philox.h"

#include <cmath>

namespace namm {

namespace {

constexpr uint32_t kMultiplier0 = 0xD2511F53u;
constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kKeyBump0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kKeyBump1 = 0xBB67AE85u;  // sqrt(3) - 1

// 53 random bits from two words, as an integer in [0, 2^53).
uint64_t Bits53(uint32_t high, uint32_t low) {
  return ((static_cast<uint64_t>(high) << 32) | low) >> 11;
}

}  // namespace

PhiloxBlock philox4x32_10(const PhiloxCounter& counter, uint64_t key) {
  PhiloxBlock x = counter;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMultiplier0) * x[0];
    const uint64_t p1 = static_cast<uint64_t>(kMultiplier1) * x[2];
    const auto hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const auto hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    x = {hi1 ^ x[1] ^ k0, lo1, hi0 ^ x[3] ^ k1, lo0};
    k0 += kKeyBump0;
    k1 += kKeyBump1;
  }
  return x;
}

std::array<double, 2> philox_normal_pair(const PhiloxCounter& counter, uint64_t key) {
  const PhiloxBlock b = philox4x32_10(counter, key);
  // u1 in (0, 1] keeps the logarithm finite; u2 in [0, 1).
  const double u1 = (static_cast<double>(Bits53(b[0], b[1])) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(Bits53(b[2], b[3])) * 0x1.0p-53;
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * M_PI * u2;
  return {radius * std::cos(angle), radius * std::sin(angle)};
}

double philox_uniform(const PhiloxCounter& counter, uint64_t key) {
  const PhiloxBlock b = philox4x32_10(counter, key);
  return static_cast<double>(Bits53(b[0], b[1])) * 0x1.0p-53;
}

}  // namespace namm
