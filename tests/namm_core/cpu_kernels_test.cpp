// The hand-vectorized CPU kernels, every instruction set this CPU runs, against the tensor operations they
// replace (run in float64, the path other devices and dtypes take).
#include <gtest/gtest.h>


#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <new>
#include <thread>

#include "cpu_kernels/task_pool.h"
#include "cpu_kernels/tensor_kernels.h"
#include "namm/bam_scorer.h"
#include "namm/stft_features.h"
#include "stft_basis.h"
#include "test_util.h"

namespace namm {
namespace {

using testing::AllClose;
using testing::RandomNormal;
using testing::ToArray;

TEST(CpuKernels, TheWidestRunnableIsChosenAndTheBaselineAlwaysRuns) {
  const std::vector<const cpu::Kernels*> runnable = cpu::runnable_kernels();
  ASSERT_FALSE(runnable.empty());
  EXPECT_EQ(&cpu::kernels(), runnable.front());
  EXPECT_STREQ(runnable.back()->isa, "baseline");
}

TEST(TaskPool, RunsEveryTaskOnceAndNestedCallsInline) {
  std::vector<std::atomic<int>> runs(1000);
  cpu::parallel_tasks(1000, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) runs[static_cast<std::size_t>(i)]++;
  });
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
  // A call from inside a task (the pool is busy) runs its whole range on the calling thread, in one share.
  std::atomic<int> nested_shares{0};
  cpu::parallel_tasks(2, [&](int64_t begin, int64_t) {
    if (begin == 0)
      cpu::parallel_tasks(100, [&](int64_t b, int64_t e) { nested_shares += (b == 0 && e == 100); });
  });
  EXPECT_EQ(nested_shares.load(), 1);
}

// A share that throws (as an allocation that fails does) reaches the caller after every other share finished; the
// pool's threads survive it and serve the next call. Earlier, a throw on a pool thread terminated the process,
// and one on the calling thread returned while the others still ran its callback.
TEST(TaskPool, AThrowingShareReachesTheCallerAfterTheOthersFinish) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: no pool thread";
  for (int64_t thrower : {0, 1}) {
    std::atomic<int> finished{0};
    const auto call = [&] {
      cpu::parallel_tasks(2, [&](int64_t begin, int64_t) {
        if (begin == thrower) throw std::bad_alloc();  // what an allocation that fails throws
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // still running when the other throws
        ++finished;
      });
    };
    EXPECT_ANY_THROW(call()) << "share " << thrower;
    EXPECT_EQ(finished.load(), 1) << "the other share finished first";
  }
  std::atomic<int> runs{0};
  cpu::parallel_tasks(100, [&](int64_t begin, int64_t end) { runs += static_cast<int>(end - begin); });
  EXPECT_EQ(runs.load(), 100);
}

// Each output row is computed by one thread, in a fixed order: the same bits on one thread as on many (a call
// nested in a task runs on one).
TEST(CpuKernels, TheSameBitsOnOneThreadAsOnMany) {
  const at::Tensor q = RandomNormal({4, 600, 32}, 7), k = RandomNormal({4, 600, 32}, 8),
                   v = RandomNormal({4, 600, 32}, 9);
  const at::Tensor samples = RandomNormal({4, 48, 600}, 10).abs_(),
                   start = RandomNormal({4, 600, 17}, 11).abs_();
  const auto run = [&] {
    const at::Tensor ema = start.clone();
    cpu::fold_frames(samples, ema, windowed_dft_basis_cpu(), 0.85, cpu::kernels());
    return std::make_pair(cpu::backward_masked_attention(q, k, v, 0.2, cpu::kernels()), ema);
  };
  const auto many = run();
  std::pair<at::Tensor, at::Tensor> one;
  cpu::parallel_tasks(2, [&](int64_t begin, int64_t) {
    if (begin == 0) one = run();
  });
  EXPECT_TRUE(one.first.equal(many.first));
  EXPECT_TRUE(one.second.equal(many.second));
}

