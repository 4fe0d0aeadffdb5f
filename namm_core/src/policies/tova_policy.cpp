#include "namm/policies/tova_policy.h"

#include "aten.h"
#include "namm/selection.h"
#include "namm/stft_features.h"
#include "torch_status.h"

namespace namm {

namespace {
constexpr const char* kLatestState = "tova.latest";
}  // namespace

Result<std::unique_ptr<TovaPolicy>> TovaPolicy::Create(CacheBudget budget) {
  return std::unique_ptr<TovaPolicy>(new TovaPolicy(budget));
}

std::string TovaPolicy::name() const { return "tova(" + budget().ToString() + ")"; }

std::vector<TokenStateSpec> TovaPolicy::token_state() const { return {{kLatestState, {}, at::kFloat}}; }

Status TovaPolicy::Observe(int /*layer*/, const at::Tensor& attention, int64_t first_query,
                          LayerKVCache& cache) {
  NAMM_RETURN_IF_ERROR(validate_observed_attention(attention, first_query, cache));
  return internal::catch_torch_errors("TOVA observe", [&] {
    const at::Tensor newest = attention.narrow(1, attention.size(1) - 1, 1);
    cache.state(kLatestState).copy_(gqa_mean(newest, cache.kv_heads(), AttentionPrecision::kF32).squeeze(1));
    return Status::Ok();
  });
}

Result<at::Tensor> TovaPolicy::Select(int /*layer*/, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(int64_t budget, budget_tokens());
  if (cache.size() <= budget) return all_token_indices(cache);
  return internal::catch_torch_errors("TOVA select", [&]() -> Result<at::Tensor> {
    return keep_top_k_per_head(force_keep_newest(cache.state(kLatestState)), budget);
  });
}

}  // namespace namm
