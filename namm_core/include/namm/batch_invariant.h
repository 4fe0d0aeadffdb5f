// The dense operations of a forward pass over several sequences at once, computed so that a sequence's numbers
// do not depend on what it is batched with (the batched engine's determinism rule, docs/performance.md).
//
// On the CPU in float32 they run our row-invariant kernels (each output element through one code path, in a
// fixed order, whatever the number of rows, the tile it falls in or the thread that computes it): a row's
// result is the same bits alone or among 15 others. libtorch's own products are not: OpenBLAS picks kernels and
// thread splits by the number of rows (measured: a row's product differs between 1, 2 and 129 rows). Elsewhere
// (a GPU, half precision) they run libtorch's operations, and a row's result agrees with its result alone up
// to rounding only.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace namm {

// True where the operations below are bit-for-bit row-invariant: float32 tensors on the CPU.
bool row_invariant(const at::Tensor& x);

// x [m, in] times w [out, in] transposed, plus b [out] when defined: [m, out].
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = at::Tensor());

// silu(gate) * up, element by element (the SwiGLU of a feed-forward block).
at::Tensor invariant_silu_mul(const at::Tensor& gate, const at::Tensor& up);

// Each row of x [m, dim] divided by its root mean square (computed in float32, as Hugging Face's LlamaRMSNorm
// does, whatever x's dtype) and scaled by weight [dim].
at::Tensor invariant_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// One sequence's causal attention over its cache (the engine's LlamaModel::Attention), for invariant_attention.
struct AttentionRequest {
  at::Tensor q;               // [t, heads * head_dim], after RoPE
  at::Tensor keys, values;    // [kv_heads, n, head_dim], n >= t, the chunk's own keys last (strides free)
  at::Tensor key_positions;   // [kv_heads, n] int64; read when window > 0
  int64_t first_position = 0;  // query r's position: first_position + r
  int64_t window = 0;          // > 0: keys at positions <= the query's - window are hidden
  at::Tensor out;              // [t, heads * head_dim] to write into (a view of a wider tensor), or undefined
  bool probabilities = false, log_sum_exp = false;  // compute these too
};
struct AttentionResult {
  at::Tensor out;            // [t, heads * head_dim]
  at::Tensor probabilities;  // [heads, t, n] float32, or undefined
  at::Tensor log_sum_exp;    // [heads, t] float32 (of the scaled, masked scores), or undefined
};

// softmax(q k^T * scale + causal and window masks) v for several sequences in one call of our CPU kernel, each
// query through one code path: the same bits whatever it runs beside. Float32 CPU tensors only (row_invariant).
std::vector<AttentionResult> invariant_attention(const std::vector<AttentionRequest>& sequences, int64_t heads,
                                                 double scale);

}  // namespace namm