// Sizes around the kernels' tiles (16 keys, 4 or 8 query rows) and value widths that need padding.
TEST(CpuKernels, BackwardMaskedAttentionMatchesTensorOperations) {
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    for (auto [heads, n, d, dv] : std::vector<std::array<int64_t, 4>>{{1, 1, 32, 32},
                                                                      {2, 7, 32, 32},
                                                                      {3, 16, 8, 16},
                                                                      {2, 17, 32, 5},
                                                                      {4, 300, 32, 32},
                                                                      {1, 1000, 16, 64}}) {
      const at::Tensor q = RandomNormal({heads, n, d}, 10 + n, 2.0),
                       k = RandomNormal({heads, n, d}, 20 + n, 2.0), v = RandomNormal({heads, n, dv}, 30 + n);
      const at::Tensor expected =
          backward_masked_attention(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), 0.17);
      const at::Tensor got = cpu::backward_masked_attention(q, k, v, 0.17, *kernels);
      EXPECT_TRUE(AllClose(got, ToArray(expected), 2e-6, 2e-5))
          << kernels->isa << " heads " << heads << " n " << n << " d " << d << " dv " << dv;
    }
  }
}

// Scores far apart: most probabilities underflow to 0 and the softmax must not turn them into NaN.
TEST(CpuKernels, BackwardMaskedAttentionSurvivesExtremeScores) {
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    const at::Tensor q = RandomNormal({2, 50, 32}, 1, 30.0), k = RandomNormal({2, 50, 32}, 2, 30.0),
                     v = RandomNormal({2, 50, 32}, 3);
    const at::Tensor expected =
        backward_masked_attention(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), 1.0);
    EXPECT_TRUE(
        AllClose(cpu::backward_masked_attention(q, k, v, 1.0, *kernels), ToArray(expected), 1e-5, 1e-4))
        << kernels->isa;
  }
}

// GQA means bit for bit gqa_mean's (groups of 4 and of 3: exact and inexact reciprocals; 43 keys: a tail).
TEST(CpuKernels, GqaMeanIsTorchsMeanBitForBit) {
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    for (int64_t q_heads : {8, 6}) {
      const at::Tensor attention = testing::RandomCausalAttention(q_heads, 37, 6, 11);
      for (bool bf16 : {true, false}) {
        const at::Tensor out = at::zeros({2, 37, 43});
        cpu::gqa_mean_into(attention, bf16, out, *kernels);
        EXPECT_TRUE(
            out.equal(gqa_mean(attention, 2, bf16 ? AttentionPrecision::kBf16 : AttentionPrecision::kF32)))
            << kernels->isa << " q_heads " << q_heads << " bf16 " << bf16;
      }
    }
  }
}

// Probabilities from scores and log-sum-exp, masked by position (after the query; a window of 20), then the
// GQA mean: against the same in tensor operations. Key positions with gaps, as after an eviction.
TEST(CpuKernels, ScoresGqaMeanMatchesTensorOperations) {
  const int64_t kv = 2, group = 3, rows = 5, n = 45, first_query = 50, window = 20;
  const at::Tensor scores = RandomNormal({kv * group, rows, n}, 6, 3.0);
  const at::Tensor lse = scores.logsumexp(2).add_(0.5);
  const at::Tensor positions =
      at::arange(n, at::TensorOptions().dtype(at::kInt)).mul_(2).view({1, n}).repeat({kv, 1});
  const at::Tensor query =
      at::arange(first_query, first_query + rows, at::TensorOptions().dtype(at::kInt)).view({1, rows, 1});
  const at::Tensor hidden =
      positions.unsqueeze(1).gt(query).logical_or_(positions.unsqueeze(1).le(query - window));
  const at::Tensor probs = scores.sub(lse.unsqueeze(2))
                               .exp_()
                               .view({kv, group, rows, n})
                               .masked_fill_(hidden.unsqueeze(1), 0.0)
                               .view({kv * group, rows, n});
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    for (bool bf16 : {false, true}) {
      const at::Tensor out = at::empty({kv, rows, n});
      cpu::scores_gqa_mean_into(scores, lse, positions, first_query, window, bf16, out, *kernels);
      const at::Tensor expected =
          gqa_mean(probs, kv, bf16 ? AttentionPrecision::kBf16 : AttentionPrecision::kF32);
      EXPECT_TRUE(at::allclose(out, expected, bf16 ? 8e-3 : 1e-6, 1e-8)) << kernels->isa << " bf16 " << bf16;
      EXPECT_TRUE(out.eq(0).equal(expected.eq(0))) << kernels->isa << ": the masked keys";
    }
  }
}

