#include "cpu_kernels/tensor_kernels.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "aten.h"
#include "cpu_kernels/task_pool.h"

namespace namm::cpu {

namespace {
// `out` where the caller gave one (checked against the result's shape), else a new tensor like `like`.
at::Tensor OutputOrNew(const at::Tensor& out, at::IntArrayRef sizes, const at::Tensor& like) {
  if (!out.defined()) return at::empty(sizes, like.options());
  TORCH_CHECK(out.sizes() == sizes && out.scalar_type() == at::kFloat && out.device().is_cpu() &&
                  out.stride(-1) == 1,
              "an output of ", sizes, " float32 host rows was expected, got ", out.sizes());
  return out;
}
}  // namespace

// The kernel's layout: queries scaled, keys transposed and padded to whole vectors, values padded to whole
// vectors.
at::Tensor backward_masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     double scale, const Kernels& kernels) {
  const int64_t heads = q.size(0), n = q.size(1), d = q.size(2), dv = v.size(2);
  const int64_t n_padded = (n + 31) / 32 * 32, vectors = (dv + 15) / 16;
  const at::Tensor qs = q.mul(scale).contiguous();
  const at::Tensor padded_keys = at::zeros({heads, n_padded, d}, k.options());
  padded_keys.narrow(1, 0, n).copy_(k);
  const at::Tensor key_tiles = padded_keys.view({heads, n_padded / 16, 16, d}).transpose(2, 3).contiguous();
  at::Tensor vp = v.contiguous();
  if (dv != 16 * vectors) {
    vp = at::zeros({heads, n, 16 * vectors}, v.options());
    vp.narrow(2, 0, dv).copy_(v);
  }
  const at::Tensor out = at::empty({heads, n, 16 * vectors}, v.options());
  const int64_t rows = kernels.query_rows, blocks = (n + rows - 1) / rows;
  // A block's cost falls with its first row (it sees keys from there on): taking blocks alternately from both
  // ends gives every thread's contiguous share of the tasks about the same cost.
  parallel_work(heads * blocks, heads * n * n * (d + 16 * vectors) / 2, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<std::size_t>(rows * n_padded));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % heads, i = task / heads;
      const int64_t block = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
      const BackwardAttentionHead head{qs.data_ptr<float>() + h * n * d,
                                       key_tiles.data_ptr<float>() + h * d * n_padded,
                                       vp.data_ptr<float>() + h * n * 16 * vectors,
                                       out.data_ptr<float>() + h * n * 16 * vectors,
                                       n,
                                       n_padded,
                                       d,
                                       vectors};
      kernels.backward_attention_rows(head, block * rows, scratch.data());
    }
  });
  return dv == 16 * vectors ? out : out.narrow(2, 0, dv);
}

void gqa_mean_into(const at::Tensor& attention, bool round_to_bf16, const at::Tensor& out,
                   const Kernels& kernels) {
  const int64_t kv_heads = out.size(0), rows = out.size(1), n = out.size(2);
  const GqaMean mean{attention.data_ptr<float>(),
                     attention.stride(0),
                     attention.stride(1),
                     out.data_ptr<float>(),
                     out.stride(0),
                     out.stride(1),
                     attention.size(0) / kv_heads,
                     rows,
                     n,
                     round_to_bf16};
  parallel_work(kv_heads * rows, attention.size(0) * rows * n,
                [&](int64_t begin, int64_t end) { kernels.gqa_mean(mean, begin, end); });
}

void scores_gqa_mean_into(const at::Tensor& scores, const at::Tensor& lse, const at::Tensor& key_positions,
                          int64_t first_query, int64_t window, bool round_to_bf16, const at::Tensor& out,
                          const Kernels& kernels) {
  const int64_t kv_heads = out.size(0), rows = out.size(1), n = out.size(2);
  const ScoresGqaMean mean{scores.data_ptr<float>(),
                           scores.stride(0),
                           scores.stride(1),
                           lse.data_ptr<float>(),
                           lse.stride(0),
                           key_positions.data_ptr<int32_t>(),
                           key_positions.stride(0),
                           first_query,
                           window,
                           out.data_ptr<float>(),
                           out.stride(0),
                           out.stride(1),
                           scores.size(0) / kv_heads,
                           rows,
                           n,
                           round_to_bf16};
  // An exponential costs about ten multiply-adds.
  parallel_work(kv_heads * rows, 10 * scores.size(0) * rows * n,
      [&](int64_t begin, int64_t end) { kernels.scores_gqa_mean(mean, begin, end); });
}

