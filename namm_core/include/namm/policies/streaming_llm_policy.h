// StreamingLLM baseline (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"): keep
// the first `sinks` tokens of the sequence (attention sinks: softmax parks surplus attention on them, and
// evicting them breaks the model) and a window of the most recent tokens, budget - sinks of them. Needs no
// attention.
//
// The original rolls the window after every token; here eviction happens at the engine's memory updates, like
// every other policy's, so between updates the cache may exceed the budget by up to n_up tokens. The original also
// re-rotates the cached keys to their slots in the cache; here keys keep their positions (docs/namm-core.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "namm/policies/cache_budget.h"

namespace namm {

class StreamingLlmPolicy final : public BudgetedPolicy {
 public:
  // sinks: initial tokens kept (the paper uses 4); must leave room for the newest token within the budget.
  // With a budget given as a ratio, a prompt too short for every sink keeps budget - 1 of them.
  static Result<std::unique_ptr<StreamingLlmPolicy>> Create(CacheBudget budget, int64_t sinks = 4);

  std::string name() const override;
  Status BeginSequence(const SequenceInfo& info) override;
  // While the cache holds more than the budget: slots [0, sinks) and the newest budget - sinks.
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;

 private:
  StreamingLlmPolicy(CacheBudget budget, int64_t sinks)
      : BudgetedPolicy(budget), sinks_(sinks), sinks_now_(sinks) {}
  int64_t sinks_;
  int64_t sinks_now_;  // for the current sequence
};

}  // namespace namm
