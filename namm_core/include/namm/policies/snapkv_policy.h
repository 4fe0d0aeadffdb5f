// SnapKV baseline (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): at the
// end of prefill, the last `window` prompt tokens (the observation window) vote for the earlier prompt tokens
// they attend to; votes are max-pooled along the sequence (kernel `kernel`) so that neighbours of a selected
// token come with it; each KV head keeps the budget - window best-voted earlier tokens plus the whole window.
// Every token after the prompt is kept (SnapKV compresses the prompt once and never evicts during
// generation). Memory updates during prefill evict nothing.
//
// Votes are the attention of each window query (its softmax over the whole prompt, as the official code takes it
// before slicing off the window) averaged over the query heads of its KV group, summed over the window. Averaging
// per KV group, as kvpress does, differs from the official per-query-head selection.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "namm/policies/cache_budget.h"

namespace namm {

class SnapKvPolicy final : public BudgetedPolicy {
 public:
  // window: observation-window length (the paper: 32); kernel: odd max-pooling width (the paper: 7).
  static Result<std::unique_ptr<SnapKvPolicy>> Create(CacheBudget budget, int64_t window = 32,
                                                      int64_t kernel = 7);

  std::string name() const override;
  // "snapkv.votes" [] float32: attention received from the observation window's queries.
  std::vector<TokenStateSpec> token_state() const override;
  bool needs_attention() const override { return true; }
  Status BeginSequence(const SequenceInfo& info) override;
  Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache) override;
  // Keeps every token.
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;
  // The compression described above, when the prompt holds more tokens than the budget. With a budget smaller
  // than the window, the newest budget tokens.
  Result<std::optional<at::Tensor>> EndPrefill(int layer, LayerKVCache& cache) override;

 private:
  SnapKvPolicy(CacheBudget budget, int64_t window, int64_t kernel)
      : BudgetedPolicy(budget), window_(window), kernel_(kernel) {}
  int64_t window_, kernel_;
  int64_t prompt_tokens_ = -1;
};

}  // namespace namm
