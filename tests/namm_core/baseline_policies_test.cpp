#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "namm/h2o_policy.h"
#include "namm/l2_policy.h"
#include "namm/memory_policy.h"
#include "test_util.h"

namespace namm {
namespace {

at::Tensor Positions(int64_t n) { return at::arange(n, at::TensorOptions().dtype(at::kLong)); }

std::vector<int64_t> Row(const at::Tensor& keep, int64_t h) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < keep.size(1); ++i) out.push_back(keep[h][i].item<int64_t>());
  return out;
}

TEST(FullCachePolicy, KeepsEverything) {
  FullCachePolicy policy;
  LayerKVCache cache(3, 2, at::TensorOptions().dtype(at::kFloat), policy.token_state());
  ASSERT_TRUE(cache.Append(at::zeros({3, 7, 2}), at::zeros({3, 7, 2}), Positions(7)).ok());
  ASSERT_TRUE(apply_memory_update(policy, 0, cache).ok());
  EXPECT_EQ(cache.size(), 7);
}

TEST(H2OPolicy, KeepsRecentWindowPlusHeaviestAccumulatedAttention) {
  auto policy = H2OPolicy::Create(/*budget=*/3, /*recent=*/1);
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache(1, 2, at::TensorOptions().dtype(at::kFloat), (*policy)->token_state());
  ASSERT_TRUE(cache.Append(at::zeros({1, 6, 2}), at::zeros({1, 6, 2}), Positions(6)).ok());
  // Two query heads, one KV group; two queries. Accumulated: [0.5+0.2, 0.1, 0.3+0.3, 0, 0.1, 0] mean over heads.
  at::Tensor attention = at::zeros({2, 2, 6});
  for (int h = 0; h < 2; ++h) {
    attention[h][0][0] = 0.5;
    attention[h][0][2] = 0.3;
    attention[h][0][1] = 0.1;
    attention[h][0][4] = 0.1;
    attention[h][1][0] = 0.2;
    attention[h][1][2] = 0.3;
    attention[h][1][5] = 0.5;
  }
  ASSERT_TRUE((*policy)->Observe(0, attention, cache).ok());
  EXPECT_NEAR(cache.state("h2o.attention")[0][2].item<float>(), 0.6f, 1e-6);
  auto keep = (*policy)->Select(0, cache);
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(Row(*keep, 0), (std::vector<int64_t>{0, 2, 5}));  // heavy hitters 0 (0.7), 2 (0.6); recent 5
}

TEST(H2OPolicy, RefusesInconsistentBudgets) {
  EXPECT_FALSE(H2OPolicy::Create(0, 0).ok());
  EXPECT_FALSE(H2OPolicy::Create(4, 5).ok());
}

TEST(L2Policy, KeepsTheLowestKeyNormsAndTheNewest) {
  auto policy = L2Policy::Create(2);
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache(2, 1, at::TensorOptions().dtype(at::kFloat));
  at::Tensor keys = at::zeros({2, 4, 1});
  // Head 0 norms: 3, 1, 2, 9 -> lowest 1 (index 1) + newest (3). Head 1 norms: 1, 5, 0.5, 0.1 -> 2 and 3.
  const float k0[4] = {-3, 1, 2, 9}, k1[4] = {1, 5, -0.5f, 0.1f};
  for (int i = 0; i < 4; ++i) {
    keys[0][i][0] = k0[i];
    keys[1][i][0] = k1[i];
  }
  ASSERT_TRUE(cache.Append(keys, keys, Positions(4)).ok());
  auto keep = (*policy)->Select(0, cache);
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(Row(*keep, 0), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(Row(*keep, 1), (std::vector<int64_t>{2, 3}));
}

}  // namespace
}  // namespace namm
