#include "namm/policies/snapkv_policy.h"

#include <algorithm>
#include <limits>

#include "aten.h"
#include "namm/selection.h"
#include "namm/stft_features.h"
#include "torch_status.h"

namespace namm {

namespace {
constexpr const char* kVotesState = "snapkv.votes";
}  // namespace

Result<std::unique_ptr<SnapKvPolicy>> SnapKvPolicy::Create(CacheBudget budget, int64_t window,
                                                           int64_t kernel) {
  if (window <= 0) return Status::InvalidArgument("SnapKV needs window > 0, got " + std::to_string(window));
  if (kernel <= 0 || kernel % 2 == 0) {
    return Status::InvalidArgument("SnapKV needs an odd pooling kernel > 0, got " + std::to_string(kernel));
  }
  return std::unique_ptr<SnapKvPolicy>(new SnapKvPolicy(budget, window, kernel));
}

std::string SnapKvPolicy::name() const {
  return "snapkv(" + budget().ToString() + ", window=" + std::to_string(window_) +
         ", kernel=" + std::to_string(kernel_) + ")";
}

std::vector<TokenStateSpec> SnapKvPolicy::token_state() const { return {{kVotesState, {}, at::kFloat}}; }

Status SnapKvPolicy::BeginSequence(const SequenceInfo& info) {
  NAMM_RETURN_IF_ERROR(BudgetedPolicy::BeginSequence(info));
  prompt_tokens_ = static_cast<int64_t>(info.prompt_ids.size());
  return Status::Ok();
}

Status SnapKvPolicy::Observe(int /*layer*/, const at::Tensor& attention, int64_t first_query,
                            LayerKVCache& cache) {
  NAMM_RETURN_IF_ERROR(validate_observed_attention(attention, first_query, cache));
  if (prompt_tokens_ < 0) return Status::FailedPrecondition("SnapKV needs BeginSequence() before Observe()");
  const auto [begin, end] = prompt_window_rows(attention, first_query, prompt_tokens_, window_);
  if (begin == end) return Status::Ok();
  return internal::catch_torch_errors("SnapKV observe", [&] {
    const at::Tensor window = attention.narrow(1, begin, end - begin);
    cache.state(kVotesState).add_(gqa_mean(window, cache.kv_heads(), AttentionPrecision::kF32).sum(1));
    return Status::Ok();
  });
}

Result<at::Tensor> SnapKvPolicy::Select(int /*layer*/, LayerKVCache& cache) {
  return all_token_indices(cache);
}

Result<std::optional<at::Tensor>> SnapKvPolicy::EndPrefill(int /*layer*/, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(int64_t budget, budget_tokens());
  const int64_t n = cache.size();
  if (n <= budget) return std::optional<at::Tensor>();
  return internal::catch_torch_errors("SnapKV end of prefill", [&]() -> Result<std::optional<at::Tensor>> {
    const int64_t window = std::min(window_, budget);
    at::Tensor ranking = cache.state(kVotesState).clone();  // [kv_heads, n]
    // Pool the votes of the tokens before the window; the window itself ranks above everything.
    const int64_t earlier = n - window;
    // A kernel of 2 * earlier - 1 already spans every earlier token from each one: a wider one pools the same
    // maximum, and libtorch's pooling walks its whole width (a request's kernel=10^15 held namm-api's scheduler).
    const int64_t kernel = std::min(kernel_, 2 * earlier - 1);
    const at::Tensor pooled =
        at::max_pool1d(ranking.narrow(1, 0, earlier).unsqueeze(1), {kernel}, {1}, {kernel / 2}).squeeze(1);
    ranking.narrow(1, 0, earlier).copy_(pooled);
    ranking.narrow(1, earlier, window).fill_(std::numeric_limits<float>::max());
    return std::optional<at::Tensor>(keep_top_k_per_head(ranking, budget));
  });
}

}  // namespace namm
