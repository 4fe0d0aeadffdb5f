#include "namm/policies/h2o_policy.h"

#include <algorithm>
#include <limits>

#include "aten.h"
#include "namm/selection.h"
#include "namm/stft_features.h"
#include "torch_status.h"

namespace namm {

namespace {
constexpr const char* kAttentionState = "h2o.attention";

// `budget`: the resolved budget, if known yet.
Status CheckRecent(std::optional<int64_t> budget, std::optional<int64_t> recent) {
  if (!recent) return Status::Ok();
  if (*recent < 0) return Status::InvalidArgument("H2O needs recent >= 0, got " + std::to_string(*recent));
  if (budget && *recent > *budget) {
    return Status::InvalidArgument("H2O's recent window (" + std::to_string(*recent) +
                                   " tokens) exceeds its budget (" + std::to_string(*budget) + " tokens)");
  }
  return Status::Ok();
}
}  // namespace

Result<std::unique_ptr<H2OPolicy>> H2OPolicy::Create(CacheBudget budget, std::optional<int64_t> recent) {
  NAMM_RETURN_IF_ERROR(
      CheckRecent(budget.is_ratio() ? std::nullopt : std::optional<int64_t>(budget.Resolve(0)), recent));
  return std::unique_ptr<H2OPolicy>(new H2OPolicy(budget, recent));
}

std::string H2OPolicy::name() const {
  return "h2o(" + budget().ToString() + (recent_ ? ", recent=" + std::to_string(*recent_) : "") + ")";
}

std::vector<TokenStateSpec> H2OPolicy::token_state() const { return {{kAttentionState, {}, at::kFloat}}; }

Status H2OPolicy::Observe(int /*layer*/, const at::Tensor& attention, int64_t first_query,
                         LayerKVCache& cache) {
  NAMM_RETURN_IF_ERROR(validate_observed_attention(attention, first_query, cache));
  return internal::catch_torch_errors("H2O observe", [&] {
    cache.state(kAttentionState).add_(gqa_mean(attention, cache.kv_heads(), AttentionPrecision::kF32).sum(1));
    return Status::Ok();
  });
}

Result<at::Tensor> H2OPolicy::Select(int /*layer*/, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(int64_t budget, budget_tokens());
  const int64_t n = cache.size();
  if (n <= budget) return all_token_indices(cache);
  // A recent window larger than a ratio's budget on a short prompt fills the whole budget.
  const int64_t recent = recent_ ? std::min(*recent_, budget) : budget / 2;
  return internal::catch_torch_errors("H2O select", [&]() -> Result<at::Tensor> {
    at::Tensor ranking = force_keep_newest(cache.state(kAttentionState));
    ranking.narrow(1, n - recent, recent).fill_(std::numeric_limits<float>::max());
    return keep_top_k_per_head(ranking, budget);
  });
}

}  // namespace namm
