#include "namm/bam_scorer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "aten.h"
#include "cpu_kernels/cpu_kernels.h"
#include "cpu_kernels/tensor_kernels.h"
#include "scorer_internal.h"

// libtorch 2.x has a fused attention (flash / memory-efficient kernels on CUDA); Debian's 1.13 does not.
#if __has_include(<ATen/ops/scaled_dot_product_attention.h>)
#include <ATen/ops/flip.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#define NAMM_HAVE_FUSED_ATTENTION 1
#endif

namespace namm {

using internal::linear;
using internal::param_block;

struct BamScorer::HostLayers {
  cpu::InOutWeight qkv, out;
};

BamScorer::BamScorer(const ScorerConfig& config, const at::Tensor& params)
    : config_(config),
      qkv_weight_(param_block(config, params, "bam.qkv.weight")),
      qkv_bias_(param_block(config, params, "bam.qkv.bias")),
      out_weight_(param_block(config, params, "bam.out.weight")),
      out_bias_(param_block(config, params, "bam.out.bias")),
      final_weight_(param_block(config, params, "bam.final.weight")),
      final_bias_(param_block(config, params, "bam.final.bias")) {
  // The attention kernel takes values of up to 64 floats.
  if (config_.hidden <= 64 && internal::host_block(qkv_weight_) && internal::host_block(qkv_bias_) &&
      internal::host_block(out_weight_) && internal::host_block(out_bias_) && internal::host_block(final_weight_) &&
      internal::host_block(final_bias_)) {
    host_ = std::make_shared<const HostLayers>(HostLayers{cpu::make_in_out_weight(qkv_weight_, qkv_bias_, false),
                                                          cpu::make_in_out_weight(out_weight_, out_bias_, false)});
  }
}

at::Tensor BamScorer::Score(const at::Tensor& features) const {
  TORCH_CHECK(features.dim() == 3 && features.size(2) == kFeatureDim, "BAM features must be [kv_heads, n, ",
              kFeatureDim, "], got ", features.sizes());
  if (features.device().is_cpu() && features.scalar_type() == at::kFloat && host_) {
    return internal::score_heads_on_host(*this, features);
  }
  const int64_t h = config_.hidden;
  const at::Tensor& x = features;
  at::Tensor qkv = linear(x, qkv_weight_, qkv_bias_);
  at::Tensor o = backward_masked_attention(qkv.narrow(2, 0, h), qkv.narrow(2, h, h), qkv.narrow(2, 2 * h, h),
                                           1.0 / std::sqrt(static_cast<double>(h)));
  at::Tensor u = linear(o, out_weight_, out_bias_);
  at::Tensor residual = u.narrow(2, 0, kFeatureDim);
  at::Tensor mult = u.narrow(2, kFeatureDim, kFeatureDim);
  at::Tensor y = x * (mult + 1.0) + residual;
  return linear(y, final_weight_, final_bias_).squeeze(2);
}

// The tensor path's steps over one head, in the kernels' layouts (cpu_kernels.h: BackwardAttentionHead).
bool BamScorer::ScoreOnHost(const float* x, int64_t x_stride, int64_t n, float* scores,
                            std::vector<float>& workspace) const {
  if (!host_) return false;
  if (n == 0) return true;
  const cpu::Kernels& kernels = cpu::kernels();
  const int64_t h = config_.hidden, vectors = (h + 15) / 16, v_width = 16 * vectors, n_padded = (n + 31) / 32 * 32;
  const int64_t query_rows = kernels.query_rows;
  // Workspace: qkv [n, 3h], q scaled [n, h], key tiles [n_padded / 16, h, 16], values and output [n, v_width],
  // u [n, 50], y [n, 25], the attention's scratch [query_rows, n_padded].
  const int64_t sizes[] = {n * 3 * h, n * h, n_padded * h, n * v_width, n * v_width, n * 2 * kFeatureDim,
                           n * kFeatureDim, query_rows * n_padded};
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  workspace.resize(static_cast<std::size_t>(total));
  float* next = workspace.data();
  const auto take = [&](int64_t size) {
    float* p = next;
    next += size;
    return p;
  };
  float* qkv = take(sizes[0]);
  float* q = take(sizes[1]);
  float* key_tiles = take(sizes[2]);
  float* v = take(sizes[3]);
  float* o = take(sizes[4]);
  float* u = take(sizes[5]);
  float* y = take(sizes[6]);
  float* scratch = take(sizes[7]);

  cpu::linear_in_out(x, x_stride, n, host_->qkv, qkv, 3 * h, kernels);
  const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(h)));
  std::fill(key_tiles, key_tiles + n_padded * h, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = qkv + i * 3 * h;
    float* key_tile = key_tiles + i / 16 * 16 * h + i % 16;
    for (int64_t c = 0; c < h; ++c) {
      q[i * h + c] = row[c] * scale;
      key_tile[16 * c] = row[h + c];
    }
    std::copy(row + 2 * h, row + 3 * h, v + i * v_width);
    std::fill(v + i * v_width + h, v + (i + 1) * v_width, 0.0f);
  }
  const cpu::BackwardAttentionHead head{q, key_tiles, v, o, n, n_padded, h, vectors};
  for (int64_t i0 = 0; i0 < n; i0 += query_rows) kernels.backward_attention_rows(head, i0, scratch);
  cpu::linear_in_out(o, v_width, n, host_->out, u, 2 * kFeatureDim, kernels);
  // y = x * (1 + m) + r, rounded as the tensor operations round it.
  for (int64_t i = 0; i < n; ++i) {
    const float* r = u + i * 2 * kFeatureDim;
    const float* m = r + kFeatureDim;
    for (int64_t c = 0; c < kFeatureDim; ++c) {
      const float scaled = x[i * x_stride + c] * (m[c] + 1.0f);
      y[i * kFeatureDim + c] = scaled + r[c];
    }
  }
  internal::dot_rows_on_host(y, kFeatureDim, n, final_weight_, final_bias_, scores);
  return true;
}

