// The NAMM's observe path on a GPU (our CUDA kernels where the build has them, NAMM_CUDA_KERNELS, else
// libtorch operators) against the same calls on the CPU: GQA means of attention rows, the means recomputed
// from the query history, and the fold of frames into the spectrogram EMA. Inputs and outputs are strided
// views, as the engine passes them. Skipped without a CUDA device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>

#include "namm/kv_cache.h"
#include "namm/query_history.h"
#include "namm/stft_features.h"

namespace namm {
namespace {

const at::TensorOptions kF32 = at::TensorOptions().dtype(at::kFloat);
const at::Device kGpu(at::kCUDA, 0);

#define NAMM_SKIP_WITHOUT_CUDA() \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device in this build or machine"

// Largest absolute difference, for failure messages.
float MaxDifference(const at::Tensor& a, const at::Tensor& b) {
  return (a.cpu() - b.cpu()).abs().max().item<float>();
}

// A [d0, rows, d2] view into a tensor with `pad` more rows in dimension 1 (so its head stride is not rows *
// d2), filled with -1.
at::Tensor PaddedView(int64_t d0, int64_t rows, int64_t d2, int64_t pad, const at::TensorOptions& options) {
  return at::full({d0, rows + pad, d2}, -1.0f, options).narrow(1, pad, rows);
}

TEST(ObserveOnCuda, RunsOurKernelsWhereBuilt) {
  EXPECT_FALSE(observe_kernels_run_on(at::kCPU));
  NAMM_SKIP_WITHOUT_CUDA();
#ifdef NAMM_CUDA_KERNELS
  EXPECT_TRUE(observe_kernels_run_on(kGpu)) << "built with the kernels, but they do not run on this device";
#else
  EXPECT_FALSE(observe_kernels_run_on(kGpu));
#endif
}

TEST(ObserveOnCuda, GqaMeanMatchesTheCpu) {
  NAMM_SKIP_WITHOUT_CUDA();
  at::manual_seed(11);
  const int64_t rows = 40, n = 300;
  for (const auto& [kv_heads, group] : {std::tuple<int64_t, int64_t>{4, 4}, {8, 1}, {2, 8}}) {
    // Every other row of a larger tensor, as the engine's attention blocks are views.
    const at::Tensor full = at::randn({kv_heads * group, 2 * rows, n}, kF32).softmax(2);
    for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor cpu_input = full.to(type).slice(1, 0, 2 * rows, 2);
      const at::Tensor gpu_input = full.to(kGpu).to(type).slice(1, 0, 2 * rows, 2);
      for (const AttentionPrecision precision : {AttentionPrecision::kF32, AttentionPrecision::kBf16}) {
        const at::Tensor cpu = PaddedView(kv_heads, rows, n, 3, kF32);
        const at::Tensor gpu = PaddedView(kv_heads, rows, n, 3, kF32.device(kGpu));
        gqa_mean_into(cpu_input, precision, cpu);
        gqa_mean_into(gpu_input, precision, gpu);
        const std::string what = std::string(c10::toString(type)) + ", kv " + std::to_string(kv_heads) +
                                 " x " + std::to_string(group) + ", bf16 precision " +
                                 std::to_string(precision == AttentionPrecision::kBf16);
        if (type == at::kFloat) {
          // The engine's attention is float32: summed in the same order and divided the same way, bit for
          // bit.
          EXPECT_TRUE(at::equal(gpu.cpu(), cpu)) << what << ": " << MaxDifference(gpu, cpu);
        } else {
          const double rtol =
              precision == AttentionPrecision::kF32 ? 1e-6 : 8e-3;  // bf16: a rounding may flip
          EXPECT_TRUE(at::allclose(gpu.cpu(), cpu, rtol, 1e-8)) << what << ": " << MaxDifference(gpu, cpu);
        }
      }
    }
  }
}

TEST(ObserveOnCuda, FrameFoldMatchesTheCpu) {
  NAMM_SKIP_WITHOUT_CUDA();
  at::manual_seed(12);
  const int64_t kv_heads = 4, n = 300, capacity = 512;
  for (const int64_t frames : {1, 8, 33}) {
    const int64_t rows = kStftHop * (frames + 1);
    const at::Tensor samples = at::rand({kv_heads, rows, n}, kF32).mul_(0.01);
    const at::Tensor ema = at::rand({kv_heads, n, kStftBins}, kF32).mul_(0.01);
    // As the engine passes them: samples a narrowed buffer, the EMA the live part of a preallocated cache
    // state.
    const at::Tensor cpu_samples = PaddedView(kv_heads, rows, n, 16, kF32);
    const at::Tensor gpu_samples = PaddedView(kv_heads, rows, n, 16, kF32.device(kGpu));
    cpu_samples.copy_(samples);
    gpu_samples.copy_(samples);
    const at::Tensor cpu_ema = at::zeros({kv_heads, capacity, kStftBins}, kF32).narrow(1, 0, n);
    const at::Tensor gpu_ema = at::zeros({kv_heads, capacity, kStftBins}, kF32.device(kGpu)).narrow(1, 0, n);
    cpu_ema.copy_(ema);
    gpu_ema.copy_(ema);
    fold_frames(cpu_samples, cpu_ema);
    fold_frames(gpu_samples, gpu_ema);
    // The DFT's 32 products are summed in another order: within rounding.
    EXPECT_TRUE(at::allclose(gpu_ema.cpu(), cpu_ema, 1e-5, 1e-9))
        << frames << " frames: " << MaxDifference(gpu_ema, cpu_ema);
    EXPECT_FALSE(at::allclose(cpu_ema, ema)) << "the fold changed nothing";
  }
}

// Scores with hidden keys (-inf), as the engine's attention blocks hold them: a causal triangle over the last
// keys.
at::Tensor MaskedScores(int64_t heads, int64_t rows, int64_t n) {
  const at::Tensor scores = at::randn({2, heads / 2, rows, n}, kF32).mul_(3.0);
  const at::Tensor future = at::ones({rows, rows}, kF32.dtype(at::kBool)).triu(1);
  scores.narrow(3, n - rows, rows).masked_fill_(future, -std::numeric_limits<float>::infinity());
  return scores;
}

TEST(ObserveOnCuda, AttentionProbabilitiesMatchTheCpu) {
  NAMM_SKIP_WITHOUT_CUDA();
  at::manual_seed(14);
  const int64_t heads = 8, rows = 24, lse_from = 5;
  for (const int64_t n : {40, 3000}) {
    const at::Tensor scores = MaskedScores(heads, rows, n);
    for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor cpu_lse = at::full({2, heads / 2, rows - lse_from}, -1.0f, kF32);
      const at::Tensor gpu_lse = at::full({2, heads / 2, rows - lse_from + 3}, -1.0f, kF32.device(kGpu))
                                     .narrow(2, 3, rows - lse_from);  // a view, as the engine's buffer is
      const at::Tensor cpu = attention_probabilities(scores.to(type), lse_from, cpu_lse);
      const at::Tensor gpu = attention_probabilities(scores.to(kGpu).to(type), lse_from, gpu_lse);
      const std::string what = std::string(c10::toString(type)) + ", n " + std::to_string(n);
      ASSERT_EQ(gpu.scalar_type(), at::kFloat) << what;
      EXPECT_TRUE(at::allclose(gpu.cpu(), cpu, 1e-5, 1e-8)) << what << ": " << MaxDifference(gpu, cpu);
      EXPECT_TRUE(at::allclose(gpu_lse.cpu(), cpu_lse, 1e-6, 1e-6))
          << what << ": " << MaxDifference(gpu_lse, cpu_lse);
      EXPECT_TRUE(gpu.cpu().eq(0).equal(cpu.eq(0))) << what << ": the same keys are hidden";
    }
  }
}

