#include "namm/scorer.h"

#include "aten.h"
#include "namm/dtype.h"
#include "scorer_internal.h"
#include "namm/bam_scorer.h"
#include "namm/mlp_scorer.h"

namespace namm {

Result<std::unique_ptr<Scorer>> make_scorer(const ScorerConfig& config, const at::Tensor& params) {
  NAMM_RETURN_IF_ERROR(validate_scorer_config(config));
  const int64_t expected = scorer_param_count(config);
  if (params.dim() != 1 || params.size(0) != expected || params.scalar_type() != at::kFloat) {
    return Status::InvalidArgument(std::string("the ") + scorer_kind_name(config.kind) + " scorer needs a float32 [" +
                                   std::to_string(expected) + "] parameter vector, got " +
                                   at::toString(params.scalar_type()) + " " + shape_to_string(params.sizes().vec()));
  }
  if (config.kind == ScorerKind::kBam) return std::unique_ptr<Scorer>(new BamScorer(config, params));
  return std::unique_ptr<Scorer>(new MlpScorer(config, params));
}

namespace internal {
at::Tensor param_block(const ScorerConfig& config, const at::Tensor& params, const std::string& name) {
  for (const auto& block : scorer_param_layout(config)) {
    if (block.name == name) return params.narrow(0, block.offset, block.numel()).view(block.shape);
  }
  return at::Tensor();
}
}  // namespace internal

}  // namespace namm
