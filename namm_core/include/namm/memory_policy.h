// The memory-policy interface: how an inference engine asks which KV-cache tokens to keep (spec §1.4, §2).
//
// Protocol for one layer of one sequence:
//  1. After each forward chunk (prefill chunk or decoded token) has been appended to the layer's cache and its
//     attention computed, the engine calls Observe() with the chunk's attention probabilities, if the policy
//     needs_attention(). The policy folds them into its per-token state, so no attention matrix outlives the
//     chunk: memory stays O(n) per layer.
//  2. At each memory update (the reference: whenever the sequence length reaches a multiple of n_up = 512),
//     the engine calls Select() and keeps the returned tokens (apply_memory_update does both).
// A policy object serves one sequence at a time and is not thread-safe; per-token state lives in the caches.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "namm/kv_cache.h"
#include "namm/status.h"

namespace namm {

class MemoryPolicy {
 public:
  virtual ~MemoryPolicy() = default;

  // Short description, e.g. "namm(bam, 4172 params)" or "h2o(budget=1024, recent=512)".
  virtual std::string name() const = 0;

  // Per-token state this policy keeps in every layer's cache; create caches with it.
  virtual std::vector<TokenStateSpec> token_state() const { return {}; }

  // Whether Observe() uses attention probabilities (engines may skip computing them otherwise).
  virtual bool needs_attention() const { return false; }

  // attention: [q_heads, n_q, cache.size()] probabilities of the chunk's n_q queries (the last n_q tokens
  // appended to `cache`) over every cached key, zero for keys after the query.
  virtual Status Observe(int layer, const at::Tensor& attention, LayerKVCache& cache);

  // Retained indices [kv_heads, k]: int64, ascending per head, the same k for every head, the newest token
  // (last slot) included. Called at a memory update, after the Observe() of the chunk that completed it.
  virtual Result<at::Tensor> Select(int layer, LayerKVCache& cache) = 0;
};

// Select() then LayerKVCache::Gather(): one memory update of one layer.
Status apply_memory_update(MemoryPolicy& policy, int layer, LayerKVCache& cache);

// Keeps every token (the base model).
class FullCachePolicy final : public MemoryPolicy {
 public:
  std::string name() const override { return "full"; }
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;
};

// Indices 0..n-1 for every head: [kv_heads, n] int64 on `cache`'s device.
at::Tensor all_token_indices(const LayerKVCache& cache);

// Checks an Observe() argument against the cache; `kv_heads` must divide the attention's q_heads.
Status validate_observed_attention(const at::Tensor& attention, const LayerKVCache& cache);

}  // namespace namm
