#include "namm/query_history.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "namm/kv_cache.h"
#include "namm/stft_features.h"

namespace namm {
namespace {

const at::TensorOptions kF32 = at::TensorOptions().dtype(at::kFloat);

// GqaMeanAttention (one fused pass on the CPU) against gqa_mean of Attention, in both precisions.
void ExpectGqaMeanOfAttention(const QueryHistory& history, const LayerKVCache& cache, int64_t from, int64_t to) {
  auto probs = history.Attention(cache, from, to);
  ASSERT_TRUE(probs.ok());
  for (auto precision : {AttentionPrecision::kF32, AttentionPrecision::kBf16}) {
    const at::Tensor out = at::full({cache.kv_heads(), to - from, cache.size()}, -1.0f, kF32);
    ASSERT_TRUE(history.GqaMeanAttention(cache, from, to, precision, out).ok());
    const at::Tensor expected = gqa_mean(*probs, cache.kv_heads(), precision);
    // bf16: a last-bit difference in exp may round to the neighbouring bfloat16.
    EXPECT_TRUE(at::allclose(out, expected, precision == AttentionPrecision::kF32 ? 1e-6 : 8e-3, 1e-7))
        << (out - expected).abs().max().item<float>();
  }
}

// The attention queries paid, computed again after the cache changed, against a softmax over the cache as it was
// when they ran: equal on the keys still cached, zero on keys that came later or are outside the window.
TEST(QueryHistory, RecomputesTheAttentionQueriesPaidOverTheCacheAsItIsNow) {
  const int64_t kv_heads = 2, group = 2, heads = kv_heads * group, hd = 8, n = 12, window = 9;
  at::manual_seed(3);
  LayerKVCache cache(kv_heads, hd, kF32);
  const at::Tensor keys = at::randn({kv_heads, n, hd}, kF32), values = at::randn({kv_heads, n, hd}, kF32);
  ASSERT_TRUE(cache.Append(keys, values, at::arange(n, kF32.dtype(at::kLong))).ok());
  // Queries 9, 10, 11 as the forward pass ran them: each over keys 0..itself within its window.
  const at::Tensor queries = at::randn({heads, 3, hd}, kF32);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  at::Tensor expected = at::zeros({heads, 3, n}, kF32), lse = at::empty({heads, 3}, kF32);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < 3; ++r) {
      const int64_t query = 9 + r, lo = query - window + 1;
      const at::Tensor scores = keys[h / group].narrow(0, lo, query + 1 - lo).matmul(queries[h][r]).mul(scale);
      expected[h][r].narrow(0, lo, query + 1 - lo).copy_(scores.softmax(0));
      lse[h][r] = scores.logsumexp(0);
    }
  }
  QueryHistory history;
  ASSERT_TRUE(history.Record(queries.narrow(1, 0, 2), lse.narrow(1, 0, 2), 9, window, 31).ok());
  ASSERT_TRUE(history.Record(queries.narrow(1, 2, 1), lse.narrow(1, 2, 1), 11, window, 31).ok());
  auto again = history.Attention(cache, 9, 12);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(at::allclose(*again, expected, 1e-5, 1e-6));
  ExpectGqaMeanOfAttention(history, cache, 9, 12);

  // Evict keys 1 and 5 from head 0 and 2 and 7 from head 1, append two new tokens: the survivors keep their
  // probabilities (the normalizer is the one of the time the query ran), the newcomers get nothing.
  const at::Tensor keep = at::tensor({0, 2, 3, 4, 6, 7, 8, 9, 10, 11, 0, 1, 3, 4, 5, 6, 8, 9, 10, 11},
                                     kF32.dtype(at::kLong)).view({2, 10});
  ASSERT_TRUE(cache.Gather(keep).ok());
  ASSERT_TRUE(cache.Append(at::randn({kv_heads, 2, hd}, kF32), at::randn({kv_heads, 2, hd}, kF32),
                           at::arange(12, 14, kF32.dtype(at::kLong))).ok());
  again = history.Attention(cache, 10, 12);
  ASSERT_TRUE(again.ok());
  for (int64_t h = 0; h < heads; ++h) {
    const at::Tensor kept = expected[h].narrow(0, 1, 2).index_select(1, keep[h / group]);
    EXPECT_TRUE(at::allclose((*again)[h].narrow(1, 0, 10), kept, 1e-5, 1e-6)) << "head " << h;
    EXPECT_TRUE((*again)[h].narrow(1, 10, 2).eq(0).all().item<bool>()) << "head " << h;
  }
  ExpectGqaMeanOfAttention(history, cache, 10, 12);
}

