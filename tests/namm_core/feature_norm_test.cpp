#include "namm/feature_norm.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace namm {
namespace {

using testing::ToArray;

TEST(NormStats, MergedStatisticsEqualDirectStatistics) {
  at::Tensor all = testing::RandomNormal({3, 100, 17}, 3).mul_(2.0).add_(0.5);
  // Unequal pieces, merged in a tree and in a chain.
  NormStats a = norm_stats_of(all.narrow(1, 0, 7));
  NormStats b = norm_stats_of(all.narrow(1, 7, 60));
  NormStats c = norm_stats_of(all.narrow(1, 67, 33));
  NormStats chain = a.Merge(b).Merge(c);
  NormStats tree = a.Merge(b.Merge(c));
  testing::RefStats direct = testing::RefStatsOf(ToArray(all.reshape({1, 300, 17})));
  EXPECT_EQ(chain.count, 300);
  EXPECT_EQ(tree.count, 300);
  for (std::size_t f = 0; f < 17; ++f) {
    EXPECT_NEAR(chain.mean[f], direct.mean[f], 1e-12);
    EXPECT_NEAR(chain.var[f], direct.var[f], 1e-12);
    EXPECT_NEAR(tree.mean[f], direct.mean[f], 1e-12);
    EXPECT_NEAR(tree.var[f], direct.var[f], 1e-12);
  }
}

TEST(NormStats, MergingWithEmptyIsIdentity) {
  NormStats a = norm_stats_of(testing::RandomNormal({5, 17}, 4));
  NormStats empty;
  EXPECT_EQ(a.Merge(empty).mean, a.mean);
  EXPECT_EQ(empty.Merge(a).var, a.var);
  EXPECT_EQ(empty.Merge(a).count, 5);
}

TEST(FeatureNormalizer, CollectingNormalizesWithStatisticsIncludingTheCurrentInput) {
  at::Tensor first = testing::RandomNormal({2, 10, 17}, 5);
  at::Tensor second = testing::RandomNormal({2, 6, 17}, 6).add_(3.0);
  FeatureNormalizer norm(NormState::kCollecting, NormStats());
  norm.Normalize(first);
  at::Tensor out = norm.Normalize(second);
  EXPECT_EQ(norm.stats().count, 32);
  // Statistics of first and second together, computed directly.
  testing::RefStats direct =
      testing::RefStatsOf(ToArray(at::cat({first.reshape({1, 20, 17}), second.reshape({1, 12, 17})}, 1)));
  testing::Array expected = ToArray(second);
  for (std::size_t i = 0; i < expected.data.size(); ++i) {
    const std::size_t f = i % 17;
    expected.data[i] = (expected.data[i] - direct.mean[f]) / std::sqrt(direct.var[f]);
  }
  EXPECT_TRUE(testing::AllClose(out, expected, 1e-5, 1e-5));
}

TEST(FeatureNormalizer, FrozenStatisticsNeverChange) {
  NormStats stats;
  stats.count = 4;
  stats.mean.fill(1.0);
  stats.var.fill(4.0);
  FeatureNormalizer norm(NormState::kFrozen, stats);
  at::Tensor x = at::full({1, 2, 17}, 5.0);
  EXPECT_TRUE(testing::AllClose(norm.Normalize(x), ToArray(at::full({1, 2, 17}, 2.0)), 1e-7, 0));
  EXPECT_EQ(norm.stats().count, 4);
  EXPECT_EQ(norm.stats().mean[0], 1.0);
}

TEST(FeatureNormalizer, FrozenWithoutStatisticsLeavesFeaturesUnnormalized) {
  FeatureNormalizer norm(NormState::kFrozen, NormStats());
  at::Tensor x = testing::RandomNormal({2, 3, 17}, 9);
  EXPECT_TRUE(norm.Normalize(x).equal(x));
}

TEST(FeatureNormalizer, ZeroVarianceIsClampedTo1e7) {
  NormStats stats;
  stats.count = 1;
  stats.mean.fill(1.0);
  FeatureNormalizer norm(NormState::kFrozen, stats);
  at::Tensor out = norm.Normalize(at::full({1, 1, 17}, 1.5));
  EXPECT_NEAR(out[0][0][0].item<float>(), 0.5f / 1e-7f, 1.0);
}

}  // namespace
}  // namespace namm
