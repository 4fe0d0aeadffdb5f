// The NAMM's observe path as CUDA kernels: the attention probabilities with the log-sum-exp the query history
// records, the GQA mean of a block's attention rows, the same mean recomputed from the query history's
// scores, and the fold of complete frames into the spectrogram EMA. Each replaces a chain of libtorch
// operators (5 to 12 launches each, ~0.5 ms per chunk and layer whatever the cache size: a GPU generation at
// 4k tokens is launch-bound) with one launch, computing what the CPU kernels (cpu_kernels/cpu_kernels.h)
// compute. Torch-free: plain pointers and strides, so that this header and observe_kernels.cu build with nvcc
// alone; cuda_kernels/tensor_kernels.h is the tensor-level entry.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace namm::cuda {

enum class InputType { kFloat32, kBFloat16, kFloat16 };

// out[h][r][t] = mean_g x[h G + g][r][t] in float32, summed in order g = 0 .. G-1 and divided by G; with
// round_to_bf16 each input and the mean are rounded to bfloat16 (the reference's bf16 attention).
struct GqaMean {
  const void* attention;  // [q_heads][rows][n], t innermost, of `type`
  InputType type;
  int64_t head_stride, row_stride;
  float* out;  // [kv_heads][rows][n], t innermost
  int64_t out_head_stride, out_row_stride;
  int64_t kv_heads, group, rows, n;
  bool round_to_bf16;
};

// GqaMean of probabilities recomputed from the query history: x = exp(s - lse) where s is the product q.k
// (of `type`) times `scale`, rounded to `type` as torch's in-place multiplication rounds it; 0 for keys after
// the query or `window` (> 0) or more positions behind it.
struct ScoresGqaMean {
  const void* products;  // [q_heads][rows][n], t innermost, of `type`
  InputType type;
  float scale;
  int64_t head_stride, row_stride;
  const float* lse;  // row r of query head j: lse[j * lse_head_stride + r]
  int64_t lse_head_stride;
  const int64_t* key_positions;  // [kv_heads][n]
  int64_t positions_stride;
  int64_t first_query, window;  // row r is query first_query + r
  float* out;                   // [kv_heads][rows][n], t innermost
  int64_t out_head_stride, out_row_stride;
  int64_t kv_heads, group, rows, n;
  bool round_to_bf16;
};

// For every token t of every head and each frame f = 0 .. frames-1 in turn (the samples of queries 16 f ..
// 16 f + 31): ema[t] <- a ema[t] + (1 - a) |DFT of the frame|, 17 bins, the Hann window in the basis.
struct FrameFold {
  const float*
      samples;  // query m's sample at token t of head h: samples[h * head_stride + m * time_stride + t]
  int64_t head_stride, time_stride;
  float* ema;  // token t's 17 bins of head h start at ema + h * ema_head_stride + t * ema_stride
  int64_t ema_head_stride, ema_stride;
  int64_t kv_heads, n, frames;
  const float* basis;  // on the device, [32, 34]: windowed cosines, then negated sines
  float a, one_minus_a;
};

// The attention probabilities the engine hands to policies, with the log-sum-exp the query history records:
// for every row i of scores (heads * rows of them, n keys each, -inf where hidden), probs[i] = softmax in
// float32 (exp(x - max) / sum, as torch's softmax) and, for rows r >= lse_from of each head, lse = max +
// log(sum).
struct SoftmaxRows {
  const void* scores;  // row r of head h starts at scores + h * head_stride + r * row_stride, keys contiguous
  InputType type;
  int64_t head_stride, row_stride;
  float* probs;  // [heads][rows][n], contiguous
  float* lse;    // row r (>= lse_from) of head h: lse[h * lse_head_stride + (r - lse_from)]; null for none
  int64_t lse_head_stride, lse_from;
  int64_t heads, rows, n;
};

// cudaSuccess when the current device can run these kernels (the build has code for its architecture).
cudaError_t kernels_run_on_current_device();

// Each enqueues one kernel on `stream` and returns the launch's error (cudaSuccess when enqueued).
cudaError_t launch_gqa_mean(const GqaMean& mean, cudaStream_t stream);
cudaError_t launch_scores_gqa_mean(const ScoresGqaMean& mean, cudaStream_t stream);
cudaError_t launch_fold_frames(const FrameFold& fold, cudaStream_t stream);
cudaError_t launch_softmax_rows(const SoftmaxRows& softmax, cudaStream_t stream);

}  // namespace namm::cuda
