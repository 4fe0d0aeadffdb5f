#include "namm/mlp_scorer.h"

#include <algorithm>

#include "aten.h"
#include "cpu_kernels/tensor_kernels.h"
#include "scorer_internal.h"

namespace namm {

using internal::linear;
using internal::param_block;

struct MlpScorer::HostLayers {
  cpu::InOutWeight hidden;
};

MlpScorer::MlpScorer(const ScorerConfig& config, const at::Tensor& params)
    : hidden_weight_(param_block(config, params, "mlp.hidden.weight")),
      hidden_bias_(param_block(config, params, "mlp.hidden.bias")),
      final_weight_(param_block(config, params, "mlp.final.weight")),
      final_bias_(param_block(config, params, "mlp.final.bias")) {
  if (internal::host_block(hidden_weight_) && internal::host_block(hidden_bias_) &&
      internal::host_block(final_weight_) && internal::host_block(final_bias_)) {
    host_ = std::make_shared<const HostLayers>(HostLayers{cpu::make_in_out_weight(hidden_weight_, hidden_bias_, false)});
  }
}

at::Tensor MlpScorer::Score(const at::Tensor& features) const {
  TORCH_CHECK(features.dim() == 3 && features.size(2) == kFeatureDim, "MLP features must be [kv_heads, n, ",
              kFeatureDim, "], got ", features.sizes());
  if (features.device().is_cpu() && features.scalar_type() == at::kFloat && host_) {
    return internal::score_heads_on_host(*this, features);
  }
  at::Tensor y = features + linear(features, hidden_weight_, hidden_bias_).relu_();
  return linear(y, final_weight_, final_bias_).squeeze(2);
}

// y = x + ReLU(x W_1 + b_1), then y W_2 + b_2, rounded as the tensor operations round them.
bool MlpScorer::ScoreOnHost(const float* x, int64_t x_stride, int64_t n, float* scores,
                            std::vector<float>& workspace) const {
  if (!host_) return false;
  workspace.resize(static_cast<std::size_t>(n * kFeatureDim));
  float* y = workspace.data();
  cpu::linear_in_out(x, x_stride, n, host_->hidden, y, kFeatureDim, cpu::kernels());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < kFeatureDim; ++c) {
      float& v = y[i * kFeatureDim + c];
      v = x[i * x_stride + c] + std::max(v, 0.0f);
    }
  }
  internal::dot_rows_on_host(y, kFeatureDim, n, final_weight_, final_bias_, scores);
  return true;
}

}  // namespace namm
