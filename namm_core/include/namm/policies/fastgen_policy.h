// FastGen baseline (Ge et al. 2024, "Model Tells You What to Discard: Adaptive KV Cache Compression for
// LLMs"): at the end of prefill each KV head is profiled and gets the cheapest of these nested cache policies
// that recovers at least `recovery` of its attention:
//   1. special tokens (C_special), 2. + punctuation (C_punct), 3. + the `frequent` tokens with the most
//   accumulated attention (C_frequent), 4. + the `local` most recent tokens (C_local), 5. the full cache.
// A policy's recovered attention is the share of the attention of the last `window` prompt queries (averaged
// over the query heads of the KV group) that falls on the tokens it keeps; the newest token is always kept.
// Locality is relative, as the paper's C_local: for each profiling query, its own `local` most recent tokens
// count as kept (the policy then keeps the prompt's last `local` tokens, the newest query's own).
// The budget sets the sizes of the frequency and locality parts: half of it each (the paper gives them as
// ratios of the prompt, r_f = r_l).
//
// Deliberate differences: (1) by default the KV cache is rectangular (every head of a layer holds the same
// number of tokens, as in the reference's NAMM code), so heads whose policy keeps fewer tokens than the layer's
// largest are padded with their most-attended other tokens, and the reported cache size counts what is stored;
// with own_head_counts (fastgen:...,heads=own, on the CPU) each head keeps what its policy keeps, as the paper's
// FastGen does, the rest of its slots vacant (a ragged cache, kv_cache.h); (2) tokens after the prompt are all
// kept, as SnapKV does (the paper applies each head's policy to generated tokens too; the answers scored here are
// short).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "namm/policies/cache_budget.h"

namespace namm {

struct FastGenOptions {
  double recovery = 0.95;  // T: share of attention a compressed head must recover
  int64_t window = 32;     // profiling queries: the last `window` prompt tokens
  // Token classes, from the tokenizer: special tokens (BOS, EOS, ...) and punctuation.
  std::vector<int64_t> special_ids;
  std::vector<int64_t> punctuation_ids;
  bool own_head_counts = false;  // heads=own: no padding to the layer's largest count (above)
};

class FastGenPolicy final : public BudgetedPolicy {
 public:
  static Result<std::unique_ptr<FastGenPolicy>> Create(CacheBudget budget, FastGenOptions options);

  std::string name() const override;
  // "fastgen.attention" (accumulated attention, the frequency ranking), "fastgen.window" (attention from the
  // profiling window) and "fastgen.near" (the part of it each query gives its own `local` most recent tokens),
  // [] float32 each.
  std::vector<TokenStateSpec> token_state() const override;
  bool needs_attention() const override { return true; }
  Status BeginSequence(const SequenceInfo& info) override;
  Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache) override;
  // Keeps every token.
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;
  // Profiles every head and compresses as described above (nothing when the prompt fits the budget).
  Result<std::optional<at::Tensor>> EndPrefill(int layer, LayerKVCache& cache) override;

  // The policy (1-5 above) each KV head of `layer` chose at the end of the last prefill.
  std::vector<int64_t> profile(int layer) const;

 private:
  FastGenPolicy(CacheBudget budget, FastGenOptions options)
      : BudgetedPolicy(budget), options_(std::move(options)) {}
  FastGenOptions options_;
  std::vector<int64_t> prompt_ids_;
  std::vector<std::vector<int64_t>> profiles_;  // per layer
};

}  // namespace namm
