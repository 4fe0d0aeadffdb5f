// Token selection: which cached tokens each KV head keeps after scoring (spec §5).
//
// All selections share the reference's rules:
//  - the newest token (the last cache slot) is always kept: its score is raised to +float max first;
//  - every head of a layer keeps the same number k of tokens (the layer's KV tensors stay rectangular); a head
//    with fewer qualifying tokens keeps its best-scoring non-qualifying ones too (they stay visible to the LLM)
//    — except in select_own_counts_on_host, our deliberate difference;
//  - each head keeps its k best-scoring tokens; among equal scores the more recent token wins (the reference
//    sorts ascending with a stable sort and drops the front);
//  - retained indices are returned in ascending (chronological) order.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "namm/selection_config.h"

namespace namm {

// scores [kv_heads, n] (n >= 1) -> retained indices [kv_heads, k] int64, per the rules above.
// selection_params: [selection_param_count(config)] (for kDynamic: theta).
at::Tensor select_tokens(const at::Tensor& scores, const SelectionConfig& config,
                         const at::Tensor& selection_params = at::Tensor());

// select_tokens of several score sets at once (a sequence's layers at one memory update, on a device): scores
// [count, kv_heads, n_max], set c's scores in its last n[c] columns (1 <= n[c] <= n_max; what the columns
// before hold is ignored). Returns each set's retained indices [kv_heads, k_c] into its own n[c] tokens, what
// select_tokens returns for that set alone, with at most one device-to-host transfer (every set's count).
std::vector<at::Tensor> select_tokens_padded(const at::Tensor& scores, const std::vector<int64_t>& n,
                                             const SelectionConfig& config,
                                             const at::Tensor& selection_params = at::Tensor());

// The building blocks, exposed for baseline policies and tests.
// `scores` with the newest slot raised to +float max.
at::Tensor force_keep_newest(const at::Tensor& scores);
// Each head's k best tokens (ties to the more recent), as ascending indices [kv_heads, k].
at::Tensor keep_top_k_per_head(const at::Tensor& scores, int64_t k);

// The same rules on float32 scores [heads][n] in host memory, without a tensor (the memory update of a batch):
// the newest slot of each head is raised in place, the kept indices are written to keep [heads][k] (resized),
// and k is returned. `order` is a workspace. log_threshold: theta of kDynamic, unused otherwise.
int64_t select_tokens_on_host(float* scores, int64_t heads, int64_t n, const SelectionConfig& config,
                              double log_threshold, std::vector<int64_t>& keep, std::vector<int64_t>& order);
// The same rules with each head keeping its own count instead of the layer's largest (a deliberate difference
// from the reference: NammPolicy::set_own_head_counts): head h keeps the tokens the rule keeps of its own —
// those not below the threshold (kBinary; kDynamic, at most its budget) or its `budget` best (kTopK) —, ranked
// as above, and no others. Head h holds slots [vacant[h], n) of the n (vacant null: all of them); the others are
// never kept. keep [heads][k] (resized), k the largest count: each row -1 for every slot its head leaves vacant,
// then its kept indices ascending (LayerKVCache::Gather). Returns k.
int64_t select_own_counts_on_host(float* scores, int64_t heads, int64_t n, const int64_t* vacant,
                                  const SelectionConfig& config, double log_threshold, std::vector<int64_t>& keep,
                                  std::vector<int64_t>& order);
// The max over heads of the tokens at or above threshold (as the reference counts them: a NaN score is not
// counted, though the ranking, which puts it first, then keeps it in place of a finite one), and
// keep_top_k_per_head, on host scores [heads][n] (keep: [heads][k]).
int64_t count_not_below_on_host(const float* scores, int64_t heads, int64_t n, float threshold);
void keep_top_k_on_host(const float* scores, int64_t heads, int64_t n, int64_t k, int64_t* keep,
                        std::vector<int64_t>& order);

}  // namespace namm
