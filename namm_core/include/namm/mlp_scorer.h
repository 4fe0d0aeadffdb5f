// MLP scorer (spec §4.4): each token is scored from its own features, without looking at other tokens.
//   y = x + ReLU(x W_1 + b_1)   (W_1 [25, 25]; residual first)
//   score = y W_2 + b_2         (W_2 [25, 1])
// 676 parameters with biases, 650 without.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

#include "namm/scorer.h"

namespace namm {

class MlpScorer final : public Scorer {
 public:
  // params: [scorer_param_count(config)] float32; config.kind must be kMlp.
  MlpScorer(const ScorerConfig& config, const at::Tensor& params);
  at::Tensor Score(const at::Tensor& features) const override;
  bool ScoreOnHost(const float* x, int64_t x_stride, int64_t n, float* scores,
                   std::vector<float>& workspace) const override;

 private:
  at::Tensor hidden_weight_, hidden_bias_, final_weight_, final_bias_;  // biases undefined when disabled
  // The hidden layer laid out for our kernels, when ScoreOnHost can run (float32 host parameters).
  struct HostLayers;
  std::shared_ptr<const HostLayers> host_;
};

}  // namespace namm
