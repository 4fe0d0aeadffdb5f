#include "namm/h2o_policy.h"

#include <limits>

#include "aten.h"
#include "namm/selection.h"
#include "namm/stft_features.h"
#include "torch_status.h"

namespace namm {

namespace {
constexpr const char* kAttentionState = "h2o.attention";
}  // namespace

Result<std::unique_ptr<H2OPolicy>> H2OPolicy::Create(int64_t budget, int64_t recent) {
  if (budget <= 0 || recent < 0 || recent > budget) {
    return Status::InvalidArgument("H2O needs budget > 0 and 0 <= recent <= budget, got budget " +
                                   std::to_string(budget) + ", recent " + std::to_string(recent));
  }
  return std::unique_ptr<H2OPolicy>(new H2OPolicy(budget, recent));
}

std::string H2OPolicy::name() const {
  return "h2o(budget=" + std::to_string(budget_) + ", recent=" + std::to_string(recent_) + ")";
}

std::vector<TokenStateSpec> H2OPolicy::token_state() const { return {{kAttentionState, {}, at::kFloat}}; }

Status H2OPolicy::Observe(int /*layer*/, const at::Tensor& attention, LayerKVCache& cache) {
  NAMM_RETURN_IF_ERROR(validate_observed_attention(attention, cache));
  return internal::catch_torch_errors("H2O observe", [&] {
    cache.state(kAttentionState).add_(gqa_mean(attention, cache.kv_heads(), AttentionPrecision::kF32).sum(1));
    return Status::Ok();
  });
}

Result<at::Tensor> H2OPolicy::Select(int /*layer*/, LayerKVCache& cache) {
  const int64_t n = cache.size();
  if (n <= budget_) return all_token_indices(cache);
  return internal::catch_torch_errors("H2O select", [&]() -> Result<at::Tensor> {
    at::Tensor ranking = force_keep_newest(cache.state(kAttentionState));
    ranking.narrow(1, n - recent_, recent_).fill_(std::numeric_limits<float>::max());
    return keep_top_k_per_head(ranking, budget_);
  });
}

}  // namespace namm
