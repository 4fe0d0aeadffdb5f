#include "namm/policies/cache_budget.h"

namespace namm {

BudgetedPolicy::BudgetedPolicy(CacheBudget budget) : budget_(budget) {
  if (!budget_.is_ratio()) tokens_ = budget_.Resolve(0);
}

Status BudgetedPolicy::BeginSequence(const SequenceInfo& info) {
  tokens_ = budget_.Resolve(static_cast<int64_t>(info.prompt_ids.size()));
  return Status::Ok();
}

Result<int64_t> BudgetedPolicy::budget_tokens() const {
  if (!tokens_) {
    return Status::FailedPrecondition(name() +
                                      ": a budget given as a ratio of the prompt needs BeginSequence()");
  }
  return *tokens_;
}

}  // namespace namm
