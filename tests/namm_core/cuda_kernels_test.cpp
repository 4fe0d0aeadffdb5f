// The NAMM's observe path on a GPU (our CUDA kernels where the build has them, NAMM_CUDA_KERNELS, else libtorch
// operators) against the same calls on the CPU: GQA means of attention rows, the means recomputed from the query
// history, and the fold of frames into the spectrogram EMA. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>

#include <ATen/ATen.h>

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
float MaxDifference(const at::Tensor& a, const at::Tensor& b) { return (a.cpu() - b.cpu()).abs().max().item<float>(); }

TEST(ObserveOnCuda, GqaMeanMatchesTheCpu) {
  NAMM_SKIP_WITHOUT_CUDA();
  at::manual_seed(11);
  const int64_t kv_heads = 4, group = 4, rows = 40, n = 300;
  // A strided view, as the engine's attention blocks are: every other row of a larger tensor.
  const at::Tensor attention = at::randn({kv_heads * group, 2 * rows, n}, kF32).softmax(2).slice(1, 0, 2 * rows, 2);
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor input = attention.to(type);
    for (const AttentionPrecision precision : {AttentionPrecision::kF32, AttentionPrecision::kBf16}) {
      const at::Tensor cpu = at::full({kv_heads, rows, n}, -1.0f, kF32);
      const at::Tensor gpu = at::full({kv_heads, rows, n}, -1.0f, kF32.device(kGpu));
      gqa_mean_into(input, precision, cpu);
      gqa_mean_into(input.to(kGpu), precision, gpu);
      // Summed in the same order; bf16: one rounding may land on the neighbouring value.
      const double rtol = precision == AttentionPrecision::kF32 ? 1e-6 : 8e-3;
      EXPECT_TRUE(at::allclose(gpu.cpu(), cpu, rtol, 1e-7))
          << c10::toString(type) << ", bf16 precision " << (precision == AttentionPrecision::kBf16) << ": "
          << MaxDifference(gpu, cpu);
    }
  }
}

TEST(ObserveOnCuda, FrameFoldMatchesTheCpu) {
  NAMM_SKIP_WITHOUT_CUDA();
  at::manual_seed(12);
  const int64_t kv_heads = 4, n = 300;
  for (const int64_t frames : {1, 8, 33}) {
    const at::Tensor samples = at::rand({kv_heads, kStftHop * (frames + 1), n}, kF32).mul_(0.01);
    const at::Tensor ema = at::rand({kv_heads, n, kStftBins}, kF32).mul_(0.01);
    const at::Tensor gpu_ema = ema.to(kGpu);
    fold_frames(samples, ema);
    fold_frames(samples.to(kGpu), gpu_ema);
    EXPECT_TRUE(at::allclose(gpu_ema.cpu(), ema, 1e-5, 1e-9)) << frames << " frames: " << MaxDifference(gpu_ema, ema);
  }
}

// The query history's recomputed means on a cache that has evicted tokens, with and without a window.
TEST(ObserveOnCuda, QueryHistoryMeanMatchesTheCpu) {
  NAMM_SKIP_WITHOUT_CUDA();
  at::manual_seed(13);
  const int64_t kv_heads = 4, group = 4, heads = kv_heads * group, hd = 32, n = 200, rows = 24;
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    for (const int64_t window : {0, 90}) {
      const at::TensorOptions options = kF32.dtype(type);
      LayerKVCache cpu_cache(kv_heads, hd, options);
      LayerKVCache gpu_cache(kv_heads, hd, options.device(kGpu));
      const at::Tensor keys = at::randn({kv_heads, n, hd}, options), values = at::randn({kv_heads, n, hd}, options);
      const at::Tensor positions = at::arange(n, kF32.dtype(at::kLong));
      ASSERT_TRUE(cpu_cache.Append(keys, values, positions).ok());
      ASSERT_TRUE(gpu_cache.Append(keys.to(kGpu), values.to(kGpu), positions.to(kGpu)).ok());
      // Every head keeps its own 150 of the 200 tokens.
      const at::Tensor keep = std::get<0>(at::rand({kv_heads, n}, kF32).argsort(/*dim=*/1, /*descending=*/false).narrow(1, 0, 150).sort(1));
      ASSERT_TRUE(cpu_cache.Gather(keep).ok());
      ASSERT_TRUE(gpu_cache.Gather(keep.to(kGpu)).ok());
      // Queries n - rows .. n - 1 with log-sum-exps of their own (only their consistency across devices matters).
      const at::Tensor queries = at::randn({heads, rows, hd}, options);
      const at::Tensor lse = at::rand({heads, rows}, kF32).add_(3.0);
      QueryHistory cpu_history, gpu_history;
      ASSERT_TRUE(cpu_history.Record(queries, lse, n - rows, window, 31).ok());
      ASSERT_TRUE(gpu_history.Record(queries.to(kGpu), lse.to(kGpu), n - rows, window, 31).ok());
      for (const AttentionPrecision precision : {AttentionPrecision::kF32, AttentionPrecision::kBf16}) {
        const int64_t from = n - rows + 3, to = n - 2;
        const at::Tensor cpu = at::full({kv_heads, to - from, 150}, -1.0f, kF32);
        const at::Tensor gpu = at::full({kv_heads, to - from, 150}, -1.0f, kF32.device(kGpu));
        ASSERT_TRUE(cpu_history.GqaMeanAttention(cpu_cache, from, to, precision, cpu).ok());
        ASSERT_TRUE(gpu_history.GqaMeanAttention(gpu_cache, from, to, precision, gpu).ok());
        // The products come from different GEMMs (bf16: rounded to bf16 before the exponential).
        const double rtol = type == at::kFloat && precision == AttentionPrecision::kF32 ? 1e-4 : 2e-2;
        EXPECT_TRUE(at::allclose(gpu.cpu(), cpu, rtol, 1e-6))
            << c10::toString(type) << ", window " << window << ", bf16 precision "
            << (precision == AttentionPrecision::kBf16) << ": " << MaxDifference(gpu, cpu);
        EXPECT_TRUE(gpu.cpu().eq(0).equal(cpu.eq(0))) << "the same keys are hidden";
      }
    }
  }
}

}  // namespace
}  // namespace namm
