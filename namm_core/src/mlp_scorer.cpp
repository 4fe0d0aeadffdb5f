#include "namm/mlp_scorer.h"

#include "aten.h"
#include "scorer_internal.h"

namespace namm {

using internal::linear;
using internal::param_block;

MlpScorer::MlpScorer(const ScorerConfig& config, const at::Tensor& params)
    : hidden_weight_(param_block(config, params, "mlp.hidden.weight")),
      hidden_bias_(param_block(config, params, "mlp.hidden.bias")),
      final_weight_(param_block(config, params, "mlp.final.weight")),
      final_bias_(param_block(config, params, "mlp.final.bias")) {}

at::Tensor MlpScorer::Score(const at::Tensor& features) const {
  TORCH_CHECK(features.dim() == 3 && features.size(2) == kFeatureDim, "MLP features must be [kv_heads, n, ",
              kFeatureDim, "], got ", features.sizes());
  at::Tensor y = features + linear(features, hidden_weight_, hidden_bias_).relu_();
  return linear(y, final_weight_, final_bias_).squeeze(2);
}

}  // namespace namm