// The query history's recomputed means on a cache that has evicted tokens, with and without a window. Keys
// and queries are small integers, so that every product is exact in every dtype and the devices differ only
// in the exponential's last bits: a missed rounding (of the scaled product to the keys' dtype) would show.
TEST(ObserveOnCuda, QueryHistoryMeanMatchesTheCpu) {
  NAMM_SKIP_WITHOUT_CUDA();
  at::manual_seed(13);
  const int64_t kv_heads = 4, group = 4, heads = kv_heads * group, hd = 32, n = 200, kept = 150, rows = 24;
  const auto small_integers = [](at::IntArrayRef shape) { return at::randint(-1, 2, shape, kF32); };
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const int64_t window : {0, 90}) {
      const at::TensorOptions options = kF32.dtype(type);
      LayerKVCache cpu_cache(kv_heads, hd, options);
      LayerKVCache gpu_cache(kv_heads, hd, options.device(kGpu));
      const at::Tensor keys = small_integers({kv_heads, n, hd}).to(type),
                       values = at::randn({kv_heads, n, hd}, options);
      const at::Tensor positions = at::arange(n, kF32.dtype(at::kLong));
      ASSERT_TRUE(cpu_cache.Append(keys, values, positions).ok());
      ASSERT_TRUE(gpu_cache.Append(keys.to(kGpu), values.to(kGpu), positions.to(kGpu)).ok());
      // Every head keeps its own 150 of the 200 tokens.
      const at::Tensor keep = std::get<0>(
          at::rand({kv_heads, n}, kF32).argsort(/*dim=*/1, /*descending=*/false).narrow(1, 0, kept).sort(1));
      ASSERT_TRUE(cpu_cache.Gather(keep).ok());
      ASSERT_TRUE(gpu_cache.Gather(keep.to(kGpu)).ok());
      // Queries n - rows .. n - 1 with log-sum-exps of their own (only their consistency across devices
      // matters).
      const at::Tensor queries = small_integers({heads, rows, hd}).to(type);
      const at::Tensor lse = at::rand({heads, rows}, kF32).add_(3.0);
      QueryHistory cpu_history, gpu_history;
      ASSERT_TRUE(cpu_history.Record(queries, lse, n - rows, window, 31).ok());
      ASSERT_TRUE(gpu_history.Record(queries.to(kGpu), lse.to(kGpu), n - rows, window, 31).ok());
      for (const AttentionPrecision precision : {AttentionPrecision::kF32, AttentionPrecision::kBf16}) {
        const int64_t from = n - rows + 3, to = n - 2;
        const at::Tensor cpu = PaddedView(kv_heads, to - from, kept, 5, kF32);
        const at::Tensor gpu = PaddedView(kv_heads, to - from, kept, 5, kF32.device(kGpu));
        ASSERT_TRUE(cpu_history.GqaMeanAttention(cpu_cache, from, to, precision, cpu).ok());
        ASSERT_TRUE(gpu_history.GqaMeanAttention(gpu_cache, from, to, precision, gpu).ok());
        // What the kernel replaces: libtorch operators on the same device.
        auto gpu_probs = gpu_history.Attention(gpu_cache, from, to);
        ASSERT_TRUE(gpu_probs.ok());
        const at::Tensor gpu_ops = gqa_mean(*gpu_probs, kv_heads, precision).cpu();
        const std::string what = std::string(c10::toString(type)) + ", window " + std::to_string(window) +
                                 ", bf16 precision " +
                                 std::to_string(precision == AttentionPrecision::kBf16) +
                                 ": kernel vs operators " + std::to_string(MaxDifference(gpu, gpu_ops)) +
                                 ", kernel vs CPU " + std::to_string(MaxDifference(gpu, cpu)) +
                                 ", operators vs CPU " + std::to_string(MaxDifference(gpu_ops, cpu));
        std::printf("[ %s ]\n", what.c_str());
        // The exponentials differ in their last bits; a missed rounding of the scaled product would be 4e-4
        // and more. bf16 precision: a rounding of the mean may flip.
        const double rtol = precision == AttentionPrecision::kF32 ? 1e-4 : 8e-3;
        EXPECT_TRUE(at::allclose(gpu.cpu(), gpu_ops, rtol, 1e-9)) << what;
        // fp16: libtorch's operators on the CPU and on the GPU differ (up to 1e-3 on the H200, where the
        // kernel matched the GPU's operators to the last printed digit), so fp16 is held to the device's
        // operators only.
        if (type != at::kHalf) {
          EXPECT_TRUE(at::allclose(gpu.cpu(), cpu, rtol, 1e-9)) << what;
        }
        EXPECT_TRUE(gpu.cpu().eq(0).equal(cpu.eq(0))) << "the same keys are hidden";
        EXPECT_TRUE(cpu.eq(0).any().item<bool>() || window == 0) << "the window hides some keys";
      }
    }
  }
}

}  // namespace
}  // namespace namm
