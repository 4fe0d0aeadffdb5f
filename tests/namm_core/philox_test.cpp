#include "namm/philox.h"

#include <gtest/gtest.h>

#include <cmath>

namespace namm {
namespace {

// Known-answer vectors of Random123's tests/kat_vectors (the three "philox4x32 10" lines).
TEST(Philox, MatchesRandom123KnownAnswers) {
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, 0), (PhiloxBlock{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, 0xffffffffffffffffull),
            (PhiloxBlock{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, 0x299f31d0a4093822ull),
            (PhiloxBlock{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Philox, NormalPairsHaveUnitMomentsAndUniformsStayInRange) {
  double sum = 0, squares = 0, fourth = 0;
  const int blocks = 200000;
  for (uint32_t i = 0; i < blocks; ++i) {
    for (double z : philox_normal_pair({i, 7, 0, 0}, 42)) {
      sum += z;
      squares += z * z;
      fourth += z * z * z * z;
    }
    const double u = philox_uniform({i, 8, 0, 0}, 42);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
  const double n = 2.0 * blocks;
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(squares / n, 1.0, 0.01);
  EXPECT_NEAR(fourth / n, 3.0, 0.05);  // Gaussian kurtosis
}

}  // namespace
}  // namespace namm
