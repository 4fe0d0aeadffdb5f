// The KV cache of one transformer layer, with per-token memory-policy state (spec §2, §5).
//
// For each KV head the cache holds its tokens in chronological order: post-RoPE key and value vectors, each
// token's absolute position, and any per-token state the memory policy keeps (e.g. the spectrogram EMA). Heads
// hold different tokens once eviction has happened, but always the same number of them. Gathering with
// per-head retained indices moves every per-token tensor together; positions never change, so a surviving
// token keeps its rotary phase and its recency.
//
// Storage has spare capacity that grows geometrically, so appending a decoded token costs O(1) amortized
// copies, never beyond a bound on the sequence's length when one is given (ExpectTokens), and it can be
// allocated whole up front when no token will be evicted. Spare capacity is not zero-filled: on the host, pages
// never written are never resident. Views returned by the accessors are valid until the
// next Append() or Gather().
//
// Keys and values may instead live in blocks of a shared KvBlockPool (a cache made with a pool): each (KV head)
// holds whole blocks of block_tokens tokens, taken as the cache grows and returned as soon as an eviction empties
// them, so what a sequence reserves follows what it holds to within a block per head, and freed memory serves
// other sequences at once. Positions and the policy's per-token state stay in the cache's own buffers. The numbers
// are the same bits either way (the attention kernel reads through the block table in key order); keys() and
// values() of a cache in blocks are copies.
//
// Heads keep the same number of tokens (the reference's selection rule, selection.h) unless a gather leaves slots
// vacant (a ragged cache, for a policy whose heads keep their own counts: NammPolicy::set_own_head_counts). Head h
// then holds only slots [vacant(h), size()): its first vacant(h) slots hold no token — zero keys and values, state
// zero, position -1 —, attention hides them, and in blocks they take no storage, so what a head drops goes back to
// the pool even when another head of the layer keeps more. The vacant slots are always a head's oldest, so the
// tensors stay rectangular [kv_heads, size, ...] for every reader and an append stays one row per head.
// Not thread-safe: one cache belongs to one sequence being generated.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "namm/kv_block_pool.h"
#include "namm/query_history.h"
#include "namm/status.h"

namespace namm {

// A per-token state tensor a memory policy keeps in the cache: [kv_heads, n, trailing_shape...].
// New tokens start at zero.
struct TokenStateSpec {
  std::string name;
  std::vector<int64_t> trailing_shape;
  at::ScalarType dtype = at::kFloat;
};

class LayerKVCache {
 public:
  // head_dim may be 0 for a cache that only tracks positions and policy state (e.g. scoring recorded attention).
  LayerKVCache(int64_t kv_heads, int64_t head_dim, at::TensorOptions options,
               std::vector<TokenStateSpec> token_state = {});
  // Keys and values in blocks of `pool` (its head_dim and dtype must be the cache's; throws otherwise), or, with
  // a null pool, in the cache's own buffers as above.
  LayerKVCache(int64_t kv_heads, int64_t head_dim, at::TensorOptions options, std::vector<TokenStateSpec> token_state,
               std::shared_ptr<KvBlockPool> pool);
  LayerKVCache(LayerKVCache&&) noexcept = default;
  LayerKVCache& operator=(LayerKVCache&&) noexcept = default;
  ~LayerKVCache() = default;

  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  // Slots per head: the tokens held, plus the vacant ones of a ragged cache.
  int64_t size() const { return size_; }
  // Per head, the leading slots that hold no token (a ragged cache), [kv_heads]; null when there are none.
  const int64_t* vacant() const { return ragged_ ? vacant_.data() : nullptr; }
  // Tokens held, all heads together (kv_heads x size() less the vacant slots).
  int64_t held_tokens() const;
  // Tokens ever appended (evicted ones included): the length of the sequence seen so far.
  int64_t tokens_seen() const { return tokens_seen_; }

  at::Device device() const { return options_.device(); }
  at::Tensor keys() const;       // [kv_heads, size, head_dim] (a copy for a cache in blocks; vacant slots zero)
  at::Tensor values() const;     // [kv_heads, size, head_dim] (a copy for a cache in blocks; vacant slots zero)
  // Whether keys and values live in a pool's blocks, and, for float32 ones on the host, the block table the CPU
  // attention kernel reads (valid until the next Append() or Gather()).
  bool in_blocks() const { return blocks_.pool != nullptr; }
  KvBlockView block_view() const;
  at::Tensor positions() const;  // [kv_heads, size] int64
  // The named per-token state, [kv_heads, size, trailing...]; writes through the view update the cache.
  // Throws if `name` was not declared at construction.
  at::Tensor state(const std::string& name) const;

  // Appends t new tokens to every head: keys/values [kv_heads, t, head_dim] (may be undefined when head_dim is
  // 0), positions [t] int64. Their policy state starts at zero. In blocks: FailedPrecondition, nothing appended,
  // when the pool has too few blocks left.
  Status Append(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& positions);

