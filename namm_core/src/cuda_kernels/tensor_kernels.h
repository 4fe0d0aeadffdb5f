// The CUDA kernels of cuda_kernels.h on tensors: checks, the tensor's device and its current stream. Built
// only with NAMM_WITH_CUDA and a CUDA compiler (NAMM_CUDA_KERNELS); callers fall back to libtorch operators
// otherwise.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace namm::cuda {

// Whether the kernels run on `device`: a CUDA device whose architecture the build has code for (checked once
// per device; elsewhere callers use libtorch operators).
bool runs_on(const at::Device& device);

// Whether the kernels read `t`: a CUDA tensor of float32, bfloat16 or float16 with contiguous rows (stride 1
// in its last dimension), on a device they run on.
bool takes(const at::Tensor& t);

// out [kv_heads, rows, n] (float32, contiguous rows) = the GQA mean of attention [q_heads, rows, n].
void gqa_mean_into(const at::Tensor& attention, bool round_to_bf16, const at::Tensor& out);

// The same mean of exp(products * scale - lse) (see ScoresGqaMean), products [q_heads, rows, n] as bmm gives
// them, lse [q_heads, rows] float32, key_positions [kv_heads, n]; row r is query first_query + r.
void scores_gqa_mean_into(const at::Tensor& products, double scale, const at::Tensor& lse,
                          const at::Tensor& key_positions, int64_t first_query, int64_t window,
                          bool round_to_bf16, const at::Tensor& out);

// probs [heads, rows, n] float32 (contiguous) = softmax of scores [heads, rows, n] (keys contiguous) over the
// keys; with lse [heads, rows - lse_from] float32 defined, the log-sum-exp of rows lse_from .. rows - 1.
void softmax_rows_into(const at::Tensor& scores, int64_t lse_from, const at::Tensor& lse,
                       const at::Tensor& probs);

// Folds the frames of samples [kv_heads, 16 (frames + 1), n] into ema [kv_heads, n, 17] (both float32,
// contiguous rows), with `basis` [32, 34] float32 on the same device.
void fold_frames(const at::Tensor& samples, const at::Tensor& ema, const at::Tensor& basis, double a);

}  // namespace namm::cuda
