// The fixed-budget baselines' base: a CacheBudget (namm/cache_budget.h) resolved when a sequence begins.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "namm/cache_budget.h"
#include "namm/policies/memory_policy.h"
#include "namm/status.h"

namespace namm {

// Base of the fixed-budget baselines: holds the budget and resolves it when a sequence begins.
class BudgetedPolicy : public MemoryPolicy {
 public:
  Status BeginSequence(const SequenceInfo& info) override;

 protected:
  explicit BudgetedPolicy(CacheBudget budget);
  const CacheBudget& budget() const { return budget_; }
  // Tokens per KV head for the current sequence; FailedPrecondition while a ratio has not been resolved.
  Result<int64_t> budget_tokens() const;

 private:
  CacheBudget budget_;
  std::optional<int64_t> tokens_;
};

}  // namespace namm
