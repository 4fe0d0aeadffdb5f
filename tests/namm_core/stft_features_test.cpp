#include "namm/stft_features.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace namm {
namespace {

using testing::AllClose;
using testing::Array;
using testing::ToArray;

TEST(StftFrameMagnitudes, ConstantSeriesHasOnlyDcAndFirstBin) {
  // For a constant c, the periodic Hann window sums to 16 and its DFT is 16, -8 at f = 0, 1 (and f = 31),
  // zero elsewhere: |X| = [16c, 8c, 0, ..., 0].
  const double c = 0.37;
  at::Tensor mags = stft_frame_magnitudes(at::full({1, 32}, c));
  Array expected({1, 17});
  expected.at({0, 0}) = 16 * c;
  expected.at({0, 1}) = 8 * c;
  EXPECT_TRUE(AllClose(mags, expected, 1e-6, 1e-6));
}

TEST(StftFrameMagnitudes, ImpulseHasFlatSpectrumEqualToTheWindow) {
  // An impulse at sample n0 has |X[f]| = w[n0] = 0.5 - 0.5 cos(2 pi n0 / 32) in every bin.
  for (int64_t n0 : {0, 5, 16, 31}) {
    at::Tensor frame = at::zeros({32});
    frame[n0] = 1.0;
    at::Tensor mags = stft_frame_magnitudes(frame);
    const double w = 0.5 - 0.5 * std::cos(2 * M_PI * static_cast<double>(n0) / 32);
    Array expected({17});
    for (auto& v : expected.data) v = w;
    EXPECT_TRUE(AllClose(mags, expected, 1e-7, 1e-6)) << "n0 = " << n0;
  }
}

TEST(StftFrameMagnitudes, MatchesDirectDftOnRandomFrames) {
  at::Tensor frames = testing::RandomNormal({40, 32}, 7);
  Array f = ToArray(frames), expected({40, 17});
  for (int64_t r = 0; r < 40; ++r) {
    auto mag = testing::RefFrameMagnitudes(&f.data[static_cast<std::size_t>(r * 32)]);
    for (int64_t b = 0; b < 17; ++b) expected.at({r, b}) = mag[static_cast<std::size_t>(b)];
  }
  EXPECT_TRUE(AllClose(stft_frame_magnitudes(frames), expected, 1e-5, 1e-5));
}

TEST(GqaMean, AveragesTheQueryHeadsOfEachGroup) {
  // 4 query heads, 2 KV heads: heads 0,1 -> KV 0 and heads 2,3 -> KV 1.
  at::Tensor a = at::zeros({4, 1, 2});
  a[0][0][0] = 0.25;
  a[1][0][0] = 0.75;  // KV 0 key 0: 0.5
  a[2][0][1] = 1.0;   // KV 1 key 1: 0.5
  Array expected({2, 1, 2});
  expected.at({0, 0, 0}) = 0.5;
  expected.at({1, 0, 1}) = 0.5;
  EXPECT_TRUE(AllClose(gqa_mean(a, 2, AttentionPrecision::kF32), expected, 0, 0));
}

TEST(GqaMean, Bf16RoundsInputsAndMean) {
  // bfloat16 spacing at 1 is 2^-7: 1 + 2^-9 rounds down to 1 and 1 + 3*2^-9 up to 1 + 2^-7. Their mean,
  // 1 + 2^-8, is a tie that rounds to even, 1. In float32 the mean of the unrounded inputs is 1 + 2^-8.
  at::Tensor a = at::zeros({2, 1, 1});
  a[0][0][0] = 1.0 + std::ldexp(1.0, -9);
  a[1][0][0] = 1.0 + 3 * std::ldexp(1.0, -9);
  EXPECT_EQ(gqa_mean(a, 1, AttentionPrecision::kBf16).item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(gqa_mean(a, 1, AttentionPrecision::kF32).item<float>(), 1.0f + std::ldexp(1.0f, -8));
  // Same as the bit-level reference.
  at::Tensor r = testing::RandomCausalAttention(8, 16, 3, 11);
  EXPECT_TRUE(AllClose(gqa_mean(r, 2, AttentionPrecision::kBf16), testing::RefGqaMean(ToArray(r), 2, true), 0, 0));
}

// Streams one update's attention (already GQA-reduced, [H, n_new, n_old + n_new]) in chunks of `chunk` queries,
// appending keys as the engine would (a key exists once its own query has arrived).
void StreamUpdate(const at::Tensor& attn, int64_t first_query, int64_t chunk, SpectrogramState& state) {
  const int64_t h = attn.size(0), n_new = attn.size(1), n_all = attn.size(2), n_old = n_all - n_new;
  for (int64_t q0 = 0; q0 < n_new; q0 += chunk) {
    const int64_t len = std::min(chunk, n_new - q0);
    const int64_t n_now = n_old + q0 + len;
    // Grow the state to n_now keys (new keys start at zero).
    at::Tensor samples = at::zeros({h, n_now, 32}), ema = at::zeros({h, n_now, 17});
    samples.narrow(1, 0, state.samples.size(1)).copy_(state.samples);
    ema.narrow(1, 0, state.ema.size(1)).copy_(state.ema);
    state = {samples, ema};
    consume_attention(attn.narrow(1, q0, len).narrow(2, 0, n_now), AttentionPrecision::kF32, first_query + q0, state);
  }
}

TEST(ConsumeAttention, StreamingEqualsTheReferenceBatchFormulaAcrossUpdates) {
  // Two updates of 512 queries; the second one continues with the keys of the first (no eviction here), so
  // the carried 16 samples and the a^32 decay of the old EMA are both exercised. Chunk sizes that do and do
  // not divide the hop must give the same result.
  const int64_t h = 2, n_new = 512;
  at::Tensor first = gqa_mean(testing::RandomCausalAttention(4, n_new, 0, 1), h, AttentionPrecision::kF32);
  at::Tensor second = gqa_mean(testing::RandomCausalAttention(4, n_new, n_new, 2), h, AttentionPrecision::kF32);

  testing::RefLayerState ref;
  ref.carry = Array({h, 0, 16});
  ref.ema = Array({h, 0, 17});
  ref.positions = Array({h, 0});
  Array carry1, carry2;
  Array e1 = testing::RefSpectrogramEma(ToArray(first), ref, &carry1);
  ref.carry = carry1;
  ref.ema = e1;
  Array e2 = testing::RefSpectrogramEma(ToArray(second), ref, &carry2);

  for (int64_t chunk : {512, 128, 7, 1}) {
    SpectrogramState state{at::zeros({h, 0, 32}), at::zeros({h, 0, 17})};
    StreamUpdate(first, 0, chunk, state);
    EXPECT_TRUE(AllClose(state.ema, e1, 1e-6, 1e-5)) << "first update, chunk " << chunk;
    StreamUpdate(second, n_new, chunk, state);
    EXPECT_TRUE(AllClose(state.ema, e2, 1e-6, 1e-5)) << "second update, chunk " << chunk;
    // After a complete update the ring half of the last hop (hop 63: the upper half) holds the carry.
    EXPECT_TRUE(AllClose(state.samples.narrow(2, 16, 16), carry2, 0, 0)) << "chunk " << chunk;
  }
}

TEST(ConsumeAttention, LateTokenGetsOnlyItsOwnFramesWithoutRenormalization) {
  // A single key receiving constant attention c from its arrival on: if it arrives in the last hop of a
  // 512-query update, only the last frame sees it, half filled: its EMA is (1 - a) |X| of [0 x 16, c x 16].
  const int64_t n_new = 512;
  const double c = 0.5, a = std::pow(0.99, 16);
  SpectrogramState state{at::zeros({1, 1, 32}), at::zeros({1, 1, 17})};
  at::Tensor attn = at::zeros({1, 16, 1});
  attn.fill_(c);
  consume_attention(attn, AttentionPrecision::kF32, n_new - 16, state);
  at::Tensor frame = at::zeros({32});
  frame.narrow(0, 16, 16).fill_(c);
  Array expected = ToArray(stft_frame_magnitudes(frame).mul(1 - a).view({1, 1, 17}));
  EXPECT_TRUE(AllClose(state.ema, expected, 1e-7, 1e-6));
}

TEST(ConsumeAttention, FusedCpuPathEqualsTheTensorPath) {
  // float32 attention takes the fused one-pass CPU path; float64 takes the generic tensor-operation path.
  const int64_t kv = 2, n_new = 48, n_old = 5;
  at::Tensor attention = testing::RandomCausalAttention(8, n_new, n_old, 3);
  for (auto precision : {AttentionPrecision::kBf16, AttentionPrecision::kF32}) {
    SpectrogramState fused{at::zeros({kv, n_old + n_new, 32}), at::zeros({kv, n_old + n_new, 17})};
    SpectrogramState generic{at::zeros({kv, n_old + n_new, 32}), at::zeros({kv, n_old + n_new, 17})};
    consume_attention(attention, precision, 40, fused);
    consume_attention(attention.to(at::kDouble), precision, 40, generic);
    const double tol = precision == AttentionPrecision::kBf16 ? 0.0 : 1e-7;
    EXPECT_TRUE(AllClose(fused.samples, ToArray(generic.samples), tol, 0));
    EXPECT_TRUE(AllClose(fused.ema, ToArray(generic.ema), tol, 0));
    // And the fused path agrees with the bit-level reference reduction for the last 8 queries (queries 80-87:
    // hop 5, which writes the upper half of the ring).
    Array reduced = testing::RefGqaMean(ToArray(attention), kv, precision == AttentionPrecision::kBf16);
    for (int64_t j = 0; j < n_old + n_new; j += 7) {
      for (int64_t r = 0; r < 8; ++r) {
        EXPECT_EQ(fused.samples[0][j][16 + r].item<float>(), static_cast<float>(reduced.at({0, n_new - 8 + r, j})));
      }
    }
  }
}

// gqa_mean_into: the CPU kernel (float32) and the tensor path (float64, what other devices take) write gqa_mean's
// rows into a view of a wider buffer (43 keys: whole vectors and a tail).
TEST(GqaMeanInto, KernelAndTensorPathsWriteGqaMeansRows) {
  const int64_t kv = 2, n_new = 37, n_old = 6, n = n_old + n_new;
  at::Tensor attention = testing::RandomCausalAttention(8, n_new, n_old, 5);
  for (auto precision : {AttentionPrecision::kBf16, AttentionPrecision::kF32}) {
    at::Tensor fused = at::zeros({kv, n_new + 3, n + 5}), generic = at::zeros({kv, n_new + 3, n + 5});
    gqa_mean_into(attention, precision, fused.narrow(1, 3, n_new).narrow(2, 2, n));
    gqa_mean_into(attention.to(at::kDouble), precision, generic.narrow(1, 3, n_new).narrow(2, 2, n));
    const at::Tensor expected = gqa_mean(attention, kv, precision);
    EXPECT_TRUE(fused.narrow(1, 3, n_new).narrow(2, 2, n).equal(expected));
    EXPECT_TRUE(at::allclose(generic.narrow(1, 3, n_new).narrow(2, 2, n), expected, 0,
                             precision == AttentionPrecision::kBf16 ? 0 : 1e-7));
    EXPECT_EQ(fused.sum().item<double>(), fused.narrow(1, 3, n_new).narrow(2, 2, n).sum().item<double>())
        << "wrote outside its view";
  }
}

// fold_frames over query-major samples gives the EMA consume_attention's ring gives for the same queries: frames
// ending at queries 15, 31, 47 and 63 of a fresh sequence (the first with 16 zero queries before it). The CPU
// kernel (float32) and the tensor path (float64) both.
TEST(FoldFrames, EqualsTheRingsEmaForTheSameFrames) {
  const int64_t kv = 2, n = 64;
  at::Tensor attention = testing::RandomCausalAttention(8, n, 0, 9);
  SpectrogramState ring{at::zeros({kv, n, 32}), at::zeros({kv, n, 17})};
  consume_attention(attention, AttentionPrecision::kF32, 0, ring);
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    at::Tensor samples = at::zeros({kv, 16 + n, n}, dtype);  // 16 zero queries, then queries 0..63
    samples.narrow(1, 16, n).copy_(gqa_mean(attention, kv, AttentionPrecision::kF32));
    at::Tensor ema = at::zeros({kv, n, 17}, dtype);
    fold_frames(samples.narrow(1, 0, 48), ema);    // frames ending at 15 and 31
    fold_frames(samples.narrow(1, 32, 48), ema);   // frames ending at 47 and 63, from a view that starts later
    EXPECT_TRUE(at::allclose(ema.to(at::kFloat), ring.ema, 1e-6, 1e-9)) << dtype;
  }
}

}  // namespace
}  // namespace namm
