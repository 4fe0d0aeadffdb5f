// The memory-policy interface: how an inference engine asks which KV-cache tokens to keep (spec §1.4, §2).
//
// Protocol for one sequence:
//  0. BeginSequence() once, with the prompt, before the first token.
//  Then, for each layer:
//  1. After each forward chunk (prefill chunk, decoded or teacher-forced tokens) has been appended to the
//  layer's
//     cache and its attention computed, the engine calls Observe() with the chunk's attention probabilities,
//     if the policy needs_attention(). The policy folds them into its per-token state, so no attention matrix
//     outlives the chunk: memory stays O(n) per layer.
//  2. At each memory update (the reference: whenever the sequence length reaches a multiple of n_up = 512),
//     the engine calls Select() and keeps the returned tokens (apply_memory_update does both).
//  3. Once the whole prompt has been processed (after step 1 and, if one fell there, step 2 of its last
//  chunk),
//     the engine calls EndPrefill(): policies that compress the prompt once (SnapKV, FastGen) do it there.
// A policy object serves one sequence at a time and is not thread-safe; per-token state lives in the caches.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "namm/kv_cache.h"
#include "namm/status.h"

namespace namm {

// What the engine tells a policy about the sequence it is about to serve.
struct SequenceInfo {
  // The prefill tokens, BOS included. Tokens after them are decoded (or, for teacher-forced scoring, given).
  std::vector<int64_t> prompt_ids;
};

// Engines hand attention to Observe() in blocks of query rows of at most this many probabilities (q_heads x rows x
// cached keys, float32: 16 MiB), and a policy that computes attention again keeps to the same bound.
constexpr int64_t kAttentionBlockElements = int64_t{1} << 22;
// On a GPU, blocks of up to this many (256 MiB): there, each block costs launches, not cache misses (a 128-token
// chunk over 16k cached tokens was 8 blocks, so 8 Observe calls and their launches).
constexpr int64_t kDeviceAttentionBlockElements = int64_t{1} << 26;

class MemoryPolicy;

// One layer's memory update of one sequence (apply_memory_updates).
struct MemoryUpdate {
  MemoryPolicy* policy = nullptr;
  int layer = 0;
  LayerKVCache* cache = nullptr;
};

class MemoryPolicy {
 public:
  virtual ~MemoryPolicy() = default;

  // Short description, e.g. "namm(bam, 4172 params)" or "h2o(budget=1024, recent=512)".
  virtual std::string name() const = 0;

  // Per-token state this policy keeps in every layer's cache; create caches with it.
  virtual std::vector<TokenStateSpec> token_state() const { return {}; }

  // Whether Observe() uses attention probabilities (engines may skip computing them otherwise).
  virtual bool needs_attention() const { return false; }

  // How many of each layer's latest queries the engine must keep in the cache's QueryHistory, with the
  // log-sum-exp of their scores, so that Observe() can compute the attention they paid again (0: none).
  virtual int64_t query_history() const { return 0; }

  // Bytes the policy holds for its sequence outside the caches (reported with the per-token state).
  virtual int64_t state_bytes() const { return 0; }

  // Whether Select() or EndPrefill() may ever drop a token. Engines preallocate the whole sequence's cache for a
  // policy that never evicts.
  virtual bool may_evict() const { return true; }

  // Starts a sequence. Budgets given as a share of the prompt are resolved here. The default does nothing.
  virtual Status BeginSequence(const SequenceInfo& info);

  // attention: [q_heads, n_q, cache.size()] probabilities of the queries with absolute sequence indices
  // first_query .. first_query + n_q - 1 over every cached key, zero for keys after the query. The queries are
  // tokens already appended to `cache`; an engine may observe a chunk's queries in several calls, in order.
  virtual Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache);

  // Retained indices [kv_heads, k]: int64, ascending per head, the same k for every head, the newest token
  // (last slot) included. Called at a memory update, after the Observe() of the chunk that completed it.
  virtual Result<at::Tensor> Select(int layer, LayerKVCache& cache) = 0;

  // Select() of several updates at once, in order: this policy's and those of other policies of the same class
  // (other sequences of a batch, or other layers). The default calls each one's Select(); a policy that can share
  // the work overrides it (a batch of NAMMs scores every sequence's tokens in one pass of our kernels). Each
  // result equals what that update's Select() alone returns; on a device, up to the rounding of scores computed
  // at another shape (NammPolicy scores a sequence's layers together there, and an error in that pass is each of
  // its updates').
  virtual std::vector<Result<at::Tensor>> SelectTogether(const std::vector<MemoryUpdate>& updates);

  // Prefix sharing. Sequences with the same prompt may run their first tokens, up to the first memory update, once
  // and copy the result (caches, then this state through AdoptPrefix) if their policies would observe and keep
  // exactly the same over them: policies that can say so return a key, equal exactly when that holds ("" never
  // shares, the default). The engine then calls AdoptPrefix(leader) on each follower, whose caches already hold the
  // leader's, before the first update.
  virtual std::string prefix_key() const { return ""; }
  virtual void AdoptPrefix(const MemoryPolicy& /*leader*/) {}

  // Called once per layer at the end of the prompt. Returns retained indices as Select() does, or
  // std::nullopt to leave the cache as it is (the default, for policies that evict only at memory updates).
  virtual Result<std::optional<at::Tensor>> EndPrefill(int layer, LayerKVCache& cache);
};

// Select() then LayerKVCache::Gather(): one memory update of one layer.
Status apply_memory_update(MemoryPolicy& policy, int layer, LayerKVCache& cache);
// apply_memory_update of many updates (each with its own cache): policies of one class select together
// (SelectTogether), then each cache keeps its tokens. Statuses in order; a failure is its update's alone, but
// for a selection that failed for all of the updates it served together.
std::vector<Status> apply_memory_updates(const std::vector<MemoryUpdate>& updates);
// EndPrefill() then, if it chose tokens, LayerKVCache::Gather(). Returns whether the cache was compressed.
Result<bool> apply_end_of_prefill(MemoryPolicy& policy, int layer, LayerKVCache& cache);

// Indices 0..n-1 for every head: [kv_heads, n] int64 on `cache`'s device.
at::Tensor all_token_indices(const LayerKVCache& cache);

// Observe() of queries that are the newest attention.size(1) tokens of `cache` (a whole chunk at once).
Status observe_newest(MemoryPolicy& policy, int layer, const at::Tensor& attention, LayerKVCache& cache);

// Checks Observe()'s arguments against the cache; `kv_heads` must divide the attention's q_heads.
Status validate_observed_attention(const at::Tensor& attention, int64_t first_query, const LayerKVCache& cache);

// The rows [begin, end) of an observed block's query axis that are among the last `window` queries of a
// prompt of `prompt_tokens` (begin == end when none are): the observation window of SnapKV and FastGen.
std::pair<int64_t, int64_t> prompt_window_rows(const at::Tensor& attention, int64_t first_query,
                                               int64_t prompt_tokens, int64_t window);

}  // namespace namm
