// Attention-spectrogram token features (spec §3.1–3.4), computed as a stream.
//
// For every key token in a layer's cache, the signal is the attention it receives from successive queries
// (a column of the attention matrix), averaged over the query heads of its KV group. The signal is cut into
// frames of 32 samples with hop 16, aligned to absolute multiples of 16 queries from the start of the sequence;
// each frame is Hann-windowed (periodic), transformed (one-sided, unnormalized, no centering) and reduced to 17
// magnitudes; frames are folded into an exponential moving average with a = 0.99^16 per frame.
//
// The reference computes all 32 frames of an update at once from the buffered 512 x n attention matrix
// (prepending the previous update's last 16 samples, or zeros for a fresh sequence) and forms
//   E_new = sum_t (1 - a) a^(T-1-t) |X_t| + a^T E_old.
// That is the recurrence E <- a E + (1 - a) |X_t| applied frame by frame, so here each frame is folded in as
// soon as its 16th query has been seen. Only 32 samples and 17 EMA values per token are kept, instead of a
// 512 x n attention buffer per layer; at every 16-aligned point (in particular at every memory update) the state
// equals the reference's. A token that arrives mid-update starts from zeros, as in the reference, where the
// frames before its arrival contain only zeros (causal attention) and no renormalization happens.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "namm/feature_constants.h"

namespace namm {

// Mean over the G = q_heads / kv_heads query heads of each KV group; query head h belongs to KV head h / G (the
// Hugging Face repeat_kv layout). attention: [q_heads, n_q, n_keys] floating point -> [kv_heads, n_q, n_keys]
// float32. q_heads must be a multiple of kv_heads.
at::Tensor gqa_mean(const at::Tensor& attention, int64_t kv_heads, AttentionPrecision precision);

// |DFT| of periodic-Hann-windowed frames: samples [..., 32] float32 -> magnitudes [..., 17] float32.
at::Tensor stft_frame_magnitudes(const at::Tensor& samples);

// Per-token streaming state; both tensors are views into the layer's KV cache so that the state travels with
// its token when the cache is gathered.
struct SpectrogramState {
  // [kv_heads, n, 32] float32: the last two hops' samples as a ring. Query q (absolute index) writes column
  // 16 * ((q / 16) % 2) + q % 16, so hop h fills one half while the other half holds hop h - 1 (zeros for a
  // fresh sequence or a token that arrived later). Rotating instead of shifting saves two passes per hop.
  at::Tensor samples;
  // [kv_heads, n, 17] float32: the EMA of the token's frame magnitudes, before normalization.
  at::Tensor ema;
};

// Feeds the attention every cached key received from consecutive queries with absolute sequence indices
// first_query .. first_query + n_q - 1 (counted from the first token of the sequence).
// attention: [q_heads, n_q, n] probabilities over the n cached tokens (n = the state's n); they are reduced
// to the state's kv_heads with gqa_mean semantics (same grouping and rounding).
// Whenever the query with index = 15 (mod 16) has been consumed a frame completes and is folded into `ema` for
// every cached token. Updates `state` in place. On the CPU with float32 attention the reduction is fused into
// one pass that writes straight into the state, so no attention-sized temporary is allocated.
void consume_attention(const at::Tensor& attention, AttentionPrecision precision, int64_t first_query,
                       const SpectrogramState& state);

// gqa_mean of attention [q_heads, r, n], written into `out` [kv_heads, r, n] float32 (a view whose innermost
// stride is 1). On the CPU with float32 attention, one vectorized pass (cpu_kernels.h), bit for bit gqa_mean's;
// on a GPU where observe_kernels_run_on(), one CUDA kernel computing the same.
void gqa_mean_into(const at::Tensor& attention, AttentionPrecision precision, const at::Tensor& out);

// Folds H consecutive frames into `ema` [kv_heads, n, 17] float32. `samples` [kv_heads, 16 (H + 1), n] float32
// (innermost stride 1) holds, query by query, the GQA-reduced attention every cached token received from the
// first frame's start to the last frame's end, oldest first (zeros for queries before the sequence started or the
// token arrived): frame j is samples[:, 16 j .. 16 j + 31]. The same transform and EMA step as consume_attention's;
// on the CPU in float32 a vectorized kernel (cpu_kernels.h) that sums the DFT in another order (within rounding);
// on a GPU where observe_kernels_run_on(), one CUDA kernel (the same steps, within rounding).
void fold_frames(const at::Tensor& samples, const at::Tensor& ema);

// Whether gqa_mean_into, fold_frames and QueryHistory::GqaMeanAttention run our CUDA kernels on `device`: a
// build with NAMM_CUDA_KERNELS, on a CUDA device of an architecture it has code for. Elsewhere (and on the CPU)
// they run the CPU kernels or libtorch operators.
bool observe_kernels_run_on(at::Device device);

}  // namespace namm