// Folding 5 frames into a non-zero EMA: the kernel against the tensor path in float64 (300 tokens: a sweep of
// 256, then two groups of 16 and a tail).
TEST(CpuKernels, FoldFramesMatchesTensorOperations) {
  const int64_t kv = 3, n = 300, queries = 16 * 6;
  const at::Tensor samples = testing::RandomNormal({kv, queries, n}, 4).abs_().div_(n);
  const at::Tensor start = testing::RandomNormal({kv, n, 17}, 5).abs_();
  const at::Tensor expected = start.to(at::kDouble);
  fold_frames(samples.to(at::kDouble), expected);
  const double a = std::pow(0.99, 16);
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    const at::Tensor ema = start.clone();
    cpu::fold_frames(samples, ema, windowed_dft_basis_cpu(), a, *kernels);
    EXPECT_TRUE(AllClose(ema, ToArray(expected), 1e-7, 1e-5)) << kernels->isa;
  }
}


// The batched engine's products: a row's result is the same bits whatever else is in the call (1 row or 300,
// the tile's edge or its middle, one thread or the pool), and is the product within float32 rounding.
TEST(CpuKernels, LinearRowsAreTheSameBitsWhateverTheyAreBatchedWith) {
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    for (auto [k, n] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {64, 172}, {172, 64}, {37, 5}, {1024, 300}}) {
      const at::Tensor x = RandomNormal({300, k}, 40 + k), w = RandomNormal({n, k}, 50 + n),
                       b = RandomNormal({n}, 60 + n);
      const at::Tensor all = cpu::linear(x, w, b, *kernels);
      // Float32 rounding of k products of unit normals: about 1e-7 sqrt(k) of a sum whose size is sqrt(k).
      const double tolerance = 4e-7 * static_cast<double>(k);
      EXPECT_TRUE(AllClose(all, ToArray(at::linear(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble))),
                           tolerance, tolerance))
          << kernels->isa << " k " << k << " n " << n;
      for (int64_t m : {1, 2, 3, 5, 8, 13, 129}) {
        for (int64_t first : {int64_t{0}, 300 - m}) {
          EXPECT_TRUE(cpu::linear(x.narrow(0, first, m), w, b, *kernels).equal(all.narrow(0, first, m)))
              << kernels->isa << " k " << k << " n " << n << " rows " << first << "+" << m;
        }
      }
      // A strided input (a row of a wider tensor) and no bias.
      const at::Tensor wide = RandomNormal({3, 2 * k}, 70);
      EXPECT_TRUE(cpu::linear(wide.narrow(1, 0, k), w, at::Tensor(), *kernels)
                      .equal(cpu::linear(wide.narrow(1, 0, k).contiguous(), w, at::Tensor(), *kernels)));
    }
  }
}

// The output-major product (a NAMM scorer's layers, a small model's products): every variant against float64, and
// a row's bits independent of the rows beside it, from weights in either layout.
TEST(CpuKernels, OutputMajorLinearRowsAreTheSameBitsWhateverTheyAreBatchedWith) {
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    for (auto [k, n] : std::vector<std::pair<int64_t, int64_t>>{{25, 96}, {32, 50}, {25, 25}, {64, 172}, {172, 64}, {7, 1}}) {
      const at::Tensor x = RandomNormal({300, k}, 90 + k), w = RandomNormal({k, n}, 91 + n), b = RandomNormal({n}, 92 + n);
      const cpu::InOutWeight in_out = cpu::make_in_out_weight(w, b, /*out_in=*/false);
      const auto run = [&](const cpu::InOutWeight& weight, const at::Tensor& rows) {
        at::Tensor y = at::empty({rows.size(0), n}, rows.options());
        cpu::linear_in_out(rows.data_ptr<float>(), rows.stride(0), rows.size(0), weight, y.data_ptr<float>(), n, *kernels);
        return y;
      };
      const at::Tensor all = run(in_out, x);
      const double tolerance = 4e-7 * static_cast<double>(k);
      EXPECT_TRUE(AllClose(all, ToArray(x.to(at::kDouble).matmul(w.to(at::kDouble)) + b.to(at::kDouble)), tolerance,
                           tolerance))
          << kernels->isa << " k " << k << " n " << n;
      for (int64_t m : {1, 2, 3, 5, 8, 13}) {
        for (int64_t first : {int64_t{0}, 300 - m}) {
          EXPECT_TRUE(run(in_out, x.narrow(0, first, m).contiguous()).equal(all.narrow(0, first, m)))
              << kernels->isa << " k " << k << " n " << n << " rows " << first << "+" << m;
        }
      }
      // The same weight given as torch's [out, in] layout.
      EXPECT_TRUE(run(cpu::make_in_out_weight(w.t().contiguous(), b, /*out_in=*/true), x).equal(all)) << kernels->isa;
    }
  }
}

