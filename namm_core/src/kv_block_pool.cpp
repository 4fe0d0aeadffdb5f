#include "namm/kv_block_pool.h"

#include <algorithm>
#include <limits>

#include <ATen/ops/index_put.h>
#include <ATen/ops/index_select.h>

#include "aten.h"

namespace namm {

Result<std::shared_ptr<KvBlockPool>> KvBlockPool::Create(int64_t block_tokens, int64_t head_dim,
                                                         at::TensorOptions options, int64_t max_blocks,
                                                         int64_t slab_blocks) {
  if (block_tokens <= 0 || block_tokens > (int64_t{1} << 20) || (block_tokens & (block_tokens - 1)) != 0) {
    return Status::InvalidArgument("KV block size must be a power of two from 1 to 2^20 tokens, got " +
                                   std::to_string(block_tokens));
  }
  if (head_dim <= 0) return Status::InvalidArgument("KV blocks need head_dim > 0, got " + std::to_string(head_dim));
  if (max_blocks < 0 || max_blocks > std::numeric_limits<int32_t>::max()) {
    return Status::InvalidArgument("a KV block pool holds 0 (no limit) to 2^31 - 1 blocks, got " +
                                   std::to_string(max_blocks));
  }
  if (slab_blocks <= 0) return Status::InvalidArgument("KV block slabs need at least one block");
  // A device's pool, or one not in float32, is read and written by tensor operations (Read, Write): one slab of
  // every block, allocated at once as vLLM allocates its pool. The host kernel reads float32 blocks through a
  // table of addresses, so the host's pool grows a slab at a time up to its limit: one allocation of the whole
  // default limit (half the free memory) cost the first request 70 ms here, and a second under AddressSanitizer.
  const bool by_tensor_ops = !options.device().is_cpu() || options.dtype().toScalarType() != at::kFloat;
  if (max_blocks > 0) slab_blocks = by_tensor_ops ? max_blocks : std::min(slab_blocks, max_blocks);
  return std::shared_ptr<KvBlockPool>(new KvBlockPool(block_tokens, head_dim, options, max_blocks, slab_blocks));
}

KvBlockPool::KvBlockPool(int64_t block_tokens, int64_t head_dim, at::TensorOptions options, int64_t max_blocks,
                         int64_t slab_blocks)
    : block_tokens_(block_tokens),
      block_shift_(0),
      head_dim_(head_dim),
      options_(options),
      max_blocks_(max_blocks),
      slab_blocks_(slab_blocks) {
  while ((int64_t{1} << block_shift_) < block_tokens_) ++block_shift_;
}

int64_t KvBlockPool::BlockBytes(int64_t block_tokens, int64_t head_dim, at::ScalarType dtype) {
  return 2 * block_tokens * head_dim * static_cast<int64_t>(c10::elementSize(dtype));
}

int64_t KvBlockPool::blocks_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

int64_t KvBlockPool::blocks_free() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return max_blocks_ > 0 ? max_blocks_ - in_use_ : -1;
}

int64_t KvBlockPool::blocks_allocated() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_ + static_cast<int64_t>(free_.size());
}

namespace {
constexpr const char* kExhausted = "the KV block pool is exhausted";
}  // namespace

bool KvBlockPool::IsExhausted(const Status& status) {
  return status.code() == Status::Code::kFailedPrecondition && status.message().find(kExhausted) != std::string::npos;
}

Status KvBlockPool::Allocate(int64_t count, std::vector<int32_t>& ids) {
  if (count <= 0) return Status::Ok();
  std::lock_guard<std::mutex> lock(mutex_);
  if (max_blocks_ > 0 && in_use_ + count > max_blocks_) {
    return Status::FailedPrecondition(std::string(kExhausted) + ": " + std::to_string(count) + " blocks asked, " +
                                      std::to_string(max_blocks_ - in_use_) + " of " + std::to_string(max_blocks_) +
                                      " free");
  }
  // New slabs until the free list covers the request. Not zero-filled: a block's rows are written before they
  // are read, and on the host pages never written cost no memory.
  while (static_cast<int64_t>(free_.size()) < count) {
    const auto first = static_cast<int64_t>(slabs_.size()) * slab_blocks_;
    // The last slab of a limited pool stops at the limit (only the last one is short: id / slab_blocks_ holds).
    const int64_t blocks = max_blocks_ > 0 ? std::min(slab_blocks_, max_blocks_ - first) : slab_blocks_;
    if (first + blocks > std::numeric_limits<int32_t>::max()) {
      return Status::FailedPrecondition("the KV block pool cannot address more than 2^31 blocks");
    }
    slabs_.push_back(at::empty({blocks, 2, block_tokens_, head_dim_}, options_));
    // Lowest ids handed out first (free_ is used from its back).
    for (int64_t i = blocks - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(first + i));
  }
  for (int64_t i = 0; i < count; ++i) {
    ids.push_back(free_.back());
    free_.pop_back();
  }
  in_use_ += count;
  return Status::Ok();
}

void KvBlockPool::Free(const int32_t* ids, int64_t count) {
  if (count <= 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t i = 0; i < count; ++i) free_.push_back(ids[i]);
  in_use_ -= count;
}

at::Tensor KvBlockPool::slab_of(int32_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slabs_.at(static_cast<std::size_t>(id / slab_blocks_));
}

bool KvBlockPool::one_slab() const { return max_blocks_ > 0 && slab_blocks_ >= max_blocks_; }

at::Tensor KvBlockPool::Read(const at::Tensor& ids, bool values) const {
  TORCH_CHECK(one_slab(), "KvBlockPool::Read needs a pool of one slab");
  if (ids.numel() == 0) return at::empty({0, block_tokens_, head_dim_}, options_);
  return slab_of(0).select(1, values ? 1 : 0).index_select(0, ids);
}

void KvBlockPool::Write(const at::Tensor& blocks, const at::Tensor& rows, const at::Tensor& keys,
                        const at::Tensor& values) {
  TORCH_CHECK(one_slab(), "KvBlockPool::Write needs a pool of one slab");
  if (blocks.numel() == 0) return;
  // Blocks held by the caller are not taken by anyone else, so writing them needs no lock beyond slab_of's.
  at::Tensor slab = slab_of(0);
  slab.select(1, 0).index_put_({blocks, rows}, keys);
  slab.select(1, 1).index_put_({blocks, rows}, values);
}

at::Tensor KvBlockPool::keys(int32_t id) const { return slab_of(id)[id % slab_blocks_][0]; }
at::Tensor KvBlockPool::values(int32_t id) const { return slab_of(id)[id % slab_blocks_][1]; }

const float* KvBlockPool::key_data(int32_t id) const {
  const at::Tensor slab = slab_of(id);
  return slab.data_ptr<float>() + (id % slab_blocks_) * 2 * block_tokens_ * head_dim_;
}

const float* KvBlockPool::value_data(int32_t id) const { return key_data(id) + block_tokens_ * head_dim_; }

}  // namespace namm
