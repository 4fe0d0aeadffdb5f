// Rotary position embeddings in the rotate-half convention of Hugging Face Llama (spec §1.2).
// Keys are stored in the KV cache after rotation, so an evicted neighbour never changes a survivor's phase.
#pragma once

#include <ATen/core/Tensor.h>

#include "namm/worker/llama_config.h"

namespace namm::worker {

// inv_freq[i] = 1 / base^(2i / head_dim), i < head_dim / 2, in float32 exactly as Hugging Face computes it
// (exponents from an int64 arange cast to float32), on `device`, with the config's scaling applied:
//   NTK:     base = rope_theta * (alpha * factor - (alpha - 1))^(d / (d - 2))   (static: any sequence length)
//   dynamic: base = rope_theta * (factor * L / L_train - (factor - 1))^(d / (d - 2)) once the sequence length L
//            (`sequence_length`) passes the trained L_train, plain RoPE before
//   linear:  inv_freq / factor
//   llama3:  low frequencies / factor, high ones unchanged, a smooth blend in between
//   yarn:    inv_freq / factor for dimensions that turn fewer than beta_slow times over the trained length,
//            unchanged for those turning more than beta_fast times, a linear ramp over the dimensions between.
at::Tensor rope_inverse_frequencies(const LlamaConfig& config, at::Device device, int64_t sequence_length = 0);

// True when the frequencies depend on the sequence length (dynamic NTK): they are recomputed per forward call
// from the last position it runs, as transformers does. Keys already cached keep the rotation they were
// given, so a prompt prefilled in chunks differs from one run in a single call (transformers runs it whole).
bool rope_depends_on_length(const LlamaConfig& config);

// scale * cos and scale * sin of positions x inv_freq, repeated for both halves: [t, head_dim] float32 each.
// `scale` is YaRN's attention factor (RopeScaling::yarn_attention_factor), 1 otherwise.
struct RopeTables {
  at::Tensor cos;
  at::Tensor sin;
};
RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, double scale = 1.0);

// x * cos + rotate_half(x) * sin, with rotate_half([x1, x2]) = [-x2, x1]; x: [heads, t, head_dim].
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& tables);

}  // namespace namm::worker