void fold_frames(const at::Tensor& samples, const at::Tensor& ema, const at::Tensor& basis, double a,
                 const Kernels& kernels) {
  // Tasks of 256 tokens (the kernel's sweep).
  const int64_t kv_heads = ema.size(0), n = ema.size(1), groups = (n + 255) / 256;
  const int64_t frames = samples.size(1) / 16 - 1;
  // A token's frame: a 32 x 34 product, halved by the basis' symmetry.
  parallel_work(kv_heads * groups, kv_heads * n * frames * 32 * 17, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end;) {
      // The tasks of one head at a time: tokens [256 g, 256 g_end) of head h.
      const int64_t h = task / groups, g = task % groups, g_end = std::min(groups, g + (end - task));
      const FrameFold fold{samples.data_ptr<float>() + h * samples.stride(0),
                           ema.data_ptr<float>() + h * ema.stride(0),
                           frames,
                           samples.stride(1),
                           ema.stride(1),
                           basis.data_ptr<float>(),
                           static_cast<float>(a),
                           static_cast<float>(1.0 - a)};
      kernels.fold_frames(fold, 256 * g, std::min(n, 256 * g_end));
      task += g_end - g;
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const Kernels& kernels,
                  const at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const at::Tensor y = OutputOrNew(out, {m, n}, x);
  const Linear product{x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.stride(0),
                       b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), y.stride(0), m, n, k};
  // Tasks are pairs of columns (the kernel's tile), so that a share's edge never splits one.
  parallel_work((n + 1) / 2, m * n * k, [&](int64_t begin, int64_t end) {
    kernels.linear_columns(product, 2 * begin, std::min(n, 2 * end));
  });
  return y;
}

InOutWeight make_in_out_weight(const at::Tensor& w, const at::Tensor& b, bool out_in) {
  const at::Tensor in_out = (out_in ? w.t() : w).contiguous();
  InOutWeight padded;
  padded.in = in_out.size(0);
  padded.out = in_out.size(1);
  padded.stride = (padded.out + kLinearInOutPad - 1) / kLinearInOutPad * kLinearInOutPad;
  padded.weight.assign(static_cast<std::size_t>(padded.in * padded.stride), 0.0f);
  const float* from = in_out.data_ptr<float>();
  for (int64_t i = 0; i < padded.in; ++i) {
    std::copy(from + i * padded.out, from + (i + 1) * padded.out, padded.weight.begin() + i * padded.stride);
  }
  if (b.defined()) {
    padded.bias.assign(static_cast<std::size_t>(padded.stride), 0.0f);
    const at::Tensor bias = b.contiguous();
    std::copy(bias.data_ptr<float>(), bias.data_ptr<float>() + padded.out, padded.bias.begin());
  }
  return padded;
}

