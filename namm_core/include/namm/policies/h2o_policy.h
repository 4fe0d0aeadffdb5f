// H2O baseline ("heavy hitters"; Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
// Inference of Large Language Models"): keep the tokens that have received the most attention, plus a window
// of the most recent tokens, within a fixed budget per KV head.
//
// Accumulated attention of a token = sum over every query so far of the attention it received, averaged over
// the query heads of its KV group (float32). Unlike the original, which evicts after every decoded token,
// eviction happens at the engine's memory updates, like the NAMM's, so the two are compared on the same
// schedule; between updates the cache may exceed the budget by up to n_up tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "namm/policies/cache_budget.h"

namespace namm {

class H2OPolicy final : public BudgetedPolicy {
 public:
  // recent: how many of the kept tokens are the most recent ones (<= the budget; default: half of it, H2O's
  // split). With a budget given as a ratio, a prompt whose budget is smaller than `recent` keeps only recent
  // ones.
  static Result<std::unique_ptr<H2OPolicy>> Create(CacheBudget budget,
                                                   std::optional<int64_t> recent = std::nullopt);

  std::string name() const override;
  // "h2o.attention" [] float32: the accumulated attention per token.
  std::vector<TokenStateSpec> token_state() const override;
  bool needs_attention() const override { return true; }
  Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache) override;
  // Keeps everything while the cache holds <= budget tokens; otherwise the `recent` newest tokens and the
  // budget - recent others with the most accumulated attention.
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;

 private:
  H2OPolicy(CacheBudget budget, std::optional<int64_t> recent) : BudgetedPolicy(budget), recent_(recent) {}
  std::optional<int64_t> recent_;
};

}  // namespace namm
