#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "namm/option_spec.h"
#include "namm/policies/cache_budget.h"
#include "namm/policies/fastgen_policy.h"
#include "namm/policies/full_cache_policy.h"
#include "namm/policies/h2o_policy.h"
#include "namm/policies/l2_policy.h"
#include "namm/policies/memory_policy.h"
#include "namm/policies/oracle_policy.h"
#include "namm/policies/snapkv_policy.h"
#include "namm/policies/streaming_llm_policy.h"
#include "namm/policies/tova_policy.h"
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
  auto policy = H2OPolicy::Create(CacheBudget::Tokens(3).value(), 1);
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
  ASSERT_TRUE(observe_newest(**policy, 0, attention, cache).ok());
  EXPECT_NEAR(cache.state("h2o.attention")[0][2].item<float>(), 0.6f, 1e-6);
  auto keep = (*policy)->Select(0, cache);
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(Row(*keep, 0), (std::vector<int64_t>{0, 2, 5}));  // heavy hitters 0 (0.7), 2 (0.6); recent 5
}

TEST(H2OPolicy, RefusesInconsistentBudgets) {
  EXPECT_FALSE(CacheBudget::Tokens(0).ok());
  EXPECT_FALSE(H2OPolicy::Create(CacheBudget::Tokens(4).value(), 5).ok());
}

