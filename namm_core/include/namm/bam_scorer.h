// BAM: the backward attention memory scorer (spec §4.1).
//
// Per KV head, independently, for the n cached tokens with features x [n, 25]:
//   q | k | v = x W_qkv + b_qkv                    (W_qkv [25, 3h]; single head of width h)
//   o_i = sum_{j >= i} softmax_j(q_i . k_j / sqrt(h)) v_j   (backward mask: a token attends to itself and newer)
//   r | m = o W_o + b_o                            (W_o [h, 50]; r, m in R^25)
//   y = x * (1 + m) + r                            (residual + multiplicative interaction, identity non-linearity)
//   score = y W_f + b_f                            (W_f [25, 1])
// There is no ReLU anywhere. With all-zero parameters every score is exactly 0.
//
// The masked attention is computed in blocks of query rows, each against only the keys it may see, so memory
// stays O(n * h) plus one block of scores: the reference's explicit n x n float mask (4 GiB at n = 32k) is never
// built. On the CPU a kernel of our own does it (cpu_kernels/); on a CUDA device with libtorch 2.x, one fused
// attention call over the reversed sequence.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

#include "namm/scorer.h"

namespace namm {

class BamScorer final : public Scorer {
 public:
  // params: [scorer_param_count(config)] float32; config.kind must be kBam.
  BamScorer(const ScorerConfig& config, const at::Tensor& params);
  at::Tensor Score(const at::Tensor& features) const override;
  bool ScoreOnHost(const float* x, int64_t x_stride, int64_t n, float* scores,
                   std::vector<float>& workspace) const override;

 private:
  ScorerConfig config_;
  at::Tensor qkv_weight_, qkv_bias_, out_weight_, out_bias_, final_weight_, final_bias_;  // undefined if no bias
  // The projections laid out for our kernels, when ScoreOnHost can run (float32 host parameters, hidden <= 64).
  struct HostLayers;
  std::shared_ptr<const HostLayers> host_;
};

// softmax(q k^T * scale + backward mask) v per head, with the mask j >= i. q, k: [H, n, d], v: [H, n, dv].
// Query rows are processed in blocks of at most max_block_elements / (H * n) rows (at least 16).
at::Tensor backward_masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                     int64_t max_block_elements = int64_t{1} << 22);

}  // namespace namm
