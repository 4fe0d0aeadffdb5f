// Hand-vectorized CPU kernels for the two parts of a NAMM update that tensor operations run poorly on a CPU:
// the BAM scorer's backward-masked attention (head size 32: BLAS packs more than it multiplies, and the n x n
// scores make several passes through memory) and the EMA fold of spectrogram frames (a 32 x 34 DFT per token
// and hop, then a magnitude and an EMA step, each a separate pass as tensor operations).
//
// The code is written once (kernels.inc, with GCC/Clang vector extensions) and compiled for three instruction
// sets; kernels() picks the widest the CPU runs. Each output row is computed by one thread in a fixed order,
// so results do not depend on the thread count. Torch-free: callers pass raw float32 pointers.
#pragma once

#include <cstdint>
#include <vector>

namespace namm::cpu {

// One head of softmax(q k^T + backward mask) v, the mask hiding key j from query i when j < i.
struct BackwardAttentionHead {
  const float* q;          // [n, d], already multiplied by the softmax scale
  const float* key_tiles;  // [n_padded / 16, d, 16]: tiles of 16 keys, each transposed; zero beyond n
  const float* v;          // [n, 16 * dv_tiles]
  float* out;              // [n, 16 * dv_tiles]
  int64_t n, n_padded, d, dv_tiles;  // n_padded: n rounded up to a multiple of 32; dv_tiles: 1 to 4
};

// Frames of query-major spectrogram samples folded into their EMA (spec §3.4): for each token t and frame f,
// X = the windowed DFT of the samples of queries 16 f .. 16 f + 31 at t, ema[t] <- a ema[t] + (1 - a) |X|
// (17 bins). The basis must be symmetric about sample 16 (cosines even, sines odd), as a periodic window's
// is.
struct FrameFold {
  const float* samples;  // query m's sample at token t: samples[m * time_stride + t]
  float* ema;            // token t's 17 bins start at ema + t * ema_stride
  int64_t frames, time_stride, ema_stride;
  const float* basis;    // [32, 34]: windowed cosines, then negated sines
  float a, one_minus_a;  // the EMA coefficient per hop and its complement
};

// Means over the G query heads of each KV group, query-major: out[h][r][t] = mean_g attention[h G + g][r][t],
// summed in order g = 0 .. G-1 and divided by G (multiplied by 1 / G when that is exact), as torch's mean
// does. With round_to_bf16 each input and the mean are rounded to bfloat16 first (the reference's bf16
// attention).
struct GqaMean {
  const float* attention;  // [q_heads][rows][n], t innermost
  int64_t head_stride, row_stride;
  float* out;  // [kv_heads][rows][n], t innermost
  int64_t out_head_stride, out_row_stride;
  int64_t group, rows, n;
  bool round_to_bf16;
};

// gqa_mean of attention probabilities computed again from scores (the query history's): p = exp(score - lse),
// 0 for keys after the query or `window` (> 0) or more positions behind it; summed and rounded as GqaMean.
struct ScoresGqaMean {
  const float* scores;  // [q_heads][rows][n], t innermost
  int64_t head_stride, row_stride;
  const float* lse;  // row r of query head j: lse[j * lse_head_stride + r]
  int64_t lse_head_stride;
  const int32_t* key_positions;  // [kv_heads][n]
  int64_t positions_stride;
  int64_t first_query, window;  // row r is query first_query + r
  float* out;                   // [kv_heads][rows][n], t innermost
  int64_t out_head_stride, out_row_stride;
  int64_t group, rows, n;
  bool round_to_bf16;
};

// Row-invariant products for the batched engine: each output element is computed by one code path whatever
// the number of rows, the tile it falls in or the thread that runs it, so a sequence's numbers do not depend on
// what it is batched with. y[i][j] = sum_k x[i][k] w[j][k] (+ b[j]): lane l accumulates k = l, l + L, ... with
// fused multiply-adds (plain ones where the instruction set has none), then the lanes are summed by halves (a fixed tree).
struct Linear {
  const float* x;  // [m][k], rows x_stride apart
  int64_t x_stride;
  const float* w;  // [n][k] (torch's [out, in]), rows w_stride apart
  int64_t w_stride;
  const float* bias;  // [n], or null
  float* y;           // [m][n], rows y_stride apart
  int64_t y_stride;
  int64_t m, n, k;
};

// y[i][j] = sum_k x[i][k] w[k][j] (+ b[j]) with w stored (in, out), as a NAMM's parameters are: each output
// sums its k products in order, one fused multiply-add each (a plain one where the instruction set has none),
// then adds its bias. Row-invariant as Linear, and quicker where k is small (a NAMM scorer's 25 or 32: no
// per-output lane sums). Rows of w and the bias are read in whole vectors: each must be readable up to n
// rounded up to a multiple of 16 (kLinearInOutPad), the padding zero.
constexpr int64_t kLinearInOutPad = 16;
struct LinearInOut {
  const float* x;  // [m][k], rows x_stride apart
  int64_t x_stride;
  const float* w;  // [k][n], rows w_stride apart, padded
  int64_t w_stride;
  const float* bias;  // [n], padded, or null
  float* y;           // [m][n], rows y_stride apart
  int64_t y_stride;
  int64_t m, n, k;
};

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i], element by element through one code path.
struct SiluMul {
  const float* gate;
  const float* up;
  float* out;
};

// out[i][c] = weight[c] * (x[i][c] / sqrt(mean_c x[i][c]^2 + eps)), the mean summed as Linear's products are.
struct RmsNormRows {
  const float* x;  // [m][dim], rows x_stride apart
  int64_t x_stride;
  const float* weight;  // [dim]
  float* out;           // [m][dim], rows out_stride apart
  int64_t out_stride;
  int64_t dim;
  float eps;
};

