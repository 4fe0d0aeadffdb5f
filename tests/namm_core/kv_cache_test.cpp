#include "namm/kv_cache.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace namm {
namespace {

at::Tensor Positions(int64_t start, int64_t n) { return at::arange(start, start + n, at::TensorOptions().dtype(at::kLong)); }

at::Tensor Index(const std::vector<std::vector<int64_t>>& rows) {
  at::Tensor t = at::zeros({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())},
                           at::TensorOptions().dtype(at::kLong));
  for (std::size_t h = 0; h < rows.size(); ++h)
    for (std::size_t i = 0; i < rows[h].size(); ++i) t[static_cast<int64_t>(h)][static_cast<int64_t>(i)] = rows[h][i];
  return t;
}

TEST(LayerKVCache, AppendThenGatherMovesEveryPerTokenTensorTogether) {
  LayerKVCache cache(2, 3, at::TensorOptions().dtype(at::kFloat), {{"ema", {2}, at::kFloat}});
  // Key of token t on head h = [100 h + t, ...]; value = -key; state ema = [t, t].
  at::Tensor keys = at::arange(5, at::TensorOptions().dtype(at::kFloat)).view({1, 5, 1}).expand({2, 5, 3}).clone();
  keys.select(0, 1).add_(100);
  ASSERT_TRUE(cache.Append(keys, -keys, Positions(10, 5)).ok());
  cache.state("ema").copy_(at::arange(5, at::TensorOptions().dtype(at::kFloat)).view({1, 5, 1}).expand({2, 5, 2}));
  EXPECT_EQ(cache.size(), 5);

  ASSERT_TRUE(cache.Gather(Index({{0, 2, 4}, {1, 3, 4}})).ok());
  EXPECT_EQ(cache.size(), 3);
  EXPECT_EQ(cache.tokens_seen(), 5);
  EXPECT_EQ(cache.keys()[1][0][0].item<float>(), 101.0f);
  EXPECT_EQ(cache.values()[0][1][2].item<float>(), -2.0f);
  EXPECT_EQ(cache.positions()[0][1].item<int64_t>(), 12);  // positions never change
  EXPECT_EQ(cache.positions()[1][0].item<int64_t>(), 11);
  EXPECT_EQ(cache.state("ema")[1][1][1].item<float>(), 3.0f);

  // New tokens after a gather: zero state, positions as given.
  ASSERT_TRUE(cache.Append(at::zeros({2, 1, 3}), at::zeros({2, 1, 3}), Positions(15, 1)).ok());
  EXPECT_EQ(cache.size(), 4);
  EXPECT_EQ(cache.positions()[1][3].item<int64_t>(), 15);
  EXPECT_EQ(cache.state("ema")[0][3][0].item<float>(), 0.0f);
  EXPECT_EQ(cache.state("ema")[0][2][0].item<float>(), 4.0f);
}

// The engine appends views of its packed rows ([t, kv_heads, head_dim] transposed): copied as they read, and a
// clone (a shared prefix handed to another sequence) shares no storage with its source.
TEST(LayerKVCache, AppendsStridedViewsAndClonesShareNothing) {
  LayerKVCache cache(3, 4, at::TensorOptions().dtype(at::kFloat), {{"ema", {2}, at::kFloat}});
  const at::Tensor rows = testing::RandomNormal({6, 3, 4}, 11);  // [t, kv_heads, head_dim]
  ASSERT_TRUE(cache.Append(rows.transpose(0, 1), (-rows).transpose(0, 1), Positions(0, 6)).ok());
  EXPECT_TRUE(cache.keys().equal(rows.transpose(0, 1)));
  EXPECT_TRUE(cache.values().equal((-rows).transpose(0, 1)));
  LayerKVCache copy = cache.Clone();
  cache.state("ema").fill_(7.0);
  ASSERT_TRUE(cache.Gather(Index({{0, 5}, {1, 5}, {2, 5}})).ok());
  EXPECT_EQ(copy.size(), 6);
  EXPECT_TRUE(copy.keys().equal(rows.transpose(0, 1)));
  EXPECT_EQ(copy.state("ema").abs().max().item<float>(), 0.0f);
  ASSERT_TRUE(copy.Append(rows.narrow(0, 0, 1).transpose(0, 1), rows.narrow(0, 0, 1).transpose(0, 1), Positions(6, 1)).ok());
  EXPECT_EQ(copy.tokens_seen(), 7);
  EXPECT_EQ(cache.tokens_seen(), 6);
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.keys()[2][1][3].item<float>(), rows[5][2][3].item<float>());
}