void linear_in_out(const float* x, int64_t x_stride, int64_t m, const InOutWeight& w, float* y, int64_t y_stride,
                   const Kernels& kernels) {
  const LinearInOut op{x, x_stride, w.weight.data(), w.stride, w.bias.empty() ? nullptr : w.bias.data(),
                       y, y_stride, m, w.out, w.in};
  // Tasks of 4 rows (the kernel's tile), so that a share's edge never splits one.
  parallel_work((m + 3) / 4, m * w.out * w.in,
      [&](int64_t begin, int64_t end) { kernels.linear_in_out_rows(op, 4 * begin, std::min(m, 4 * end)); });
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up, const Kernels& kernels, const at::Tensor& into) {
  const at::Tensor out = OutputOrNew(into, gate.sizes(), gate);
  TORCH_CHECK(out.is_contiguous(), "silu_mul: the output must be contiguous");
  const SiluMul op{gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>()};
  // Every lane runs the same operations, so where a share starts changes nothing; 64-element tasks.
  const int64_t count = gate.numel(), blocks = (count + 63) / 64;
  parallel_work(blocks, 16 * count, [&](int64_t begin, int64_t end) {
    kernels.silu_mul(op, 64 * begin, std::min(count, 64 * end));
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const Kernels& kernels,
                    const at::Tensor& into) {
  const int64_t m = x.size(0), dim = x.size(1);
  const at::Tensor out = OutputOrNew(into, {m, dim}, x);
  const RmsNormRows op{x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(),
                       out.stride(0), dim, static_cast<float>(eps)};
  parallel_work(m, 4 * m * dim, [&](int64_t begin, int64_t end) { kernels.rms_norm_rows(op, begin, end); });
  return out;
}

std::vector<AttentionOutput> batched_attention(const std::vector<AttentionInput>& sequences, int64_t heads,
                                               double scale, const Kernels& kernels, int64_t block_rows) {
  std::vector<AttentionOutput> outputs(sequences.size());
  if (sequences.empty()) return outputs;
  const auto in_blocks = [](const AttentionInput& in) { return in.blocks.keys != nullptr; };
  const AttentionInput& front = sequences.front();
  const int64_t kv_heads = in_blocks(front) ? front.blocks.kv_heads : front.keys.size(0);
  const int64_t head_dim = in_blocks(front) ? front.blocks.head_dim : front.keys.size(2);
  std::vector<AttentionSequence> items(sequences.size());
  // A rectangular cache is read as one block per head, its start in these tables; no n reaches 2^40.
  constexpr int kOneBlock = 40;
  std::vector<std::vector<const float*>> head_keys(sequences.size()), head_values(sequences.size());
  int64_t longest = 1, work = 0;
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    const AttentionInput& in = sequences[i];
    const int64_t t = in.q.size(0), n = in_blocks(in) ? in.blocks.tokens : in.keys.size(1);
    TORCH_CHECK(in.q.dim() == 2 && in.q.size(1) == heads * head_dim && in.q.stride(1) == 1, "q: [t, heads * head_dim]");
    const int64_t fewest_vacant = in.vacant != nullptr ? *std::min_element(in.vacant, in.vacant + kv_heads) : 0;
    if (in_blocks(in)) {
      TORCH_CHECK(in.blocks.kv_heads == kv_heads && in.blocks.head_dim == head_dim && n >= t &&
                      in.blocks.block_shift < kOneBlock &&
                      in.blocks.blocks_per_head << in.blocks.block_shift >= n - fewest_vacant,
                  "blocks: [kv_heads, n >= t, head_dim] in blocks covering n");
    } else {
      TORCH_CHECK(in.keys.dim() == 3 && in.keys.size(0) == kv_heads && in.keys.size(2) == head_dim &&
                      in.keys.stride(2) == 1 && n >= t && n < (int64_t{1} << kOneBlock),
                  "keys: [kv_heads, n >= t, head_dim]");
      TORCH_CHECK(in.values.sizes() == in.keys.sizes() && in.values.stride(2) == 1, "values: as keys");
      for (int64_t h = 0; h < kv_heads; ++h) {  // from the head's first held key
        const int64_t first = in.vacant != nullptr ? in.vacant[h] : 0;
        head_keys[i].push_back(in.keys.data_ptr<float>() + h * in.keys.stride(0) + first * in.keys.stride(1));
        head_values[i].push_back(in.values.data_ptr<float>() + h * in.values.stride(0) + first * in.values.stride(1));
      }
    }
    TORCH_CHECK(in.window <= 0 || (in.key_positions.dim() == 2 && in.key_positions.size(0) == kv_heads &&
                                   in.key_positions.size(1) >= n && in.key_positions.stride(1) == 1 &&
                                   in.key_positions.scalar_type() == at::kLong),
                "key_positions: [kv_heads, n] int64");
    AttentionOutput& o = outputs[i];
    o.out = in.out.defined() ? in.out : at::empty({t, heads * head_dim}, in.q.options());
    TORCH_CHECK(o.out.dim() == 2 && o.out.size(0) == t && o.out.size(1) == heads * head_dim && o.out.stride(1) == 1,
                "out: [t, heads * head_dim]");
    if (in.probabilities) {
      o.probabilities = in.probabilities_out.defined() ? in.probabilities_out : at::empty({heads, t, n}, in.q.options());
      TORCH_CHECK(o.probabilities.dim() == 3 && o.probabilities.size(0) == heads && o.probabilities.size(1) == t &&
                      o.probabilities.size(2) >= n && o.probabilities.stride(2) == 1 &&
                      o.probabilities.scalar_type() == at::kFloat,
                  "probabilities_out: [heads, t, width >= n] float32");
    }
    if (in.log_sum_exp) o.log_sum_exp = at::empty({heads, t}, in.q.options());
    items[i] = AttentionSequence{in.q.data_ptr<float>(),
                                 in.q.stride(0),
                                 in_blocks(in) ? in.blocks.keys : head_keys[i].data(),
                                 in_blocks(in) ? in.blocks.values : head_values[i].data(),
                                 in_blocks(in) ? in.blocks.blocks_per_head : 1,
                                 in_blocks(in) ? in.blocks.block_shift : kOneBlock,
                                 in_blocks(in) ? head_dim : in.keys.stride(1),
                                 in_blocks(in) ? head_dim : in.values.stride(1),
                                 in.window > 0 ? in.key_positions.data_ptr<int64_t>() : nullptr,
                                 in.window > 0 ? in.key_positions.stride(0) : 0,
                                 n,
                                 t,
                                 in.first_position,
                                 in.window,
                                 o.out.data_ptr<float>(),
                                 o.out.stride(0),
                                 in.probabilities ? o.probabilities.data_ptr<float>() : nullptr,
                                 in.probabilities ? o.probabilities.stride(0) : 0,
                                 in.probabilities ? o.probabilities.stride(1) : 0,
                                 in.probabilities ? o.probabilities.size(2) : 0,
                                 in.log_sum_exp ? o.log_sum_exp.data_ptr<float>() : nullptr,
                                 t,
                                 in.vacant};
    longest = std::max(longest, n);
    work += 2 * heads * t * n * head_dim;
  }
  // Blocks of rows whose scores (group * rows * n floats) stay near a megabyte: the more rows, the more queries
  // share each transposed key tile. The blocks change no query's numbers.
  const int64_t group = heads / kv_heads;
  if (block_rows <= 0) block_rows = std::clamp<int64_t>((int64_t{1} << 18) / (group * longest), 1, 64);
  const BatchedAttention attention{items.data(), static_cast<int64_t>(items.size()), kv_heads, group, head_dim,
                                   static_cast<float>(scale), block_rows};
  parallel_work(attention_items(attention), work,
      [&](int64_t begin, int64_t end) { kernels.attention_rows(attention, begin, end); });
  return outputs;
}

}  // namespace namm::cpu
