// Rotary position embeddings in the rotate-half convention of Hugging Face Llama (spec §1.2).
// Keys are stored in the KV cache after rotation, so an evicted neighbour never changes a survivor's phase.
#pragma once

#include <ATen/core/Tensor.h>

#include "namm/worker/llama_config.h"

namespace namm::worker {

// inv_freq[i] = 1 / base^(2i / head_dim), i < head_dim / 2, in float32 exactly as Hugging Face computes it
// (exponents from an int64 arange cast to float32), with the config's scaling applied:
//   NTK:    base = rope_theta * (alpha * factor - (alpha - 1))^(d / (d - 2))   (static: any sequence length)
//   linear: inv_freq / factor
//   llama3: low frequencies / factor, high ones unchanged, a smooth blend in between.
at::Tensor rope_inverse_frequencies(const LlamaConfig& config);

// cos and sin of positions x inv_freq, repeated for both halves: [t, head_dim] float32 each.
struct RopeTables {
  at::Tensor cos;
  at::Tensor sin;
};
RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions);

// x * cos + rotate_half(x) * sin, with rotate_half([x1, x2]) = [-x2, x1]; x: [heads, t, head_dim].
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& tables);

}  // namespace namm::worker
