#include "namm/scorer.h"

#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "namm/bam_scorer.h"
#include "test_util.h"

namespace namm {
namespace {

at::Tensor Params(const std::vector<float>& values) {
  at::Tensor t = at::zeros({static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data_ptr<float>());
  return t;
}

TEST(ScorerLayout, DefaultBamMatchesTheReferenceTable) {
  // Spec §4.2: offsets 0 (W_qkv 25x96), 2400 (b_qkv), 2496 (W_o 32x50), 4096 (b_o), 4146 (W_f), 4171 (b_f).
  auto layout = scorer_param_layout(default_scorer_config(ScorerKind::kBam));
  ASSERT_EQ(layout.size(), 6u);
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> expected = {
      {0, {25, 96}}, {2400, {96}}, {2496, {32, 50}}, {4096, {50}}, {4146, {25, 1}}, {4171, {1}}};
  for (std::size_t i = 0; i < layout.size(); ++i) {
    EXPECT_EQ(layout[i].offset, expected[i].first) << layout[i].name;
    EXPECT_EQ(layout[i].shape, expected[i].second) << layout[i].name;
  }
  EXPECT_EQ(scorer_param_count(default_scorer_config(ScorerKind::kBam)), 4172);
}

TEST(ScorerLayout, ParameterCountsOfTheVariants) {
  ScorerConfig bam16 = default_scorer_config(ScorerKind::kBam);
  bam16.hidden = 16;
  bam16.attention_bias = false;  // base_bam.yaml's defaults: 25*48 + 16*50 + 25 + 1
  EXPECT_EQ(scorer_param_count(bam16), 2026);
  ScorerConfig mlp = default_scorer_config(ScorerKind::kMlp);
  EXPECT_EQ(scorer_param_count(mlp), 676);
  mlp.mlp_bias = false;
  EXPECT_EQ(scorer_param_count(mlp), 650);
}

TEST(ScorerConfig, RejectsAnMlpWhoseHiddenWidthBreaksTheResidual) {
  ScorerConfig mlp = default_scorer_config(ScorerKind::kMlp);
  mlp.hidden = 32;
  EXPECT_FALSE(validate_scorer_config(mlp).ok());
  EXPECT_FALSE(make_scorer(default_scorer_config(ScorerKind::kBam), at::zeros({100})).ok());
}

TEST(BamScorer, ZeroParametersScoreEveryTokenZero) {
  auto scorer = make_scorer(default_scorer_config(ScorerKind::kBam), at::zeros({4172}));
  ASSERT_TRUE(scorer.ok());
  at::Tensor scores = (*scorer)->Score(testing::RandomNormal({8, 300, 25}, 1, 3.0));
  EXPECT_EQ(scores.sizes(), (at::IntArrayRef{8, 300}));
  EXPECT_EQ(scores.abs().max().item<float>(), 0.0f);
}

TEST(BamScorer, HandCheckedTwoTokenExample) {
  // hidden 1, biases on: 204 parameters. q = k = x[0], v = x[1] + 1, r[0] = o, m[1] = 0.5 o,
  // score = y[0] - 0.1 y[1] + 0.25 with y = x (1 + m) + r.
  std::vector<float> p(204, 0.0f);
  p[0 * 3 + 0] = 1;    // W_qkv[0, q]
  p[0 * 3 + 1] = 1;    // W_qkv[0, k]
  p[1 * 3 + 2] = 1;    // W_qkv[1, v]
  p[75 + 2] = 1;       // b_qkv[v]
  p[78 + 0] = 1;       // W_o[0, r_0]
  p[78 + 26] = 0.5f;   // W_o[0, m_1]
  p[178 + 0] = 1;      // W_f[0]
  p[178 + 1] = -0.1f;  // W_f[1]
  p[203] = 0.25f;      // b_f
  ScorerConfig config = default_scorer_config(ScorerKind::kBam);
  config.hidden = 1;
  ASSERT_EQ(scorer_param_count(config), 204);
  auto scorer = make_scorer(config, Params(p));
  ASSERT_TRUE(scorer.ok());
  // Token 0: x = [1, 3, 0...]; token 1 (newest): x = [2, 5, 0...].
  at::Tensor x = at::zeros({1, 2, 25});
  x[0][0][0] = 1;
  x[0][0][1] = 3;
  x[0][1][0] = 2;
  x[0][1][1] = 5;
  at::Tensor s = (*scorer)->Score(x);
  // Token 1 sees only itself: o = v_1 = 6; y = [2 + 6, 5 (1 + 3)] = [8, 20]; s = 8 - 2 + 0.25 = 6.25.
  EXPECT_NEAR(s[0][1].item<float>(), 6.25, 1e-6);
  // Token 0 sees tokens 0 and 1 with logits q0 k0 = 1, q0 k1 = 2: weights 1/(1+e), e/(1+e).
  // o = 4 + 2 e/(1+e) = 5.4621171573; y = [1 + o, 3 (1 + o/2)] = [6.4621171573, 11.1931757359];
  // s = 6.4621171573 - 1.1193175736 + 0.25 = 5.5927995837.
  EXPECT_NEAR(s[0][0].item<float>(), 5.5927995837, 1e-5);
}

TEST(BamScorer, MatchesTheExplicitMaskReferenceAcrossBlockBoundaries) {
  ScorerConfig config = default_scorer_config(ScorerKind::kBam);
  at::Tensor params = testing::RandomNormal({4172}, 21, 0.2);
  std::vector<float> p(params.data_ptr<float>(), params.data_ptr<float>() + 4172);
  BamScorer scorer(config, params);
  for (int64_t n : {1, 17, 300}) {
    at::Tensor x = testing::RandomNormal({2, n, 25}, 100 + static_cast<uint64_t>(n));
    testing::Array xa = testing::ToArray(x);
    testing::Array expected({2, n});
    for (int64_t h = 0; h < 2; ++h) {
      auto ref = testing::RefBamScores(p, 32, xa, h);
      for (int64_t i = 0; i < n; ++i) expected.at({h, i}) = ref[static_cast<std::size_t>(i)];
    }
    EXPECT_TRUE(testing::AllClose(scorer.Score(x), expected, 2e-4, 2e-4)) << "n = " << n;
  }
}

// The tensor path's blocks (float64 takes it; float32 on a CPU takes the kernel, tested in cpu_kernels_test).
TEST(BackwardMaskedAttention, BlockSizeDoesNotChangeTheResult) {
  at::Tensor q = testing::RandomNormal({3, 257, 8}, 1).to(at::kDouble), k = testing::RandomNormal({3, 257, 8}, 2).to(at::kDouble),
             v = testing::RandomNormal({3, 257, 5}, 3).to(at::kDouble);
  at::Tensor whole = backward_masked_attention(q, k, v, 0.3, int64_t{1} << 30);
  at::Tensor blocked = backward_masked_attention(q, k, v, 0.3, 3 * 257 * 16);  // 16-row blocks: 17 of them
  EXPECT_TRUE(testing::AllClose(blocked, testing::ToArray(whole), 1e-6, 1e-5));
  // The last token attends to itself only.
  EXPECT_TRUE(testing::AllClose(blocked.select(1, 256), testing::ToArray(v.select(1, 256)), 1e-6, 0));
}

TEST(BamScorer, TokenScoreIgnoresEveryOlderToken) {
  auto scorer = make_scorer(default_scorer_config(ScorerKind::kBam), testing::RandomNormal({4172}, 5, 0.3));
  ASSERT_TRUE(scorer.ok());
  const int64_t n = 50, i = 30;
  at::Tensor x = testing::RandomNormal({1, n, 25}, 8);
  at::Tensor changed = x.clone();
  changed.narrow(1, 0, i).copy_(testing::RandomNormal({1, i, 25}, 9, 5.0));
  at::Tensor a = (*scorer)->Score(x), b = (*scorer)->Score(changed);
  EXPECT_TRUE(testing::AllClose(b.narrow(1, i, n - i), testing::ToArray(a.narrow(1, i, n - i)), 1e-6, 1e-6));
  EXPECT_GT((b.narrow(1, 0, i) - a.narrow(1, 0, i)).abs().max().item<float>(), 1e-3f);  // older ones do change
  EXPECT_EQ(a[0][n - 1].item<float>(), b[0][n - 1].item<float>());                   // the newest, bit for bit
}

TEST(ConstantScore, DetectsAnOutputLayerThatIgnoresItsInput) {
  const ScorerConfig bam = default_scorer_config(ScorerKind::kBam);
  EXPECT_EQ(constant_score(bam, std::vector<float>(4172, 0.0f)), 0.0f);
  std::vector<float> p(4172, 0.5f);
  for (int i = 4146; i < 4171; ++i) p[static_cast<std::size_t>(i)] = 0.0f;  // W_f
  p[4171] = -2.0f;                                                           // b_f
  EXPECT_EQ(constant_score(bam, p), -2.0f);
  auto scorer = make_scorer(bam, Params(p));
  at::Tensor s = (*scorer)->Score(testing::RandomNormal({2, 40, 25}, 3));
  EXPECT_EQ(s.min().item<float>(), -2.0f);
  EXPECT_EQ(s.max().item<float>(), -2.0f);
  p[4150] = 1e-3f;
  EXPECT_FALSE(constant_score(bam, p).has_value());
  EXPECT_EQ(constant_score(default_scorer_config(ScorerKind::kMlp), std::vector<float>(676, 0.0f)), 0.0f);
}

TEST(MlpScorer, HandCheckedExample) {
  // y = x + ReLU(x W1 + b1); s = y W2 + b2, with W1[0, 0] = 2, b1[1] = -1, W2 = [1, 1, 0...], b2 = 0.5.
  ScorerConfig config = default_scorer_config(ScorerKind::kMlp);
  std::vector<float> p(676, 0.0f);
  p[0] = 2;           // W1[0, 0]
  p[625 + 1] = -1;    // b1[1]
  p[650 + 0] = 1;     // W2[0]
  p[650 + 1] = 1;     // W2[1]
  p[675] = 0.5f;      // b2
  auto scorer = make_scorer(config, Params(p));
  ASSERT_TRUE(scorer.ok());
  at::Tensor x = at::zeros({1, 2, 25});
  x[0][0][0] = 1.5;  // y = [1.5 + ReLU(3), 0 + ReLU(-1)] = [4.5, 0] -> s = 5
  x[0][1][0] = -1;   // y = [-1 + ReLU(-2), 4 + ReLU(-1)] = [-1, 4] -> s = 3.5
  x[0][1][1] = 4;
  at::Tensor s = (*scorer)->Score(x);
  EXPECT_FLOAT_EQ(s[0][0].item<float>(), 5.0f);
  EXPECT_FLOAT_EQ(s[0][1].item<float>(), 3.5f);
}

}  // namespace
}  // namespace namm
