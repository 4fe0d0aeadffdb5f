// TOVA baseline (Oren et al. 2024, "Transformers are Multi-State RNNs"): when the cache is over budget, evict
// the tokens that the latest query attends to least. Here the latest query's attention is averaged over the
// query heads of each KV group, so each KV head keeps its own tokens (the paper averages over all heads of a
// layer).
//
// The original evicts one token per decoded token; here eviction happens at the engine's memory updates, down
// to the budget, ranked by the attention of the newest query at that moment.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "namm/policies/cache_budget.h"

namespace namm {

class TovaPolicy final : public BudgetedPolicy {
 public:
  static Result<std::unique_ptr<TovaPolicy>> Create(CacheBudget budget);

  std::string name() const override;
  // "tova.latest" [] float32: the attention each token received from the newest query seen.
  std::vector<TokenStateSpec> token_state() const override;
  bool needs_attention() const override { return true; }
  Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache) override;
  // While the cache holds more than the budget: each head's budget tokens most attended by the newest query
  // (the newest token itself always kept; ties to the more recent token).
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;

 private:
  explicit TovaPolicy(CacheBudget budget) : BudgetedPolicy(budget) {}
};

}  // namespace namm
