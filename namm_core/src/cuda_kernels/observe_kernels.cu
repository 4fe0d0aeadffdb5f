// CUDA kernels of the NAMM's observe path (cuda_kernels.h). One thread per output element (GQA means) or per
// cached token and head (the fold), consecutive threads on consecutive tokens so that every row is read and
// written coalesced; the softmax takes one block of threads per row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda_kernels/cuda_kernels.h"
#include "namm/feature_constants.h"

namespace namm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWindow = static_cast<int>(kStftWindow), kHop = static_cast<int>(kStftHop),
              kBins = static_cast<int>(kStftBins);

__device__ inline float RoundToBf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

template <typename T>
__device__ inline float ToFloat(T x);
template <>
__device__ inline float ToFloat<float>(float x) {
  return x;
}
template <>
__device__ inline float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ inline float ToFloat<__half>(__half x) {
  return __half2float(x);
}

// x rounded to T, as a T tensor's in-place arithmetic (computed in float) stores it.
template <typename T>
__device__ inline float RoundTo(float x);
template <>
__device__ inline float RoundTo<float>(float x) {
  return x;
}
template <>
__device__ inline float RoundTo<__nv_bfloat16>(float x) {
  return RoundToBf16(x);
}
template <>
__device__ inline float RoundTo<__half>(float x) {
  return __half2float(__float2half_rn(x));
}

// A grid-stride loop over indices 0 .. total-1.
template <typename Body>
__device__ inline void ForEachIndex(int64_t total, Body body) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    body(i);
  }
}

// Every element [h][r][t] of an output of kv_heads * rows * n.
template <typename Body>
__device__ inline void ForEachOutput(int64_t kv_heads, int64_t rows, int64_t n, Body body) {
  ForEachIndex(kv_heads * rows * n, [&](int64_t i) {
    const int64_t t = i % n, hr = i / n;
    body(hr / rows, hr % rows, t);
  });
}

// The mean over a group of values x(g), g = 0 .. group-1, summed and rounded as GqaMean says.
template <typename Value>
__device__ inline float GroupMean(int64_t group, bool round_to_bf16, Value x) {
  float total = 0.0f;
  for (int64_t g = 0; g < group; ++g) total += round_to_bf16 ? RoundToBf16(x(g)) : x(g);
  const float mean = total / static_cast<float>(group);
  return round_to_bf16 ? RoundToBf16(mean) : mean;
}

template <typename T>
__global__ void GqaMeanKernel(GqaMean m) {
  const T* attention = static_cast<const T*>(m.attention);
  ForEachOutput(m.kv_heads, m.rows, m.n, [&](int64_t h, int64_t r, int64_t t) {
    const float mean = GroupMean(m.group, m.round_to_bf16, [&](int64_t g) {
      return ToFloat(attention[(h * m.group + g) * m.head_stride + r * m.row_stride + t]);
    });
    m.out[h * m.out_head_stride + r * m.out_row_stride + t] = mean;
  });
}

template <typename T>
__global__ void ScoresGqaMeanKernel(ScoresGqaMean m) {
  const T* products = static_cast<const T*>(m.products);
  ForEachOutput(m.kv_heads, m.rows, m.n, [&](int64_t h, int64_t r, int64_t t) {
    const int64_t query = m.first_query + r, key = m.key_positions[h * m.positions_stride + t];
    const bool hidden = key > query || (m.window > 0 && key <= query - m.window);
    const float mean = GroupMean(m.group, m.round_to_bf16, [&](int64_t g) {
      if (hidden) return 0.0f;
      const int64_t head = h * m.group + g;
      // __fmul_rn: rounded before the subtraction, as torch's in-place multiplication stores it (no fused
      // multiply-add).
      const float score =
          RoundTo<T>(__fmul_rn(ToFloat(products[head * m.head_stride + r * m.row_stride + t]), m.scale));
      return expf(score - m.lse[head * m.lse_head_stride + r]);
    });
    m.out[h * m.out_head_stride + r * m.out_row_stride + t] = mean;
  });
}

__global__ void FoldFramesKernel(FrameFold f) {
  __shared__ float basis[kWindow * 2 * kBins];
  for (int i = threadIdx.x; i < kWindow * 2 * kBins; i += blockDim.x) basis[i] = f.basis[i];
  __syncthreads();
  ForEachIndex(f.kv_heads * f.n, [&](int64_t i) {
    const int64_t h = i / f.n, t = i % f.n;
    const float* samples = f.samples + h * f.head_stride + t;
    float* ema = f.ema + h * f.ema_head_stride + t * f.ema_stride;
    float state[kBins];
#pragma unroll
    for (int k = 0; k < kBins; ++k) state[k] = ema[k];
    for (int64_t frame = 0; frame < f.frames; ++frame) {
      float x[kWindow];
#pragma unroll
      for (int m = 0; m < kWindow; ++m) x[m] = samples[(frame * kHop + m) * f.time_stride];
#pragma unroll 1  // the bins one at a time: unrolled with the samples they take 255 registers and spill
      for (int k = 0; k < kBins; ++k) {
        float re = 0.0f, im = 0.0f;
#pragma unroll
        for (int m = 0; m < kWindow; ++m) {
          re += x[m] * basis[m * 2 * kBins + k];
          im += x[m] * basis[m * 2 * kBins + kBins + k];
        }
        state[k] = f.a * state[k] + f.one_minus_a * sqrtf(re * re + im * im);
      }
    }
#pragma unroll
    for (int k = 0; k < kBins; ++k) ema[k] = state[k];
  });
}