TEST(CpuKernels, SiluMulAndRmsNormAreTheSameBitsWhateverTheyAreBatchedWith) {
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    const at::Tensor gate = RandomNormal({301, 172}, 80, 4.0), up = RandomNormal({301, 172}, 81);
    const at::Tensor all = cpu::silu_mul(gate, up, *kernels);
    EXPECT_TRUE(AllClose(all, ToArray(at::silu(gate.to(at::kDouble)) * up.to(at::kDouble)), 1e-6, 1e-5)) << kernels->isa;
    const at::Tensor x = RandomNormal({301, 172}, 82), weight = RandomNormal({172}, 83);
    const at::Tensor normed = cpu::rms_norm(x, weight, 1e-5, *kernels);
    const at::Tensor x64 = x.to(at::kDouble);
    EXPECT_TRUE(AllClose(normed, ToArray(weight.to(at::kDouble) * x64 * at::rsqrt(x64.square().mean(-1, true) + 1e-5)),
                         1e-6, 1e-5))
        << kernels->isa;
    for (int64_t m : {1, 3, 17}) {
      for (int64_t first : {int64_t{0}, int64_t{5}, 301 - m}) {
        EXPECT_TRUE(cpu::silu_mul(gate.narrow(0, first, m).contiguous(), up.narrow(0, first, m).contiguous(), *kernels)
                        .equal(all.narrow(0, first, m)))
            << kernels->isa << " rows " << first << "+" << m;
        EXPECT_TRUE(cpu::rms_norm(x.narrow(0, first, m), weight, 1e-5, *kernels).equal(normed.narrow(0, first, m)))
            << kernels->isa << " rows " << first << "+" << m;
      }
    }
  }
}

// A sequence for batched_attention: t queries against a cache of n keys (the chunk's last) stored with spare
// capacity, queries as a view of a wider tensor, key positions with gaps (as after an eviction) that differ
// between KV heads, the chunk at positions first_position ...
cpu::AttentionInput AttentionSequence(int64_t t, int64_t n, int64_t kv_heads, int64_t group, int64_t d,
                                      int64_t window, uint64_t seed) {
  const int64_t heads = kv_heads * group, capacity = n + 9, n_old = n - t;
  cpu::AttentionInput in;
  in.q = RandomNormal({t, heads * d + 8}, seed, 1.5).narrow(1, 0, heads * d);
  in.keys = RandomNormal({kv_heads, capacity, d}, seed + 1).narrow(1, 0, n);
  in.values = RandomNormal({kv_heads, capacity, d}, seed + 2).narrow(1, 0, n);
  in.first_position = 2 * n_old + 3;
  const at::Tensor positions = at::zeros({kv_heads, capacity}, at::TensorOptions().dtype(at::kLong));
  auto position = positions.accessor<int64_t, 2>();
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t j = 0; j < n; ++j) {
      position[h][j] = j < n_old ? 2 * j + h % 2 : in.first_position + j - n_old;
    }
  }
  in.key_positions = positions.narrow(1, 0, n);
  in.window = window;
  in.probabilities = in.log_sum_exp = true;
  return in;
}

