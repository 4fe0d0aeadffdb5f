// L2-norm baseline (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
// Compression"): keys with a small L2 norm tend to receive high attention, so keep the budget's tokens per KV
// head whose (post-RoPE) keys have the lowest L2 norm; the newest token is always kept. Needs no attention
// probabilities. Eviction happens at the engine's memory updates. The first `skip_layers` layers keep every
// token: the authors' scripts leave layers 0 and 1 (or 0) uncompressed; the default, 0, compresses every layer,
// as NVIDIA's kvpress does.
#pragma once

#include <memory>
#include <string>

#include "namm/policies/cache_budget.h"

namespace namm {

class L2Policy final : public BudgetedPolicy {
 public:
  static Result<std::unique_ptr<L2Policy>> Create(CacheBudget budget, int64_t skip_layers = 0);

  std::string name() const override;
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;

 private:
  L2Policy(CacheBudget budget, int64_t skip_layers) : BudgetedPolicy(budget), skip_layers_(skip_layers) {}
  int64_t skip_layers_;
};

}  // namespace namm