// One sequence of a BatchedAttention: t queries (the chunk) against n cached keys whose last t are the chunk's.
struct AttentionSequence {
  const float* q;  // query r, head j: q + r * q_row_stride + j * head_dim
  int64_t q_row_stride;
  // KV head h, key j: key_blocks[h * blocks_per_head + (j >> block_shift)] + (j & (2^block_shift - 1)) *
  // k_row_stride (head_dim floats); a rectangular cache is one block per head (block_shift past any n).
  const float* const* key_blocks;
  const float* const* value_blocks;  // as keys, rows v_row_stride apart
  int64_t blocks_per_head;
  int block_shift;
  int64_t k_row_stride, v_row_stride;
  const int64_t* key_positions;  // KV head h, key j: key_positions[h * positions_stride + j]; read if window > 0
  int64_t positions_stride;
  int64_t n, t;
  int64_t first_position;  // query r's position: first_position + r
  int64_t window;          // > 0: keys at positions <= the query's - window are hidden
  float* out;              // query r, head j: out + r * out_row_stride + j * head_dim
  int64_t out_row_stride;
  float* probabilities;  // or null; head j, query r, key k: [j * probs_head_stride + r * probs_row_stride + k]
  int64_t probs_head_stride, probs_row_stride;
  int64_t probs_width;  // keys written per row (>= n: those past the row's visible ones are zeros)
  float* log_sum_exp;  // or null; head j, query r: [j * lse_head_stride + r]
  int64_t lse_head_stride;
  // Or null: KV head h's keys before vacant[h] are hidden (a ragged cache, kv_cache.h), and its block table (or
  // rectangular start) begins at key vacant[h]: key j >= vacant[h] is row j - vacant[h] of the blocks above.
  const int64_t* vacant;
};

// Causal softmax(q k^T * scale) v of many sequences, row-invariant: each query's numbers come from one code path
// in a fixed order (the dot products in Linear's order over head_dim; the max and the sum of exponentials lane l
// taking keys j = l mod lanes in order; the values weighted in key order) whatever else is batched with it.
// Query r sees keys j <= n - t + r, less those the window hides. Work items are (sequence, KV head, block of
// block_rows queries), numbered sequence by sequence, KV head by KV head; attention_items() counts them.
struct BatchedAttention {
  const AttentionSequence* sequences;
  int64_t count;
  int64_t kv_heads, group, head_dim;  // query head j belongs to KV head j / group; head_dim <= 128
  float scale;
  int64_t block_rows;
};

inline int64_t attention_items(const BatchedAttention& a) {
  int64_t items = 0;
  for (int64_t s = 0; s < a.count; ++s) items += a.kv_heads * ((a.sequences[s].t + a.block_rows - 1) / a.block_rows);
  return items;
}

// Rotary position embedding of packed rows, in place: each of a row's `heads` vectors x of head_dim floats
// becomes x * cos + rotate_half(x) * sin, rotate_half([x1, x2]) = [-x2, x1], with the row's own cos and sin
// [head_dim]. Rounded as libtorch's element-wise operations round it (two products, then their sum, never fused),
// so a row is the same bits as apply_rope gives. One code path for every instruction set (rope_rows.cpp).
struct RopeRows {
  float* x;  // row r, head j: x + r * x_row_stride + j * head_dim
  int64_t x_row_stride;
  int64_t heads, head_dim;
  const float* cos;  // row r: cos + r * table_row_stride
  const float* sin;
  int64_t table_row_stride;
};
void rope_rows(const RopeRows& op, int64_t begin, int64_t end);

struct Kernels {
  const char* isa;     // "avx512", "avx2" or "baseline"
  int64_t query_rows;  // query rows per backward_attention_rows call
  // Rows [i0, i0 + query_rows) ∩ [0, n) of one head; scratch holds query_rows * n_padded floats.
  void (*backward_attention_rows)(const BackwardAttentionHead& head, int64_t i0, float* scratch);
  // Tokens [begin, end) of a fold.
  void (*fold_frames)(const FrameFold& fold, int64_t begin, int64_t end);
  // Output rows [begin, end) of a GQA mean, numbered h * rows + r.
  void (*gqa_mean)(const GqaMean& mean, int64_t begin, int64_t end);
  // Output rows [begin, end) of a ScoresGqaMean, numbered h * rows + r.
  void (*scores_gqa_mean)(const ScoresGqaMean& mean, int64_t begin, int64_t end);
  // Output columns [begin, end) of a Linear, every row.
  void (*linear_columns)(const Linear& linear, int64_t begin, int64_t end);
  // Elements [begin, end) of a SiluMul.
  void (*silu_mul)(const SiluMul& op, int64_t begin, int64_t end);
  // Rows [begin, end) of an RmsNormRows.
  void (*rms_norm_rows)(const RmsNormRows& op, int64_t begin, int64_t end);
  // Work items [begin, end) of a BatchedAttention.
  void (*attention_rows)(const BatchedAttention& attention, int64_t begin, int64_t end);
  // Rows [begin, end) of a LinearInOut.
  void (*linear_in_out_rows)(const LinearInOut& linear, int64_t begin, int64_t end);
};

// The kernels for the widest instruction set this CPU supports.
const Kernels& kernels();
// Every variant this CPU can run (tests compare them).
std::vector<const Kernels*> runnable_kernels();

}  // namespace namm::cpu