// LlamaModel::Attention's tensor operations in float64: bmm, the causal and window masks, softmax, bmm.
cpu::AttentionOutput ReferenceAttention(const cpu::AttentionInput& in, int64_t heads, double scale) {
  const at::Tensor q = in.q.to(at::kDouble), k = in.keys.to(at::kDouble), v = in.values.to(at::kDouble);
  const int64_t t = q.size(0), kv_heads = k.size(0), n = k.size(1), d = k.size(2), group = heads / kv_heads;
  const double hidden = -std::numeric_limits<double>::infinity();
  const at::Tensor scores = at::bmm(q.view({t, heads, d}).transpose(0, 1).reshape({kv_heads, group * t, d}),
                                    k.transpose(1, 2))
                                .mul_(scale)
                                .view({kv_heads, group, t, n});
  scores.narrow(3, n - t, t).masked_fill_(at::ones({t, t}, at::TensorOptions().dtype(at::kBool)).triu(1), hidden);
  if (in.window > 0) {
    const at::Tensor query = at::arange(in.first_position, in.first_position + t, at::TensorOptions().dtype(at::kLong));
    const at::Tensor behind = query.view({1, t, 1}) - in.key_positions.unsqueeze(1);  // [kv_heads, t, n]
    scores.masked_fill_(behind.ge(in.window).unsqueeze(1), hidden);
  }
  cpu::AttentionOutput ref;
  ref.log_sum_exp = scores.logsumexp(-1).view({heads, t});
  ref.probabilities = scores.softmax(-1);
  ref.out = at::bmm(ref.probabilities.view({kv_heads, group * t, n}), v)
                .view({heads, t, d})
                .transpose(0, 1)
                .reshape({t, heads * d});
  ref.probabilities = ref.probabilities.view({heads, t, n});
  return ref;
}

// Chunks of 1, 7 and 32 queries over caches of 1 to 300 keys, head sizes 8 (stories260K's), 12 (the keys' tile
// transposed 8 components by shuffles, the rest one by one) and 64, GQA groups of 2, with and without a window
// (20 positions: it hides part of most caches): outputs, probabilities and log-sum-exp within float32 rounding of
// the float64 tensor operations.
TEST(CpuKernels, BatchedAttentionMatchesTensorOperations) {
  const int64_t kv_heads = 2, group = 2, heads = kv_heads * group;
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    for (int64_t d : {8, 12, 64}) {
      for (int64_t window : {0, 20}) {
        std::vector<cpu::AttentionInput> batch;
        for (int64_t t : {1, 7, 32}) {
          for (int64_t n : {1, 7, 16, 17, 33, 100, 300}) {
            if (n >= t) batch.push_back(AttentionSequence(t, n, kv_heads, group, d, window, 100 + 10 * n + t));
          }
        }
        const double scale = 1.0 / std::sqrt(static_cast<double>(d));
        const std::vector<cpu::AttentionOutput> got = cpu::batched_attention(batch, heads, scale, *kernels);
        for (std::size_t s = 0; s < batch.size(); ++s) {
          const cpu::AttentionOutput ref = ReferenceAttention(batch[s], heads, scale);
          const std::string where = std::string(kernels->isa) + " d " + std::to_string(d) + " window " +
                                    std::to_string(window) + " t " + std::to_string(batch[s].q.size(0)) + " n " +
                                    std::to_string(batch[s].keys.size(1));
          EXPECT_TRUE(AllClose(got[s].out, ToArray(ref.out), 2e-6, 1e-5)) << where;
          EXPECT_TRUE(AllClose(got[s].probabilities, ToArray(ref.probabilities), 1e-7, 1e-5)) << where;
          EXPECT_TRUE(AllClose(got[s].log_sum_exp, ToArray(ref.log_sum_exp), 1e-6, 1e-6)) << where;
          EXPECT_TRUE(got[s].probabilities.eq(0).equal(ref.probabilities.eq(0))) << where << ": the hidden keys";
        }
      }
    }
  }
}

