// The CPU kernels (cpu_kernels.h) applied to tensors: layout, padding and threads. Callers check the contract
// (CPU, float32); tests run every variant the CPU supports.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "cpu_kernels/cpu_kernels.h"
#include "namm/batch_invariant.h"

namespace namm::cpu {

// namm::backward_masked_attention (bam_scorer.h) for float32 CPU tensors with v's last size at most 64.
at::Tensor backward_masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     double scale, const Kernels& kernels);

// namm::gqa_mean_into (stft_features.h) for float32 CPU attention and output with innermost stride 1.
void gqa_mean_into(const at::Tensor& attention, bool round_to_bf16, const at::Tensor& out,
                   const Kernels& kernels);

// out [kv_heads, rows, n] = gqa_mean of exp(scores - lse) with keys after the query or `window` (> 0) or more
// positions behind it at 0 (QueryHistory::GqaMeanAttention): scores [q_heads, rows, n] and lse [q_heads,
// rows] float32, key_positions [kv_heads, n] int32, row r is query first_query + r; all innermost strides 1.
void scores_gqa_mean_into(const at::Tensor& scores, const at::Tensor& lse, const at::Tensor& key_positions,
                          int64_t first_query, int64_t window, bool round_to_bf16, const at::Tensor& out,
                          const Kernels& kernels);

// namm::fold_frames (stft_features.h) for float32 CPU samples and EMA with innermost stride 1; basis: the
// windowed DFT basis, [32, 34] contiguous float32; a: the EMA coefficient per hop.
void fold_frames(const at::Tensor& samples, const at::Tensor& ema, const at::Tensor& basis, double a,
                 const Kernels& kernels);

// The row-invariant products (cpu_kernels.h: Linear, SiluMul, RmsNormRows) for float32 CPU tensors whose
// innermost stride is 1: a row's result is the same whatever else is in x, so a batch of sequences computes
// each one's numbers exactly as it alone would.
// Each writes into `out` when it is defined (of the result's shape, float32, rows contiguous), else into a new
// tensor, and returns it.
// x [m, k] times w [n, k] transposed, plus b [n] when defined: [m, n].
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const Kernels& kernels,
                  const at::Tensor& out = at::Tensor());
// silu(gate) * up, both contiguous of one shape (out may be gate or up).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up, const Kernels& kernels,
                    const at::Tensor& out = at::Tensor());
// x [m, dim] normalized by its root mean square and scaled by weight [dim].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const Kernels& kernels,
                    const at::Tensor& out = at::Tensor());

// A weight as LinearInOut reads it (cpu_kernels.h): [in][out rounded up to kLinearInOutPad], zeros beyond out,
// and its bias likewise (empty without one).
struct InOutWeight {
  int64_t in = 0, out = 0, stride = 0;
  std::vector<float> weight, bias;
};
// From w [in, out] (a NAMM's layout) or, with out_in, w [out, in] (torch's), float32 host tensors.
InOutWeight make_in_out_weight(const at::Tensor& w, const at::Tensor& b, bool out_in);
// y [m][out] = x [m][in] W (+ b), rows in parallel where the work is worth waking the pool for.
void linear_in_out(const float* x, int64_t x_stride, int64_t m, const InOutWeight& w, float* y, int64_t y_stride,
                   const Kernels& kernels);

using AttentionInput = namm::AttentionRequest;  // batch_invariant.h
using AttentionOutput = namm::AttentionResult;

// Causal attention of several sequences in one call (cpu_kernels.h: BatchedAttention) for float32 CPU tensors
// whose innermost stride is 1: each query's numbers are the same bits whatever sequences, queries or threads
// share the call. head_dim = q.size(1) / heads. block_rows: rows per work item (tests vary it; 0: chosen
// by the lengths).
std::vector<AttentionOutput> batched_attention(const std::vector<AttentionInput>& sequences, int64_t heads,
                                               double scale, const Kernels& kernels, int64_t block_rows = 0);

}  // namespace namm::cpu
