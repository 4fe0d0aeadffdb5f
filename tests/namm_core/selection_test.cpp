#include "namm/selection.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <limits>

#include "test_util.h"

namespace namm {
namespace {

at::Tensor Scores(const std::vector<std::vector<float>>& rows) {
  at::Tensor t = at::zeros({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())});
  for (std::size_t h = 0; h < rows.size(); ++h)
    for (std::size_t i = 0; i < rows[h].size(); ++i) t[static_cast<int64_t>(h)][static_cast<int64_t>(i)] = rows[h][i];
  return t;
}

std::vector<std::vector<int64_t>> Rows(const at::Tensor& keep) {
  std::vector<std::vector<int64_t>> out(static_cast<std::size_t>(keep.size(0)));
  for (int64_t h = 0; h < keep.size(0); ++h)
    for (int64_t i = 0; i < keep.size(1); ++i) out[static_cast<std::size_t>(h)].push_back(keep[h][i].item<int64_t>());
  return out;
}

using Keep = std::vector<std::vector<int64_t>>;

TEST(BinarySelection, EveryHeadKeepsTheMaxCountPaddedWithItsBestNegatives) {
  // Head 0: s >= 0 at 1, 3 (+ newest 4) -> 3. Head 1: 0, 1, 2 (+ newest) -> 4 = k.
  // Head 0 pads with its best negative, index 0 (-1 beats -3).
  at::Tensor s = Scores({{-1, 2, -3, 0.5f, -0.1f}, {1, 2, 3, -1, -2}});
  EXPECT_EQ(Rows(select_tokens(s, SelectionConfig{})), (Keep{{0, 1, 3, 4}, {0, 1, 2, 4}}));
}

// heads=own (select_own_counts_on_host): each head keeps only what its own scores keep, the rest of its row -1
// (slots it leaves vacant), and never a slot it does not hold.
TEST(OwnHeadCounts, EachHeadKeepsItsOwnTokensAndLeavesTheRestVacant) {
  const auto select = [](std::vector<float> scores, const std::vector<int64_t>* vacant, const SelectionConfig& config,
                         double log_threshold = 0) {
    std::vector<int64_t> keep, order;
    const int64_t k = select_own_counts_on_host(scores.data(), 2, 5, vacant != nullptr ? vacant->data() : nullptr,
                                                config, log_threshold, keep, order);
    Keep rows(2);
    for (int64_t h = 0; h < 2; ++h) rows[static_cast<std::size_t>(h)].assign(keep.begin() + h * k, keep.begin() + (h + 1) * k);
    return rows;
  };
  const std::vector<float> scores = {-1, 2, -3, 0.5f, -0.1f, 1, 2, 3, -1, -2};
  // The reference pads head 0 with its best negative (index 0: EveryHeadKeepsTheMaxCountPaddedWithItsBestNegatives).
  EXPECT_EQ(select(scores, nullptr, SelectionConfig{}), (Keep{{-1, 1, 3, 4}, {0, 1, 2, 4}}));
  const std::vector<int64_t> vacant = {2, 0};  // head 0 holds slots 2..4 only
  EXPECT_EQ(select(scores, &vacant, SelectionConfig{}), (Keep{{-1, -1, 3, 4}, {0, 1, 2, 4}}));
  SelectionConfig topk;
  topk.kind = SelectionKind::kTopK;
  topk.budget = 3;
  const std::vector<int64_t> most = {3, 0};  // head 0 holds 2 slots: fewer than the budget
  EXPECT_EQ(select(scores, &most, topk), (Keep{{-1, 3, 4}, {1, 2, 4}}));
  SelectionConfig dynamic;
  dynamic.kind = SelectionKind::kDynamic;
  dynamic.budget = 2;  // exp(0) = 1: head 0 keeps 1 (2) and the newest, head 1 its best two of 4 (1, 2, 3, newest)
  EXPECT_EQ(select(scores, nullptr, dynamic), (Keep{{1, 4}, {2, 4}}));
}

TEST(BinarySelection, KeepRuleIsGreaterOrEqualZeroAndTheNewestIsForced) {
  at::Tensor s = Scores({{0.0f, -1e-6f, 0.0f, -5.0f}});
  EXPECT_EQ(Rows(select_tokens(s, SelectionConfig{})), (Keep{{0, 2, 3}}));
}

TEST(BinarySelection, AllZeroScoresKeepEverything) {
  at::Tensor s = at::zeros({8, 100});
  at::Tensor keep = select_tokens(s, SelectionConfig{});
  EXPECT_EQ(keep.sizes(), (at::IntArrayRef{8, 100}));
  EXPECT_TRUE(keep.equal(at::arange(100).unsqueeze(0).expand({8, 100})));
}

TEST(BinarySelection, TiesGoToTheMoreRecentToken) {
  // Head 0 keeps 3 (0, 1 and the newest); head 1 must keep 3 of four equal scores: the newest two others.
  at::Tensor s = Scores({{0, 0, -5, -1}, {-1, -1, -1, -1}});
  EXPECT_EQ(Rows(select_tokens(s, SelectionConfig{})), (Keep{{0, 1, 3}, {1, 2, 3}}));
}

TEST(BinarySelection, AgreesWithTheReferenceSortFormulation) {
  at::Tensor s = testing::RandomNormal({8, 200}, 42).add_(-0.3);
  std::vector<std::vector<double>> rows(8);
  for (int64_t h = 0; h < 8; ++h)
    for (int64_t i = 0; i < 200; ++i) rows[static_cast<std::size_t>(h)].push_back(s[h][i].item<float>());
  EXPECT_EQ(Rows(select_tokens(s, SelectionConfig{})), testing::RefBinarySelect(rows));
}

TEST(BinarySelection, NanScoresAreCountedAsTheReferenceCountsThem) {
  // The reference (threshold_score_idxs) discards as many tokens as fail `score >= 0`, NaN among them, and keeps
  // the rest of its ascending sort, where NaN is last (highest): the NaN stays and one finite token fewer does
  // (we counted NaN as kept: {1, 2, 3, 5}).
  at::Tensor s = Scores({{-1, std::nanf(""), 0.5f, 0.2f, -3, 1}});
  EXPECT_EQ(Rows(select_tokens(s, SelectionConfig{})), (Keep{{1, 2, 5}}));
}

TEST(TopKSelection, KeepsTheBudgetOnceExceededIncludingTheNewest) {
  SelectionConfig topk{SelectionKind::kTopK, 2};
  at::Tensor s = Scores({{5, 4, 3, -9}, {1, 9, 8, -9}});
  EXPECT_EQ(Rows(select_tokens(s, topk)), (Keep{{0, 3}, {1, 3}}));
  SelectionConfig big{SelectionKind::kTopK, 10};
  EXPECT_EQ(select_tokens(s, big).size(1), 4);
}

TEST(DynamicSelection, ThresholdIsExpOfTheLearnedParameterAndCapApplies) {
  SelectionConfig dynamic{SelectionKind::kDynamic, 0};
  at::Tensor theta = at::zeros({1});  // threshold exp(0) = 1
  at::Tensor s = Scores({{2, 0.5f, 1, 0.9f, -1}});
  EXPECT_EQ(Rows(select_tokens(s, dynamic, theta)), (Keep{{0, 2, 4}}));
  dynamic.budget = 2;  // cap
  EXPECT_EQ(Rows(select_tokens(s, dynamic, theta)), (Keep{{0, 4}}));
}

// Several score sets left-padded to one length (a sequence's layers selected together on a device) keep what each
// set keeps alone: every rule, ties (equal scores at every other token), a NaN, sets from 1 to 40 tokens, garbage
// in the padding (including scores that would win).
TEST(PaddedSelection, EverySetKeepsWhatItKeepsAlone) {
  const std::vector<int64_t> sizes = {40, 1, 17, 40, 29};
  const int64_t n_max = 40, heads = 3, count = static_cast<int64_t>(sizes.size());
  at::Tensor padded = testing::RandomNormal({count, heads, n_max}, 7, 2.0);
  std::vector<at::Tensor> alone;
  for (int64_t c = 0; c < count; ++c) {
    at::Tensor own = padded[c].narrow(1, n_max - sizes[static_cast<std::size_t>(c)], sizes[static_cast<std::size_t>(c)]);
    for (int64_t i = 0; i < own.size(1); i += 2) own.select(1, i).fill_(0.25f);  // ties
    if (c == 3) own[1][5] = std::numeric_limits<float>::quiet_NaN();
    if (c == 4) own[2][3] = -std::numeric_limits<float>::infinity();  // ties with the padding's
    padded[c].narrow(1, 0, n_max - own.size(1)).fill_(1e9f);  // what the padding holds is ignored
    alone.push_back(own.clone());
  }
  at::Tensor theta = at::full({1}, -0.5);
  SelectionConfig moved, everything;  // binary at thresholds of 0.5 and -inf (every token kept)
  moved.threshold = 0.5f;
  everything.threshold = -std::numeric_limits<float>::infinity();
  for (const SelectionConfig& config :
       {SelectionConfig{}, moved, everything, SelectionConfig{SelectionKind::kTopK, 12},
        SelectionConfig{SelectionKind::kDynamic, 0}, SelectionConfig{SelectionKind::kDynamic, 9}}) {
    SCOPED_TRACE(static_cast<int>(config.kind));
    const std::vector<at::Tensor> together = select_tokens_padded(padded, sizes, config, theta);
    ASSERT_EQ(together.size(), sizes.size());
    int64_t dropped = 0;
    for (int64_t c = 0; c < count; ++c) {
      const at::Tensor expected = select_tokens(alone[static_cast<std::size_t>(c)], config, theta);  // host path
      EXPECT_EQ(Rows(together[static_cast<std::size_t>(c)]), Rows(expected)) << "set " << c;
      dropped += sizes[static_cast<std::size_t>(c)] - expected.size(1);
    }
    EXPECT_EQ(dropped > 0, config.threshold != everything.threshold);  // the rule dropped something somewhere
  }
}

}  // namespace
}  // namespace namm