TEST(L2Policy, KeepsTheLowestKeyNormsAndTheNewest) {
  auto policy = L2Policy::Create(CacheBudget::Tokens(2).value());
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

// The authors' scripts leave the first layers uncompressed (skip_layers=[0, 1]); skip_layers=N does the same.
TEST(L2Policy, TheFirstSkipLayersKeepEveryToken) {
  auto policy = L2Policy::Create(CacheBudget::Tokens(2).value(), /*skip_layers=*/1);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->name(), "l2(budget=2, skip_layers=1)");
  LayerKVCache cache(1, 1, at::TensorOptions().dtype(at::kFloat));
  at::Tensor keys = at::tensor({3.0f, 1.0f, 2.0f, 9.0f}).view({1, 4, 1});
  ASSERT_TRUE(cache.Append(keys, keys, Positions(4)).ok());
  auto first = (*policy)->Select(0, cache);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(Row(*first, 0), (std::vector<int64_t>{0, 1, 2, 3}));
  auto second = (*policy)->Select(1, cache);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(Row(*second, 0), (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(L2Policy::Create(CacheBudget::Tokens(2).value(), -1).ok());
}

// Norms that differ only in their last bits (one token's keys rotated to different positions, rounded by
// different hardware) are ties, kept newest first, whatever the order of those last bits.
TEST(L2Policy, NormsEqualButForRoundingAreTiesKeptNewestFirst) {
  auto policy = L2Policy::Create(CacheBudget::Tokens(3).value());
  ASSERT_TRUE(policy.ok());
  for (const float epsilon : {1e-6f, -1e-6f}) {
    LayerKVCache cache(1, 1, at::TensorOptions().dtype(at::kFloat));
    // Norms 2, 2 (1 + epsilon), 2, 5, 9: the three twos are one norm; the budget keeps two of them + the newest.
    const float k[5] = {2.0f, 2.0f * (1.0f + epsilon), -2.0f, 5.0f, 9.0f};
    at::Tensor keys = at::zeros({1, 5, 1});
    for (int i = 0; i < 5; ++i) keys[0][i][0] = k[i];
    ASSERT_TRUE(cache.Append(keys, keys, Positions(5)).ok());
    auto keep = (*policy)->Select(0, cache);
    ASSERT_TRUE(keep.ok());
    EXPECT_EQ(Row(*keep, 0), (std::vector<int64_t>{1, 2, 4})) << "epsilon " << epsilon;
  }
}

// Keys of norm 0 (log2 = -inf, scored +inf before) still lose to the newest token, which is always kept.
TEST(L2Policy, ZeroKeysDoNotOutrankTheNewestToken) {
  auto policy = L2Policy::Create(CacheBudget::Tokens(2).value());
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache(1, 1, at::TensorOptions().dtype(at::kFloat));
  at::Tensor keys = at::zeros({1, 4, 1});
  keys[0][3][0] = 5.0f;  // only the newest is not zero
  ASSERT_TRUE(cache.Append(keys, keys, Positions(4)).ok());
  auto keep = (*policy)->Select(0, cache);
  ASSERT_TRUE(keep.ok());
  const std::vector<int64_t> kept = Row(*keep, 0);
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept.back(), 3) << "the newest token";
}

// A cache of `n` tokens at positions 0..n-1 (keys and values zero), carrying `policy`'s state.
LayerKVCache CacheOf(const MemoryPolicy& policy, int64_t kv_heads, int64_t n) {
  LayerKVCache cache(kv_heads, 2, at::TensorOptions().dtype(at::kFloat), policy.token_state());
  EXPECT_TRUE(cache.Append(at::zeros({kv_heads, n, 2}), at::zeros({kv_heads, n, 2}), Positions(n)).ok());
  return cache;
}

SequenceInfo PromptOf(int64_t n) { return SequenceInfo{std::vector<int64_t>(static_cast<std::size_t>(n), 7)}; }

TEST(CacheBudget, TokensOrAShareOfThePrompt) {
  EXPECT_EQ(CacheBudget::Tokens(5)->Resolve(1000), 5);
  EXPECT_EQ(CacheBudget::Ratio(0.25)->Resolve(10), 3);  // ceil(2.5)
  EXPECT_EQ(CacheBudget::Ratio(0.5)->Resolve(10), 5);
  EXPECT_EQ(CacheBudget::Ratio(0.01)->Resolve(10), 1);  // at least one token
  EXPECT_FALSE(CacheBudget::Tokens(0).ok());
  EXPECT_FALSE(CacheBudget::Ratio(0).ok());
  EXPECT_FALSE(CacheBudget::Ratio(1.5).ok());
  EXPECT_FALSE(CacheBudget::FromSpec(*parse_option_spec("h2o")).ok());
  EXPECT_FALSE(CacheBudget::FromSpec(*parse_option_spec("h2o:budget=4,ratio=0.5")).ok());
  auto from_spec = CacheBudget::FromSpec(*parse_option_spec("tova:ratio=0.5"));
  ASSERT_TRUE(from_spec.ok());
  EXPECT_EQ(from_spec->ToString(), "ratio=0.5");
}

TEST(CacheBudget, ARatioNeedsTheSequenceToBegin) {
  auto policy = H2OPolicy::Create(*CacheBudget::Ratio(0.5));
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache = CacheOf(**policy, 1, 8);
  EXPECT_EQ((*policy)->Select(0, cache).status().code(), Status::Code::kFailedPrecondition);
  ASSERT_TRUE((*policy)->BeginSequence(PromptOf(8)).ok());
  auto keep = (*policy)->Select(0, cache);
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(keep->size(1), 4);
}

TEST(StreamingLlmPolicy, KeepsTheSinksAndTheRecentWindow) {
  auto policy = StreamingLlmPolicy::Create(*CacheBudget::Tokens(4), /*sinks=*/1);
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache = CacheOf(**policy, 2, 7);
  auto keep = (*policy)->Select(0, cache);
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(Row(*keep, 0), (std::vector<int64_t>{0, 4, 5, 6}));
  EXPECT_EQ(Row(*keep, 1), (std::vector<int64_t>{0, 4, 5, 6}));
  ASSERT_TRUE(cache.Gather(*keep).ok());
  // Three more tokens: the sink stays, the window moves on.
  ASSERT_TRUE(cache.Append(at::zeros({2, 3, 2}), at::zeros({2, 3, 2}), at::arange(7, 10, at::kLong)).ok());
  ASSERT_TRUE(apply_memory_update(**policy, 0, cache).ok());
  EXPECT_EQ(Row(cache.positions(), 0), (std::vector<int64_t>{0, 7, 8, 9}));
}

TEST(StreamingLlmPolicy, RefusesSinksThatLeaveNoRoom) {
  EXPECT_FALSE(StreamingLlmPolicy::Create(*CacheBudget::Tokens(4), 4).ok());
  EXPECT_FALSE(StreamingLlmPolicy::Create(*CacheBudget::Tokens(4), -1).ok());
  // A share of a short prompt keeps the sinks that fit beside the newest token: 2 tokens, 1 sink.
  auto by_ratio = StreamingLlmPolicy::Create(*CacheBudget::Ratio(0.1), 4);
  ASSERT_TRUE(by_ratio.ok());
  ASSERT_TRUE((*by_ratio)->BeginSequence(PromptOf(20)).ok());
  LayerKVCache cache = CacheOf(**by_ratio, 1, 20);
  auto keep = (*by_ratio)->Select(0, cache);
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(Row(*keep, 0), (std::vector<int64_t>{0, 19}));
}

TEST(TovaPolicy, RanksByTheLatestQueryOnly) {
  auto policy = TovaPolicy::Create(*CacheBudget::Tokens(3));
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache = CacheOf(**policy, 2, 6);
  // Four query heads (two per KV head), two queries. The first query favours tokens 0 and 1 everywhere; only the
  // second (latest) may count.
  at::Tensor attention = at::zeros({4, 2, 6});
  attention.select(1, 0).narrow(1, 0, 2).fill_(0.5);
  // KV head 0 (query heads 0, 1): latest query on tokens 2 (0.3 + 0.5) / 2 and 4 (0.3).
  attention[0][1][2] = 0.3;
  attention[1][1][2] = 0.5;
  attention[0][1][4] = 0.3;
  attention[1][1][4] = 0.3;
  // KV head 1 (query heads 2, 3): latest query on tokens 1 and 3.
  attention[2][1][1] = 0.4;
  attention[3][1][1] = 0.4;
  attention[2][1][3] = 0.6;
  attention[3][1][3] = 0.2;
  ASSERT_TRUE(observe_newest(**policy, 0, attention, cache).ok());
  auto keep = (*policy)->Select(0, cache);
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(Row(*keep, 0), (std::vector<int64_t>{2, 4, 5}));  // 5: the newest, always
  EXPECT_EQ(Row(*keep, 1), (std::vector<int64_t>{1, 3, 5}));
}

TEST(SnapKvPolicy, TheObservationWindowVotesWithPooling) {
  auto policy = SnapKvPolicy::Create(*CacheBudget::Tokens(5), /*window=*/2, /*kernel=*/3);
  ASSERT_TRUE(policy.ok());
  ASSERT_TRUE((*policy)->BeginSequence(PromptOf(10)).ok());
  LayerKVCache cache(1, 2, at::TensorOptions().dtype(at::kFloat), (*policy)->token_state());
  // Chunk 1: tokens 0..5; its queries (outside the window) attend to token 1 only and must not vote.
  ASSERT_TRUE(cache.Append(at::zeros({1, 6, 2}), at::zeros({1, 6, 2}), Positions(6)).ok());
  at::Tensor first = at::zeros({1, 6, 6});
  first.select(2, 1).fill_(1.0);
  ASSERT_TRUE(observe_newest(**policy, 0, first, cache).ok());
  ASSERT_TRUE(apply_memory_update(**policy, 0, cache).ok());  // prefill updates evict nothing
  EXPECT_EQ(cache.size(), 6);
  // Chunk 2: tokens 6..9; the window is queries 8 and 9, which attend to token 3 (and a little to 6).
  ASSERT_TRUE(cache.Append(at::zeros({1, 4, 2}), at::zeros({1, 4, 2}), at::arange(6, 10, at::kLong)).ok());
  at::Tensor second = at::zeros({1, 4, 10});
  second.select(2, 1).fill_(1.0);  // queries 6 and 7 are outside the window
  second[0][2][1] = 0;
  second[0][3][1] = 0;
  second[0][2][3] = 0.9;
  second[0][3][3] = 0.8;
  second[0][2][6] = 0.1;
  second[0][3][6] = 0.2;
  ASSERT_TRUE(observe_newest(**policy, 0, second, cache).ok());
  auto keep = (*policy)->EndPrefill(0, cache);
  ASSERT_TRUE(keep.ok() && keep->has_value());
  // Votes 1.7 on token 3 pool onto 2, 3 and 4; token 6's 0.3 onto 5, 6 and 7 (out-ranked, ties to the newer); the
  // window (8, 9) is kept whole.
  EXPECT_EQ(Row(**keep, 0), (std::vector<int64_t>{2, 3, 4, 8, 9}));
  ASSERT_TRUE(cache.Gather(**keep).ok());
  // Decoded tokens are never evicted.
  ASSERT_TRUE(cache.Append(at::zeros({1, 3, 2}), at::zeros({1, 3, 2}), at::arange(10, 13, at::kLong)).ok());
  ASSERT_TRUE(apply_memory_update(**policy, 0, cache).ok());
  EXPECT_EQ(cache.size(), 8);
}

TEST(FastGenPolicy, EachHeadGetsTheCheapestProfileThatRecoversEnough) {
  FastGenOptions options;
  options.recovery = 0.9;
  options.window = 2;
  options.special_ids = {1};
  options.punctuation_ids = {50};
  auto policy = FastGenPolicy::Create(*CacheBudget::Tokens(4), options);  // 2 frequent + 2 local tokens
  ASSERT_TRUE(policy.ok());
  std::vector<int64_t> prompt = {1, 10, 11, 50, 12, 13, 14, 15, 16, 17};  // BOS at 0, punctuation at 3
  ASSERT_TRUE((*policy)->BeginSequence(SequenceInfo{prompt}).ok());
  LayerKVCache cache = CacheOf(**policy, 2, 10);
  // One chunk of all 10 queries; only the window (queries 8, 9) attends, so accumulated attention = votes.
  at::Tensor attention = at::zeros({2, 10, 10});
  for (int q = 8; q < 10; ++q) {
    // Head 0: BOS and the punctuation take 95% -> special + punctuation (profile 2) suffices.
    attention[0][q][0] = 0.6;
    attention[0][q][3] = 0.35;
    attention[0][q][9] = 0.05;
    // Head 1: tokens 5 and 7 are the frequent ones -> profile 3 (+ frequent) recovers 95%.
    attention[1][q][5] = 0.5;
    attention[1][q][7] = 0.45;
    attention[1][q][2] = 0.05;
  }
  ASSERT_TRUE(observe_newest(**policy, 0, attention, cache).ok());
  auto keep = (*policy)->EndPrefill(0, cache);
  ASSERT_TRUE(keep.ok() && keep->has_value()) << keep.status().ToString();
  EXPECT_EQ((*policy)->profile(0), (std::vector<int64_t>{2, 3}));
  // Head 1 keeps {0, 3, 5, 7, 9}; the cache is rectangular, so head 0 keeps {0, 3, 9} plus its two most attended
  // others (all zero: ties go to the newest, 7 and 8).
  EXPECT_EQ(Row(**keep, 0), (std::vector<int64_t>{0, 3, 7, 8, 9}));
  EXPECT_EQ(Row(**keep, 1), (std::vector<int64_t>{0, 3, 5, 7, 9}));
}

TEST(FastGenPolicy, AHeadThatNeedsEverythingKeepsTheLayerWhole) {
  FastGenOptions options;
  options.recovery = 0.99;
  options.window = 2;
  auto policy = FastGenPolicy::Create(*CacheBudget::Tokens(2), options);
  ASSERT_TRUE(policy.ok());
  ASSERT_TRUE((*policy)->BeginSequence(PromptOf(8)).ok());
  LayerKVCache cache = CacheOf(**policy, 1, 8);
  ASSERT_TRUE(observe_newest(**policy, 0, at::full({1, 8, 8}, 0.125), cache).ok());  // uniform attention
  auto keep = (*policy)->EndPrefill(0, cache);
  ASSERT_TRUE(keep.ok());
  EXPECT_FALSE(keep->has_value());
  EXPECT_EQ((*policy)->profile(0), (std::vector<int64_t>{5}));
}

// A head whose every query attends to its own 4 most recent tokens is local, as the paper profiles C_local
// (a relative distance): with a budget of 8 (4 frequent + 4 local tokens) it recovers all of its attention. Judged
// by the prompt's last 4 tokens alone, the window's earlier queries recovered little, and the head kept the whole
// cache at every small budget.
TEST(FastGenPolicy, AHeadThatAttendsToItsOwnRecentTokensIsLocal) {
  FastGenOptions options;
  options.recovery = 0.9;
  options.window = 8;
  auto policy = FastGenPolicy::Create(*CacheBudget::Tokens(8), options);
  ASSERT_TRUE(policy.ok());
  ASSERT_TRUE((*policy)->BeginSequence(PromptOf(40)).ok());
  LayerKVCache cache = CacheOf(**policy, 1, 40);
  at::Tensor attention = at::zeros({1, 40, 40});
  for (int q = 0; q < 40; ++q) {
    for (int j = std::max(0, q - 3); j <= q; ++j) attention[0][q][j] = 1.0 / (q - std::max(0, q - 3) + 1);
  }
  ASSERT_TRUE(observe_newest(**policy, 0, attention, cache).ok());
  auto keep = (*policy)->EndPrefill(0, cache);
  ASSERT_TRUE(keep.ok() && keep->has_value()) << keep.status().ToString();
  EXPECT_EQ((*policy)->profile(0), (std::vector<int64_t>{4}));
  // The 4 most attended others (over all queries: 0, 1 and 2, which the first queries attend to alone, then the
  // newest of the many tokens at 1.0, 36: ties go to the more recent, as in every policy) and the last 4 tokens.
  EXPECT_EQ(Row(**keep, 0), (std::vector<int64_t>{0, 1, 2, 36, 37, 38, 39}));
}

TEST(OraclePolicy, EvictsExactlyTheMarkedPositions) {
  auto policy = OraclePolicy::Create({{2, 5}});
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache = CacheOf(**policy, 2, 4);  // positions 0..3: 2 and 3 are marked
  ASSERT_TRUE(apply_memory_update(**policy, 0, cache).ok());
  EXPECT_EQ(Row(cache.positions(), 0), (std::vector<int64_t>{0, 1, 3}));  // 3 is the newest: kept for now
  ASSERT_TRUE(cache.Append(at::zeros({2, 4, 2}), at::zeros({2, 4, 2}), at::arange(4, 8, at::kLong)).ok());
  auto keep = (*policy)->EndPrefill(0, cache);
  ASSERT_TRUE(keep.ok() && keep->has_value());
  ASSERT_TRUE(cache.Gather(**keep).ok());
  EXPECT_EQ(Row(cache.positions(), 1), (std::vector<int64_t>{0, 1, 5, 6, 7}));
  EXPECT_FALSE(OraclePolicy::Create({{5, 5}}).ok());
}

}  // namespace
}  // namespace namm
