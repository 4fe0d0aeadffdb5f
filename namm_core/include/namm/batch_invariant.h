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

#include <cstdint>
#include <memory>
#include <vector>

#include "namm/kv_block_pool.h"

namespace namm {

namespace cpu {
struct InOutWeight;  // cpu_kernels/tensor_kernels.h
}  // namespace cpu

// True where the operations below are bit-for-bit row-invariant: float32 tensors on the CPU.
bool row_invariant(const at::Tensor& x);

// x [m, in] times w [out, in] transposed, plus b [out] when defined: [m, out]; on the row-invariant kernels into
// `out` when that is defined (as InvariantLinear below).
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = at::Tensor(),
                            const at::Tensor& out = at::Tensor());

// A linear layer prepared once for the row-invariant product, for the products a model runs at every step. With
// few input features (in <= kInOutMaxFeatures: the small models' widths, stories260K's 64 and 172) and float32
// host weights it also holds w transposed and padded, and each output sums its products in order, one fused
// multiply-add each (cpu_kernels.h: LinearInOut): the per-output lane sums that invariant_linear's kernel needs
// cost as much as the products at such widths. Either way a row's numbers do not depend on the other rows (the
// two orders give different bits, but a layer always takes the same one). Elsewhere it is invariant_linear.
class InvariantLinear {
 public:
  static constexpr int64_t kInOutMaxFeatures = 256;
  InvariantLinear() = default;
  InvariantLinear(at::Tensor w, at::Tensor b);  // w [out, in], b [out] or undefined
  // x [m, in] -> [m, out]. Where the row-invariant kernels take it, written into `out` when that is defined
  // ([m, out] float32 host rows, innermost stride 1: a buffer reused across steps), else a new tensor.
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& out = at::Tensor()) const;

 private:
  at::Tensor w_, b_;
  std::shared_ptr<const cpu::InOutWeight> in_out_;  // null unless prepared for the output-major kernel
};

// silu(gate) * up, element by element (the SwiGLU of a feed-forward block); into `out` as InvariantLinear does
// (out may be gate or up).
at::Tensor invariant_silu_mul(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out = at::Tensor());

// Each row of x [m, dim] divided by its root mean square (computed in float32, as Hugging Face's LlamaRMSNorm
// does, whatever x's dtype) and scaled by weight [dim]; into `out` as InvariantLinear does.
at::Tensor invariant_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                              const at::Tensor& out = at::Tensor());

// Rotary embedding in place (float32 CPU, row_invariant): rows [first, first + cos.size(0)) of x [rows, heads *
// head_dim] (rows contiguous), row first + i rotated by cos and sin row i ([count, head_dim] float32, contiguous):
// x * cos + rotate_half(x) * sin, the same bits as the tensor operations of worker/engine rope.h's apply_rope.
void invariant_rope_(const at::Tensor& x, int64_t heads, int64_t first, const at::Tensor& cos, const at::Tensor& sin);

// One sequence's causal attention over its cache (the engine's LlamaModel::Attention), for invariant_attention.
struct AttentionRequest {
  at::Tensor q;               // [t, heads * head_dim], after RoPE
  at::Tensor keys, values;    // [kv_heads, n, head_dim], n >= t, the chunk's own keys last (strides free)
  KvBlockView blocks;         // or, where blocks.keys is set, the keys and values in a pool's blocks (n: tokens)
  at::Tensor key_positions;   // [kv_heads, n] int64; read when window > 0
  int64_t first_position = 0;  // query r's position: first_position + r
  int64_t window = 0;          // > 0: keys at positions <= the query's - window are hidden
  at::Tensor out;              // [t, heads * head_dim] to write into (a view of a wider tensor), or undefined
  bool probabilities = false, log_sum_exp = false;  // compute these too
  // Where to write the probabilities, if set: [heads, t, width >= n] float32 (strides free but the last), keys n
  // to width of every row written as zeros. A chunk's rows attended a block at a time (the keys truncated to what
  // the block's last row sees) thus fill rows of the chunk's [heads, rows, n] as one call would.
  at::Tensor probabilities_out;
  // Or null: per KV head, the leading keys it does not hold (LayerKVCache::vacant()), hidden; a block table then
  // starts at each head's first held key.
  const int64_t* vacant = nullptr;
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