// A sequence's attention is the same bits computed alone, among 4 others of different lengths, in work items
// of 1, 5 or the chosen number of rows, on one thread or on the pool.
TEST(CpuKernels, BatchedAttentionIsTheSameBitsWhateverItIsBatchedWith) {
  const int64_t kv_heads = 2, group = 2, heads = kv_heads * group;
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    for (int64_t d : {8, 64}) {
      std::vector<cpu::AttentionInput> batch;
      for (auto [t, n, window] : std::vector<std::array<int64_t, 3>>{
               {7, 45, 0}, {1, 300, 20}, {32, 32, 0}, {13, 200, 20}, {32, 150, 0}}) {
        batch.push_back(AttentionSequence(t, n, kv_heads, group, d, window, 500 + n));
      }
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      const std::vector<cpu::AttentionOutput> together = cpu::batched_attention(batch, heads, scale, *kernels);
      std::vector<cpu::AttentionOutput> one_thread;
      cpu::parallel_tasks(2, [&](int64_t begin, int64_t) {
        if (begin == 0) one_thread = cpu::batched_attention(batch, heads, scale, *kernels);
      });
      for (std::size_t s = 0; s < batch.size(); ++s) {
        const std::string where = std::string(kernels->isa) + " d " + std::to_string(d) + " sequence " + std::to_string(s);
        const auto same = [&](const cpu::AttentionOutput& a, const cpu::AttentionOutput& b, const std::string& how) {
          EXPECT_TRUE(a.out.equal(b.out)) << where << " " << how;
          EXPECT_TRUE(a.probabilities.equal(b.probabilities)) << where << " " << how;
          EXPECT_TRUE(a.log_sum_exp.equal(b.log_sum_exp)) << where << " " << how;
        };
        same(together[s], one_thread[s], "one thread");
        for (int64_t block_rows : {0, 1, 5}) {
          same(together[s], cpu::batched_attention({batch[s]}, heads, scale, *kernels, block_rows).front(),
               "alone, blocks of " + std::to_string(block_rows));
        }
      }
      // Written into a view of a wider tensor (the engine's rows of every sequence's heads).
      const at::Tensor wide = at::zeros({7, heads * d + 5});
      cpu::AttentionInput into = batch[0];
      into.out = wide.narrow(1, 2, heads * d);
      cpu::batched_attention({into}, heads, scale, *kernels);
      EXPECT_TRUE(into.out.equal(together[0].out)) << kernels->isa;
    }
  }
}

// A chunk's rows attended a block at a time (the engine's way when the chunk's probabilities are too many at
// once): each block's queries, the keys truncated to what its last row sees, its probabilities written into the
// rows of a [heads, rows, n] buffer of the whole cache's width (the keys past the truncation zeros), give the bits
// of one call for all rows; a buffer of the wrong shape is refused.
TEST(CpuKernels, BatchedAttentionInRowBlocksIsTheSameBitsAsOneCall) {
  const int64_t kv_heads = 2, group = 2, heads = kv_heads * group, d = 8, t = 13, n = 120;
  for (const cpu::Kernels* kernels : cpu::runnable_kernels()) {
    for (int64_t window : {0, 20}) {
      const cpu::AttentionInput whole = AttentionSequence(t, n, kv_heads, group, d, window, 900 + window);
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      const cpu::AttentionOutput once = cpu::batched_attention({whole}, heads, scale, *kernels).front();
      const at::Tensor out = at::zeros({t, heads * d});
      const at::Tensor probabilities = at::full({heads, 5, n}, 7.0f);  // garbage the blocks must overwrite
      for (int64_t b0 = 0; b0 < t; b0 += 5) {
        const int64_t rows = std::min<int64_t>(5, t - b0), seen = n - t + b0 + rows;
        cpu::AttentionInput block = whole;
        block.q = whole.q.narrow(0, b0, rows);
        block.keys = whole.keys.narrow(1, 0, seen);
        block.values = whole.values.narrow(1, 0, seen);
        block.first_position = whole.first_position + b0;
        block.out = out.narrow(0, b0, rows);
        block.probabilities_out = probabilities.narrow(1, 0, rows);
        const cpu::AttentionOutput got = cpu::batched_attention({block}, heads, scale, *kernels).front();
        const std::string where = std::string(kernels->isa) + " window " + std::to_string(window) + " rows " +
                                  std::to_string(b0);
        EXPECT_TRUE(got.probabilities.equal(once.probabilities.narrow(1, b0, rows))) << where;
        EXPECT_TRUE(got.log_sum_exp.equal(once.log_sum_exp.narrow(1, b0, rows))) << where;
      }
      EXPECT_TRUE(out.equal(once.out)) << kernels->isa;
      cpu::AttentionInput narrow = whole;
      narrow.probabilities_out = at::empty({heads, t, n - 1});
      EXPECT_THROW(cpu::batched_attention({narrow}, heads, scale, *kernels), c10::Error) << "a buffer narrower than n";
    }
  }
}

}  // namespace
}  // namespace namm