// The block's reduction of `value` (every thread's) with `op`; every thread gets the result.
template <typename Op>
__device__ float BlockReduce(float value, Op op, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2)
    value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // `shared` may still be read from the previous reduction
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = shared[0];
  for (int w = 1; w < warps; ++w) value = op(value, shared[w]);
  return value;
}

// One block per row: its maximum, the sum of exp(x - max), then the probabilities.
template <typename T>
__global__ void SoftmaxRowsKernel(SoftmaxRows s) {
  __shared__ float partial[32];
  const int64_t head = blockIdx.x / s.rows, row = blockIdx.x % s.rows;
  const T* x = static_cast<const T*>(s.scores) + head * s.head_stride + row * s.row_stride;
  float* p = s.probs + static_cast<int64_t>(blockIdx.x) * s.n;
  float max = -INFINITY;
  for (int64_t j = threadIdx.x; j < s.n; j += blockDim.x) max = fmaxf(max, ToFloat(x[j]));
  max = BlockReduce(
      max, [](float a, float b) { return fmaxf(a, b); }, partial);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < s.n; j += blockDim.x) sum += expf(ToFloat(x[j]) - max);
  sum = BlockReduce(
      sum, [](float a, float b) { return a + b; }, partial);
  for (int64_t j = threadIdx.x; j < s.n; j += blockDim.x) p[j] = expf(ToFloat(x[j]) - max) / sum;
  if (s.lse != nullptr && row >= s.lse_from && threadIdx.x == 0) {
    s.lse[head * s.lse_head_stride + (row - s.lse_from)] = max + logf(sum);
  }
}

// The variant of a kernel template for an input type, from its {float32, bfloat16, float16} instances.
template <typename Args>
void (*ForType(InputType type, void (*const (&kernels)[3])(Args)))(Args) {
  return kernels[type == InputType::kFloat32 ? 0 : type == InputType::kBFloat16 ? 1 : 2];
}

// Enqueues `kernel` over `blocks` blocks; nothing for none.
template <typename Args>
cudaError_t Launch(void (*kernel)(Args), const Args& args, int64_t blocks, cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

// Blocks for a grid-stride kernel over `total` elements (none for none).
int64_t GridStrideBlocks(int64_t total) {
  return std::min<int64_t>((total + kThreads - 1) / kThreads, 65535);  // the rest by grid stride
}

}  // namespace

cudaError_t launch_gqa_mean(const GqaMean& mean, cudaStream_t stream) {
  static void (*const kernels[3])(GqaMean) = {GqaMeanKernel<float>, GqaMeanKernel<__nv_bfloat16>,
                                              GqaMeanKernel<__half>};
  return Launch(ForType(mean.type, kernels), mean, GridStrideBlocks(mean.kv_heads * mean.rows * mean.n),
                stream);
}

cudaError_t launch_scores_gqa_mean(const ScoresGqaMean& mean, cudaStream_t stream) {
  static void (*const kernels[3])(ScoresGqaMean) = {
      ScoresGqaMeanKernel<float>, ScoresGqaMeanKernel<__nv_bfloat16>, ScoresGqaMeanKernel<__half>};
  return Launch(ForType(mean.type, kernels), mean, GridStrideBlocks(mean.kv_heads * mean.rows * mean.n),
                stream);
}

cudaError_t kernels_run_on_current_device() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, FoldFramesKernel);
}

cudaError_t launch_softmax_rows(const SoftmaxRows& softmax, cudaStream_t stream) {
  static void (*const kernels[3])(SoftmaxRows) = {SoftmaxRowsKernel<float>, SoftmaxRowsKernel<__nv_bfloat16>,
                                                  SoftmaxRowsKernel<__half>};
  // One block per row (a chunk's rows times the heads: thousands; the grid's x limit is 2^31 - 1).
  return Launch(ForType(softmax.type, kernels), softmax, softmax.n == 0 ? 0 : softmax.heads * softmax.rows,
                stream);
}

cudaError_t launch_fold_frames(const FrameFold& fold, cudaStream_t stream) {
  return Launch(FoldFramesKernel, fold, fold.frames == 0 ? 0 : GridStrideBlocks(fold.kv_heads * fold.n),
                stream);
}

}  // namespace namm::cuda
