// H2O baseline ("heavy hitters", Zhang et al. 2023): keep the tokens that have received the most attention,
// plus a window of the most recent tokens, within a fixed budget per KV head.
//
// Accumulated attention of a token = sum over every query so far of the attention it received, averaged over
// the query heads of its KV group (float32). Unlike the original, which evicts after every decoded token,
// eviction happens at the engine's memory updates, like the NAMM's, so the two are compared on the same
// schedule; between updates the cache may exceed the budget by up to n_up tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "namm/memory_policy.h"

namespace namm {

class H2OPolicy final : public MemoryPolicy {
 public:
  // budget: tokens kept per head (> 0); recent: how many of them are the most recent tokens (<= budget;
  // H2O's default splits the budget in half).
  static Result<std::unique_ptr<H2OPolicy>> Create(int64_t budget, int64_t recent);

  std::string name() const override;
  // "h2o.attention" [] float32: the accumulated attention per token.
  std::vector<TokenStateSpec> token_state() const override;
  bool needs_attention() const override { return true; }
  Status Observe(int layer, const at::Tensor& attention, LayerKVCache& cache) override;
  // Keeps everything while the cache holds <= budget tokens; otherwise the `recent` newest tokens and the
  // budget - recent others with the most accumulated attention.
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;

 private:
  H2OPolicy(int64_t budget, int64_t recent) : budget_(budget), recent_(recent) {}
  int64_t budget_;
  int64_t recent_;
};

}  // namespace namm