TEST(LayerKVCache, GrowthPreservesContents) {
  LayerKVCache cache(1, 0, at::TensorOptions().dtype(at::kFloat), {{"x", {}, at::kFloat}});
  for (int64_t t = 0; t < 300; ++t) {
    ASSERT_TRUE(cache.Append(at::Tensor(), at::Tensor(), Positions(t, 1)).ok());
    cache.state("x")[0][t].fill_(static_cast<double>(t));
  }
  EXPECT_EQ(cache.size(), 300);
  EXPECT_TRUE(cache.state("x")[0].equal(at::arange(300, at::TensorOptions().dtype(at::kFloat))));
  EXPECT_TRUE(cache.positions()[0].equal(Positions(0, 300)));
}

TEST(LayerKVCache, ExpectedLengthBoundsGrowthAndPreallocates) {
  auto append = [](LayerKVCache& cache, int64_t n) {
    const int64_t start = cache.tokens_seen();
    return cache.Append(at::zeros({1, n, 2}), at::zeros({1, n, 2}), Positions(start, n)).ok();
  };
  // Doubling would take 300 tokens' storage to 512; the bound stops it at the 300 the sequence can reach.
  LayerKVCache bounded(1, 2, at::TensorOptions().dtype(at::kFloat));
  bounded.ExpectTokens(300, /*allocate_now=*/false);
  ASSERT_TRUE(append(bounded, 200));
  EXPECT_EQ(bounded.capacity(), 200);
  ASSERT_TRUE(append(bounded, 1));
  EXPECT_EQ(bounded.capacity(), 300);
  // After evicting half, the room still counts only the tokens yet to come.
  ASSERT_TRUE(bounded.Gather(at::arange(0, 201, 2, at::TensorOptions().dtype(at::kLong)).view({1, -1})).ok());
  EXPECT_EQ(bounded.size(), 101);
  ASSERT_TRUE(append(bounded, 99));
  EXPECT_EQ(bounded.capacity(), 300);

  // Allocated whole at once: appending never reallocates (the storage the views point into stays put).
  LayerKVCache whole(1, 2, at::TensorOptions().dtype(at::kFloat));
  whole.ExpectTokens(1000, /*allocate_now=*/true);
  EXPECT_EQ(whole.capacity(), 1000);
  ASSERT_TRUE(append(whole, 1));
  const void* storage = whole.keys().data_ptr();
  for (int i = 0; i < 999; ++i) ASSERT_TRUE(append(whole, 1));
  EXPECT_EQ(whole.keys().data_ptr(), storage);
  EXPECT_EQ(whole.capacity(), 1000);
}

// What admission by memory counts: the storage allocated, and what an append will make it, before it happens.
TEST(LayerKVCache, ReservedBytesAfterAnAppendAreKnownBeforeIt) {
  LayerKVCache cache(2, 4, at::TensorOptions().dtype(at::kFloat));
  cache.ExpectTokens(300, /*allocate_now=*/false);
  const int64_t bytes_per_token = 2 * 2 * 4 * 4;
  for (const int64_t n : {int64_t{10}, int64_t{60}, int64_t{1}, int64_t{100}, int64_t{129}}) {
    const int64_t predicted = cache.reserved_kv_bytes_after(n);
    const int64_t start = cache.tokens_seen();
    ASSERT_TRUE(cache.Append(at::zeros({2, n, 4}), at::zeros({2, n, 4}), Positions(start, n)).ok());
    EXPECT_EQ(cache.reserved_kv_bytes(), predicted) << "after " << n;
    EXPECT_EQ(cache.reserved_kv_bytes(), cache.capacity() * bytes_per_token);
  }
  EXPECT_EQ(cache.capacity(), 300);  // 64, 128, 256, then the 300 the sequence can reach
}

TEST(LayerKVCache, RejectsBadIndicesAndShapes) {
  LayerKVCache cache(2, 4, at::TensorOptions().dtype(at::kFloat));
  EXPECT_FALSE(cache.Append(at::zeros({2, 3, 5}), at::zeros({2, 3, 4}), Positions(0, 3)).ok());
  ASSERT_TRUE(cache.Append(at::zeros({2, 3, 4}), at::zeros({2, 3, 4}), Positions(0, 3)).ok());
  EXPECT_FALSE(cache.Gather(Index({{0, 3}, {0, 1}})).ok());  // out of range
  EXPECT_FALSE(cache.Gather(Index({{1, 0}, {0, 1}})).ok());  // not ascending
  EXPECT_FALSE(cache.Gather(Index({{0, 1}})).ok());          // wrong head count
  EXPECT_EQ(cache.size(), 3);                                // nothing changed
  EXPECT_THROW(cache.state("nope"), c10::Error);
}

}  // namespace
}  // namespace namm
