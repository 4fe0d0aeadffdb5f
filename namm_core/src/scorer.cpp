#include "namm/scorer.h"

#include <algorithm>

#include "aten.h"
#include "namm/dtype.h"
#include "scorer_internal.h"
#include "cpu_kernels/cpu_kernels.h"
#include "cpu_kernels/task_pool.h"
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

bool host_block(const at::Tensor& block) {
  return !block.defined() || (block.device().is_cpu() && block.scalar_type() == at::kFloat && block.is_contiguous());
}

void dot_rows_on_host(const float* x, int64_t x_stride, int64_t m, const at::Tensor& weight, const at::Tensor& bias,
                      float* y) {
  const int64_t k = weight.size(0);  // [k, 1]: in memory, the one row of an [out, in] weight
  const cpu::Linear op{x, x_stride, weight.data_ptr<float>(), k, bias.defined() ? bias.data_ptr<float>() : nullptr,
                       y, 1, m, 1, k};
  cpu::kernels().linear_columns(op, 0, 1);
}

at::Tensor score_heads_on_host(const Scorer& scorer, const at::Tensor& features) {
  const at::Tensor x = features.contiguous();
  const int64_t heads = x.size(0), n = x.size(1);
  const at::Tensor scores = at::empty({heads, n}, x.options());
  cpu::parallel_tasks(heads, [&](int64_t begin, int64_t end) {
    std::vector<float> workspace;
    for (int64_t h = begin; h < end; ++h) {
      TORCH_CHECK(scorer.ScoreOnHost(x.data_ptr<float>() + h * n * kFeatureDim, kFeatureDim, n,
                                     scores.data_ptr<float>() + h * n, workspace),
                  "the scorer's parameters are not on the host");
    }
  });
  return scores;
}

at::Tensor param_block(const ScorerConfig& config, const at::Tensor& params, const std::string& name) {
  for (const auto& block : scorer_param_layout(config)) {
    if (block.name == name) return params.narrow(0, block.offset, block.numel()).view(block.shape);
  }
  return at::Tensor();
}
}  // namespace internal

}  // namespace namm