  // Keeps, per head, the tokens at `indices` [kv_heads, k] (int64, ascending, same k for every head). In blocks,
  // each head compacts within its blocks and returns those left empty to the pool. On the host a row may start
  // with -1 entries: that head keeps fewer tokens and leaves as many slots vacant (a ragged cache, above); a
  // head's indices name slots it holds.
  Status Gather(const at::Tensor& indices);

  // The sequence will append at most `total` tokens in all (evicted ones included): storage never grows past
  // room for the tokens still to come. With `allocate_now`, room for all of them is allocated at once (for a
  // policy that never evicts, so that the cache is never copied to grow).
  void ExpectTokens(int64_t total, bool allocate_now);
  // Tokens the storage of keys and values has room for, per head (the most of any head, in blocks).
  int64_t capacity() const;
  // Bytes of the keys and values held (all heads, vacant slots not counted), and of the policy's per-token state
  // held.
  int64_t kv_bytes() const;
  int64_t state_bytes() const;
  // Tokens of room a cache's storage starts with (it then doubles).
  static constexpr int64_t kInitialCapacity = 64;
  // The room a (rectangular) cache with room for `capacity` tokens grows to when it must hold `needed` more than
  // that: doubled (kInitialCapacity at least), never beyond `room` (what the rest of the sequence can fill),
  // never below `needed`. namm-api's admission follows a cache's growth with it.
  static int64_t GrowCapacity(int64_t capacity, int64_t needed, int64_t room);
  // Bytes of key and value storage allocated (room for capacity() tokens): what admission by memory counts. And
  // the same after `more` tokens were appended (the storage grows by doubling, within the tokens to come, or a
  // block at a time).
  int64_t reserved_kv_bytes() const;
  int64_t reserved_kv_bytes_after(int64_t more) const;

  // A copy that shares no storage with this cache (a prefix computed once, handed to several sequences), of the
  // same capacity, only the tokens held written (the rest of the room stays unwritten, so not resident); in
  // blocks, of the same pool: when the pool has too few blocks left, its exhausted status
  // (KvBlockPool::IsExhausted). Vacant slots stay vacant.
  Result<LayerKVCache> Clone() const;

  // The layer's latest queries, recorded by the engine for a policy that asks for them
  // (MemoryPolicy::query_history()); empty otherwise.
  QueryHistory& query_history() { return query_history_; }
  const QueryHistory& query_history() const { return query_history_; }

 private:
  void Reserve(int64_t capacity);
  // The capacity Reserve(capacity) leaves.
  int64_t GrownCapacity(int64_t capacity) const;
  // Keys and values of one token, every head.
  int64_t KvBytesPerToken() const;
  at::Tensor Live(const at::Tensor& buffer) const { return buffer.narrow(1, 0, size_); }
  // Recomputes live_ after the size or the storage changed.
  void RefreshViews();
  bool on_host() const;
  Status GatherOnHost(const at::Tensor& indices);
  // Checks GatherOnHost's indices; sets kept[h] to head h's count of kept tokens (the rest of its row is -1).
  Status CheckHostIndices(const int64_t* index, int64_t k, std::vector<int64_t>& kept) const;
  // Head h's blocks as the kernel's table, width() blocks per head (null past a head's own).
  void RefreshBlockTable();
  // The cache in blocks: what Append, Gather and the accessors do to keys and values there.
  Status AppendToBlocks(const at::Tensor& keys, const at::Tensor& values, int64_t t);
  void WriteRows(const at::Tensor& keys, const at::Tensor& values, int64_t first);
  void GatherInBlocks(const int64_t* index, int64_t k, const std::vector<int64_t>& kept);
  at::Tensor FromBlocks(bool values) const;
  int64_t BlocksFor(int64_t tokens) const;

  // Blocks held, per KV head, in token order; returned to the pool when the cache goes. Move-only.
  struct HeldBlocks {
    std::shared_ptr<KvBlockPool> pool;  // null: keys and values in buffers_
    std::vector<std::vector<int32_t>> ids;
    // ids' key and value addresses (float32 pools on the host; empty otherwise), head-major, for block_view().
    std::vector<const float*> key_rows, value_rows;
    HeldBlocks() = default;
    HeldBlocks(HeldBlocks&& other) noexcept { *this = std::move(other); }
    HeldBlocks& operator=(HeldBlocks&& other) noexcept;
    ~HeldBlocks() { Release(); }
    void Release();
    // The most blocks any head holds: the block table's width.
    int64_t width() const;
    int64_t total() const;
  };

  int64_t kv_heads_;
  int64_t head_dim_;
  at::TensorOptions options_;
  int64_t size_ = 0;
  int64_t tokens_seen_ = 0;
  int64_t capacity_ = 0;
  int64_t expected_tokens_ = 0;  // 0: no bound given
  std::vector<int64_t> vacant_;  // [kv_heads]: each head's vacant leading slots
  bool ragged_ = false;          // some head has vacant slots
  // Every per-token buffer, [kv_heads, capacity, ...]: keys, values, positions, then the declared states.
  std::vector<std::string> names_;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> live_;  // buffers_[i].narrow(1, 0, size_): the accessors' views, made once per change
  HeldBlocks blocks_;
  QueryHistory query_history_;
};

}  // namespace namm