// The recomputed attention scales the products by 1 / sqrt(head_dim) exactly as libtorch's mul_ does (on the CPU
// in float32 it multiplies on its own thread), for a history large enough that mul_ would fork its thread pool:
// the same bits as the products scaled by mul_, less the log-sum-exp, exponentiated.
TEST(QueryHistory, RecomputedAttentionScalesTheProductsBitForBitAsMulDoes) {
  const int64_t kv_heads = 4, group = 2, heads = kv_heads * group, hd = 8, n = 300, rows = 31;
  at::manual_seed(5);
  LayerKVCache cache(kv_heads, hd, kF32);
  const at::Tensor keys = at::randn({kv_heads, n, hd}, kF32);
  ASSERT_TRUE(cache.Append(keys, at::randn({kv_heads, n, hd}, kF32), at::arange(n, kF32.dtype(at::kLong))).ok());
  const at::Tensor queries = at::randn({heads, rows, hd}, kF32), lse = at::randn({heads, rows}, kF32);
  QueryHistory history;
  ASSERT_TRUE(history.Record(queries, lse, n - rows, 0, 31).ok());
  const auto attention = history.Attention(cache, n - rows, n);
  ASSERT_TRUE(attention.ok()) << attention.status().ToString();
  ASSERT_GT(attention->numel(), 32768);
  const at::Tensor later = at::arange(n).view({1, 1, n}).gt(at::arange(n - rows, n).view({1, rows, 1}));
  const at::Tensor expected = at::bmm(queries.reshape({kv_heads, group * rows, hd}), keys.transpose(1, 2))
                                  .view({heads, rows, n})
                                  .mul_(1.0 / std::sqrt(static_cast<double>(hd)))
                                  .sub_(lse.unsqueeze(2))
                                  .exp_()
                                  .masked_fill_(later, 0.0);
  EXPECT_TRUE(attention->equal(expected));
}

// The engine's probabilities: a softmax over the keys in float32 whatever the scores' dtype, and the
// log-sum-exp of the rows asked for.
TEST(QueryHistory, AttentionProbabilitiesAreASoftmaxWithTheLogSumExpAskedFor) {
  at::manual_seed(4);
  const at::Tensor scores = at::randn({2, 3, 6, 10}, kF32);
  scores.narrow(3, 7, 3).fill_(-std::numeric_limits<float>::infinity());
  const at::Tensor lse = at::full({2, 3, 4}, -1.0f, kF32);
  const at::Tensor probs = attention_probabilities(scores.to(at::kBFloat16), 2, lse);
  ASSERT_EQ(probs.scalar_type(), at::kFloat);
  const at::Tensor rounded = scores.to(at::kBFloat16).to(at::kFloat);
  EXPECT_TRUE(at::allclose(probs, rounded.softmax(-1), 1e-6, 1e-7));
  EXPECT_TRUE(probs.narrow(3, 7, 3).eq(0).all().item<bool>());
  EXPECT_TRUE(at::allclose(lse, rounded.narrow(2, 2, 4).logsumexp(-1), 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(attention_probabilities(scores, 0, at::Tensor()), scores.softmax(-1)));
}

TEST(QueryHistory, KeepsTheNewestContiguousQueries) {
  LayerKVCache cache(1, 4, kF32);
  ASSERT_TRUE(cache.Append(at::zeros({1, 40, 4}, kF32), at::zeros({1, 40, 4}, kF32), at::arange(40, kF32.dtype(at::kLong))).ok());
  QueryHistory history;
  ASSERT_TRUE(history.Record(at::zeros({1, 3, 4}, kF32), at::zeros({1, 3}, kF32), 0, 0, 4).ok());
  ASSERT_TRUE(history.Record(at::zeros({1, 3, 4}, kF32), at::zeros({1, 3}, kF32), 3, 0, 4).ok());
  EXPECT_EQ(history.first_query(), 2);
  EXPECT_EQ(history.size(), 4);
  // A gap is refused, unless the new queries alone fill the history.
  Status gap = history.Record(at::zeros({1, 1, 4}, kF32), at::zeros({1, 1}, kF32), 9, 0, 4);
  EXPECT_FALSE(gap.ok());
  EXPECT_NE(gap.message().find("cannot append query 9"), std::string::npos) << gap.message();
  ASSERT_TRUE(history.Record(at::zeros({1, 5, 4}, kF32), at::zeros({1, 5}, kF32), 20, 0, 4).ok());
  EXPECT_EQ(history.first_query(), 21);
  // Queries no longer held are refused by name.
  auto gone = history.Attention(cache, 19, 22);
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.status().message().find("holds 21..24"), std::string::npos) << gone.status().message();
}

}  // namespace
}  // namespace namm
