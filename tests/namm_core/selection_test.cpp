#include "namm/selection.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

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

TEST(BinarySelection, NanScoresCountAsKeptLikeTheReference) {
  // The reference counts tokens below zero and keeps the rest; its sort puts NaN last (highest).
  at::Tensor s = Scores({{-1, std::nanf(""), 0.5f, 0.2f, -3, 1}});
  EXPECT_EQ(Rows(select_tokens(s, SelectionConfig{})), (Keep{{1, 2, 3, 5}}));
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

}  // namespace
}  // namespace namm
