#include "namm/policies/streaming_llm_policy.h"

#include <algorithm>

#include "aten.h"
#include "torch_status.h"

namespace namm {

namespace {
Status CheckSinks(int64_t budget, int64_t sinks) {
  if (sinks < 0 || sinks >= budget) {
    return Status::InvalidArgument(
        "StreamingLLM needs 0 <= sinks < budget (the newest token must fit), got sinks " +
        std::to_string(sinks) + ", budget " + std::to_string(budget));
  }
  return Status::Ok();
}
}  // namespace

Result<std::unique_ptr<StreamingLlmPolicy>> StreamingLlmPolicy::Create(CacheBudget budget, int64_t sinks) {
  if (sinks < 0)
    return Status::InvalidArgument("StreamingLLM needs sinks >= 0, got " + std::to_string(sinks));
  if (!budget.is_ratio()) NAMM_RETURN_IF_ERROR(CheckSinks(budget.Resolve(0), sinks));
  return std::unique_ptr<StreamingLlmPolicy>(new StreamingLlmPolicy(budget, sinks));
}

std::string StreamingLlmPolicy::name() const {
  return "streaming(" + budget().ToString() + ", sinks=" + std::to_string(sinks_) + ")";
}

Status StreamingLlmPolicy::BeginSequence(const SequenceInfo& info) {
  NAMM_RETURN_IF_ERROR(BudgetedPolicy::BeginSequence(info));
  NAMM_ASSIGN_OR_RETURN(int64_t tokens, budget_tokens());
  // A share of a short prompt may leave no room for every sink: keep what fits with the newest token.
  sinks_now_ = budget().is_ratio() ? std::min(sinks_, tokens - 1) : sinks_;
  return CheckSinks(tokens, sinks_now_);
}

Result<at::Tensor> StreamingLlmPolicy::Select(int /*layer*/, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(int64_t budget, budget_tokens());
  const int64_t n = cache.size();
  if (n <= budget) return all_token_indices(cache);
  return internal::catch_torch_errors("StreamingLLM select", [&]() -> Result<at::Tensor> {
    // Every head holds the same tokens, oldest first: the sinks are the first slots.
    const at::TensorOptions options = cache.positions().options();
    const at::Tensor kept =
        at::cat({at::arange(sinks_now_, options), at::arange(n - (budget - sinks_now_), n, options)});
    return kept.unsqueeze(0).expand({cache.kv_heads(), budget}).contiguous();
  });
}

}  // namespace namm