at::Tensor backward_masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                     int64_t max_block_elements) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(1) == q.size(1),
              "backward_masked_attention: q, k must be [H, n, d] and v [H, n, dv]");
  const int64_t heads = q.size(0), n = q.size(1);
  if (n > 0 && q.device().is_cpu() && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
      v.scalar_type() == at::kFloat && v.size(2) <= 64) {
    return cpu::backward_masked_attention(q, k, v, scale, cpu::kernels());
  }
#ifdef NAMM_HAVE_FUSED_ATTENTION
  // On a GPU, one fused call: no block of scores in memory, no launch per block (at n = 16k the blocks below
  // took 65 ms per head group on an H200). The backward mask (key j >= query i) is the causal mask of the
  // sequence reversed. The kernel scales by 1 / sqrt(d); another scale is folded into q.
  if (n > 0 && q.is_cuda()) {
    const double rescale = scale * std::sqrt(static_cast<double>(q.size(2)));
    const at::Tensor q_scaled = rescale == 1.0 ? q : q * rescale;
    return at::scaled_dot_product_attention(q_scaled.flip(1).unsqueeze(0), k.flip(1).unsqueeze(0),
                                            v.flip(1).unsqueeze(0), {}, 0.0, /*is_causal=*/true)
        .squeeze(0)
        .flip(1);
  }
#endif
  // Elsewhere (other devices and dtypes): tensor operations on blocks of query rows.
  at::Tensor out = at::empty({heads, n, v.size(2)}, v.options());
  if (n == 0) return out;
  const int64_t block = std::max<int64_t>(16, std::min<int64_t>(n, max_block_elements / (heads * n)));
  // Within a block's leading square (rows i0.., keys i0..), key c is hidden from row r when c < r.
  const at::Tensor hidden = at::ones({block, block}, q.options().dtype(at::kBool)).tril(-1);
  const at::Tensor kt = k.transpose(1, 2);
  for (int64_t i0 = 0; i0 < n; i0 += block) {
    const int64_t rows = std::min(block, n - i0);
    // Row i only sees keys j >= i, so the keys before the block never take part.
    at::Tensor scores = q.narrow(1, i0, rows).matmul(kt.narrow(2, i0, n - i0)).mul_(scale);
    scores.narrow(2, 0, rows).masked_fill_(hidden.narrow(0, 0, rows).narrow(1, 0, rows),
                                           -std::numeric_limits<float>::infinity());
    out.narrow(1, i0, rows).copy_(scores.softmax(2).matmul(v.narrow(1, i0, n - i0)));
  }
  return out;
}

}  // namespace namm
