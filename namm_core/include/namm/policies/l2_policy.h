// L2-norm baseline (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
// Compression"): keys with a small L2 norm tend to receive high attention, so keep the budget's tokens per KV
// head whose (post-RoPE) keys have the lowest L2 norm; the newest token is always kept. Needs no attention
// probabilities. Eviction happens at the engine's memory updates.
#pragma once

#include <memory>
#include <string>

#include "namm/policies/cache_budget.h"

namespace namm {

class L2Policy final : public BudgetedPolicy {
 public:
  static Result<std::unique_ptr<L2Policy>> Create(CacheBudget budget);

  std::string name() const override;
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;

 private:
  explicit L2Policy(CacheBudget budget) : BudgetedPolicy(budget) {}
};

}  // namespace namm
