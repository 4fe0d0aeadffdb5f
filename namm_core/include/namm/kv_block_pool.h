// A shared pool of KV blocks: the storage of caches kept in blocks (LayerKVCache with a pool).
//
// A block holds the keys and values of block_tokens consecutive cached tokens of one KV head of one layer, as
// vLLM's PagedAttention and KV-Compress keep them: a sequence holds whole blocks per (layer, KV head), so memory is
// reserved a block at a time instead of by doubling a rectangular buffer, and blocks an eviction empties go back
// to the pool for any other sequence. Storage grows in slabs of blocks that never move (a block's address is
// stable while it is held), up to max_blocks when one is given. Thread-safe: the engine appends the layers of
// several sequences at once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "namm/status.h"

namespace namm {

// One layer's keys and values in blocks, as the CPU attention kernel reads them (float32 on the host): KV head h's
// token j is row j & (2^block_shift - 1) (rows head_dim floats apart) of the block whose keys start at
// keys[h * blocks_per_head + (j >> block_shift)], its values at values[...] likewise.
struct KvBlockView {
  const float* const* keys = nullptr;
  const float* const* values = nullptr;
  int64_t kv_heads = 0, head_dim = 0;
  int64_t tokens = 0;  // per head
  int64_t blocks_per_head = 0;
  int block_shift = 0;
};

class KvBlockPool {
 public:
  // block_tokens: a power of two. max_blocks: at most this many blocks held at once (0: no limit). Storage is
  // allocated with `options` (dtype and device) as blocks are first taken, slab_blocks at a time, up to max_blocks;
  // except that a limited pool whose blocks are read by tensor operations (on a device, or not float32) is one slab
  // of max_blocks, allocated at the first block as vLLM allocates its pool, so that Read and Write are one tensor
  // operation each.
  static Result<std::shared_ptr<KvBlockPool>> Create(int64_t block_tokens, int64_t head_dim, at::TensorOptions options,
                                                     int64_t max_blocks = 0, int64_t slab_blocks = 1024);

  int64_t block_tokens() const { return block_tokens_; }
  int block_shift() const { return block_shift_; }
  int64_t head_dim() const { return head_dim_; }
  const at::TensorOptions& options() const { return options_; }
  // Bytes of one block's keys and values.
  int64_t block_bytes() const { return BlockBytes(block_tokens_, head_dim_, options_.dtype().toScalarType()); }
  static int64_t BlockBytes(int64_t block_tokens, int64_t head_dim, at::ScalarType dtype);
  int64_t max_blocks() const { return max_blocks_; }
  int64_t blocks_in_use() const;
  // Blocks that can still be taken (max_blocks - in use; -1 without a limit).
  int64_t blocks_free() const;
  // Blocks whose storage has been allocated (held or not): the slabs made so far.
  int64_t blocks_allocated() const;

  // Takes `count` blocks, appending their ids to `ids`; FailedPrecondition (and nothing taken) when fewer are
  // left.
  Status Allocate(int64_t count, std::vector<int32_t>& ids);
  // Whether `status` is Allocate's (or an append's through it) for a pool without enough free blocks.
  static bool IsExhausted(const Status& status);
  // Returns blocks taken by Allocate.
  void Free(const int32_t* ids, int64_t count);

  // Block `id`'s keys and values: [block_tokens, head_dim] each, rows contiguous; views into storage that stays put
  // while the block is held.
  at::Tensor keys(int32_t id) const;
  at::Tensor values(int32_t id) const;
  // Whether the pool is one slab (Read and Write are then one tensor operation each).
  bool one_slab() const;
  // Keys (or values) of blocks `ids` (int64 on the pool's device), [ids, block_tokens, head_dim]. One slab only.
  at::Tensor Read(const at::Tensor& ids, bool values) const;
  // Row rows[i] of block blocks[i] (int64 on the pool's device) becomes keys[i] and values[i] ([n, head_dim]).
  // One slab only.
  void Write(const at::Tensor& blocks, const at::Tensor& rows, const at::Tensor& keys, const at::Tensor& values);
  // Their first elements (float32 storage only): what the CPU attention kernel reads through a block table.
  const float* key_data(int32_t id) const;
  const float* value_data(int32_t id) const;

  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

 private:
  KvBlockPool(int64_t block_tokens, int64_t head_dim, at::TensorOptions options, int64_t max_blocks,
              int64_t slab_blocks);
  // Slab s's storage: [slab_blocks, 2, block_tokens, head_dim].
  at::Tensor slab_of(int32_t id) const;  // a handle: slabs_ may grow meanwhile

  int64_t block_tokens_;
  int block_shift_;
  int64_t head_dim_;
  at::TensorOptions options_;
  int64_t max_blocks_;
  int64_t slab_blocks_;
  mutable std::mutex mutex_;
  std::vector<at::Tensor> slabs_;  // only appended to, under mutex_; a slab's tensor never changes
  std::vector<int32_t> free_;      // ids of blocks allocated in slabs and not held
  int64_t in_use_ = 0;
};

}  // namespace namm
