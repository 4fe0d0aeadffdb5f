#include "namm/recency_embedding.h"

#include <ATen/ops/empty.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace namm {
namespace {

TEST(RecencyEmbedding, ClosedFormValues) {
  // One head holding tokens at positions 3, 900, 1000: recencies 997, 100, 0.
  at::Tensor positions = at::empty({1, 3}, at::TensorOptions().dtype(at::kLong));
  positions[0][0] = 3;
  positions[0][1] = 900;
  positions[0][2] = 1000;
  at::Tensor emb = recency_embedding(positions);
  ASSERT_EQ(emb.sizes(), (at::IntArrayRef{1, 3, 8}));
  const double freqs[4] = {1.0, 0.0668740305, 0.0044721360, 0.0002990698};  // 50000^(-i/4), spec §10
  const double recency[3] = {997, 100, 0};
  for (int k = 0; k < 3; ++k) {
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(emb[0][k][i].item<float>(), std::sin(recency[k] * freqs[i]), 2e-7) << k << "," << i;
      EXPECT_NEAR(emb[0][k][4 + i].item<float>(), std::cos(recency[k] * freqs[i]), 2e-7) << k << "," << i;
    }
  }
  // The newest token: sin = 0, cos = 1 exactly.
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(emb[0][2][i].item<float>(), 0.0f);
    EXPECT_EQ(emb[0][2][4 + i].item<float>(), 1.0f);
  }
}

TEST(RecencyEmbedding, EachHeadCountsFromItsOwnNewestToken) {
  at::Tensor positions = at::empty({2, 2}, at::TensorOptions().dtype(at::kLong));
  positions[0][0] = 10;
  positions[0][1] = 12;  // head 0: recencies 2, 0
  positions[1][0] = 5;
  positions[1][1] = 12;  // head 1: recencies 7, 0
  at::Tensor emb = recency_embedding(positions);
  EXPECT_NEAR(emb[0][0][0].item<float>(), std::sin(2.0), 1e-7);
  EXPECT_NEAR(emb[1][0][0].item<float>(), std::sin(7.0), 1e-7);
}

}  // namespace
}  // namespace namm
