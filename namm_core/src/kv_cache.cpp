#include "namm/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "aten.h"
#include "host_rows.h"
#include "namm/dtype.h"
#include "namm/tensor_view.h"

namespace namm {

namespace {
constexpr std::size_t kKeys = 0, kValues = 1, kPositions = 2;
}  // namespace

LayerKVCache::LayerKVCache(int64_t kv_heads, int64_t head_dim, at::TensorOptions options,
                           std::vector<TokenStateSpec> token_state)
    : kv_heads_(kv_heads), head_dim_(head_dim), options_(options) {
  TORCH_CHECK(kv_heads > 0 && head_dim >= 0, "a KV cache needs kv_heads > 0 and head_dim >= 0");
  auto add = [&](const std::string& name, std::vector<int64_t> trailing, at::ScalarType dtype) {
    std::vector<int64_t> shape = {kv_heads, 0};
    shape.insert(shape.end(), trailing.begin(), trailing.end());
    names_.push_back(name);
    buffers_.push_back(at::zeros(shape, options.dtype(dtype)));
  };
  add("keys", {head_dim}, options.dtype().toScalarType());
  add("values", {head_dim}, options.dtype().toScalarType());
  add("positions", {}, at::kLong);
  for (const auto& spec : token_state) {
    for (const auto& existing : names_) {
      TORCH_CHECK(existing != spec.name, "duplicate per-token state '", spec.name, "'");
    }
    add(spec.name, spec.trailing_shape, spec.dtype);
  }
  vacant_.assign(static_cast<std::size_t>(kv_heads), 0);
  RefreshViews();
}

LayerKVCache::LayerKVCache(int64_t kv_heads, int64_t head_dim, at::TensorOptions options,
                           std::vector<TokenStateSpec> token_state, std::shared_ptr<KvBlockPool> pool)
    : LayerKVCache(kv_heads, head_dim, options, std::move(token_state)) {
  if (pool == nullptr) return;
  TORCH_CHECK(pool->head_dim() == head_dim && pool->options().dtype() == options.dtype() &&
                  pool->options().device() == options.device(),
              "the KV block pool holds heads of ", pool->head_dim(), " ", pool->options().dtype(), " on ",
              pool->options().device(), ", not the cache's ", head_dim, " ", options.dtype(), " on ", options.device());
  blocks_.pool = std::move(pool);
  blocks_.ids.resize(static_cast<std::size_t>(kv_heads));
}

LayerKVCache::HeldBlocks& LayerKVCache::HeldBlocks::operator=(HeldBlocks&& other) noexcept {
  if (this != &other) {
    Release();
    pool = std::move(other.pool);
    ids = std::move(other.ids);
    key_rows = std::move(other.key_rows);
    value_rows = std::move(other.value_rows);
    other.pool = nullptr;
    other.ids.clear();
  }
  return *this;
}

int64_t LayerKVCache::HeldBlocks::width() const {
  std::size_t most = 0;
  for (const auto& head : ids) most = std::max(most, head.size());
  return static_cast<int64_t>(most);
}

int64_t LayerKVCache::HeldBlocks::total() const {
  int64_t count = 0;
  for (const auto& head : ids) count += static_cast<int64_t>(head.size());
  return count;
}

void LayerKVCache::HeldBlocks::Release() {
  if (pool == nullptr) return;
  for (const auto& head : ids) pool->Free(head.data(), static_cast<int64_t>(head.size()));
  for (auto& head : ids) head.clear();
  key_rows.clear();
  value_rows.clear();
}

at::Tensor LayerKVCache::keys() const { return in_blocks() ? FromBlocks(false) : live_[kKeys]; }
at::Tensor LayerKVCache::values() const { return in_blocks() ? FromBlocks(true) : live_[kValues]; }

at::Tensor LayerKVCache::FromBlocks(bool values) const {
  const KvBlockPool& pool = *blocks_.pool;
  if (pool.one_slab() && !ragged_) {  // one read of every head's blocks (a ragged cache's heads hold different counts)
    std::vector<int64_t> ids;
    for (const auto& head : blocks_.ids) ids.insert(ids.end(), head.begin(), head.end());
    const at::Tensor index = at::tensor(ids, at::TensorOptions().dtype(at::kLong).device(at::kCPU)).to(options_.device());
    return pool.Read(index, values).view({kv_heads_, blocks_.width() * pool.block_tokens(), head_dim_}).narrow(1, 0, size_);
  }
  at::Tensor out = ragged_ ? at::zeros({kv_heads_, size_, head_dim_}, options_) : at::empty({kv_heads_, size_, head_dim_}, options_);
  const int64_t block = pool.block_tokens();
  const bool host_float = pool.options().device().is_cpu() && pool.options().dtype() == at::kFloat;
  // On the host in float32 each block's rows are copied from their address (the block table the kernel reads,
  // when there is one): a tensor operation per block was 3% of a training worker's time.
  const KvBlockView view = block_view();
  float* to = host_float ? out.data_ptr<float>() : nullptr;
  const float* const* table = values ? view.values : view.keys;
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const std::vector<int32_t>& head = blocks_.ids[static_cast<std::size_t>(h)];
    // Block b holds the head's slots vacant + b * block on (the vacant ones stay zero).
    const int64_t vacant = vacant_[static_cast<std::size_t>(h)], held = size_ - vacant;
    for (int64_t b = 0, j = 0; j < held; ++b, j += block) {
      const int32_t id = head[static_cast<std::size_t>(b)];
      const int64_t rows = std::min(block, held - j);
      if (!host_float) {
        out[h].narrow(0, vacant + j, rows).copy_((values ? pool.values(id) : pool.keys(id)).narrow(0, 0, rows));
        continue;
      }
      const float* from = table != nullptr ? table[h * view.blocks_per_head + b]
                                           : (values ? pool.value_data(id) : pool.key_data(id));
      std::memcpy(to + (h * size_ + vacant + j) * head_dim_, from,
                  static_cast<std::size_t>(rows * head_dim_) * sizeof(float));
    }
  }
  return out;
}

KvBlockView LayerKVCache::block_view() const {
  KvBlockView view;
  if (!in_blocks() || blocks_.key_rows.empty() ||
      blocks_.key_rows.size() != static_cast<std::size_t>(kv_heads_ * blocks_.width())) {
    return view;
  }
  view.keys = blocks_.key_rows.data();
  view.values = blocks_.value_rows.data();
  view.kv_heads = kv_heads_;
  view.head_dim = head_dim_;
  view.tokens = size_;
  view.blocks_per_head = blocks_.width();
  view.block_shift = blocks_.pool->block_shift();
  return view;
}

int64_t LayerKVCache::BlocksFor(int64_t tokens) const {
  const int64_t block = blocks_.pool->block_tokens();
  return (tokens + block - 1) / block;
}

at::Tensor LayerKVCache::positions() const { return live_[kPositions]; }

at::Tensor LayerKVCache::state(const std::string& name) const {
  for (std::size_t i = kPositions + 1; i < names_.size(); ++i) {
    if (names_[i] == name) return live_[i];
  }
  TORCH_CHECK(false, "the KV cache has no per-token state '", name, "'");
}

Result<LayerKVCache> LayerKVCache::Clone() const {
  LayerKVCache copy(kv_heads_, head_dim_, options_);
  copy.size_ = size_;
  copy.tokens_seen_ = tokens_seen_;
  copy.capacity_ = capacity_;
  copy.expected_tokens_ = expected_tokens_;
  copy.vacant_ = vacant_;
  copy.ragged_ = ragged_;
  copy.names_ = names_;
  copy.buffers_.clear();
  // Token slots run along dimension 1 of every buffer: the held ones are copied, the room after them is not
  // touched (a full cache reserves its whole allowance up front: cloning it made all of it resident).
  for (const at::Tensor& buffer : buffers_) {
    at::Tensor room = at::empty_like(buffer);
    const int64_t held = buffer.dim() > 1 ? std::min(size_, buffer.size(1)) : 0;  // pooled keys: no slots
    if (held > 0) {
      narrow_view(room, 1, 0, held).copy_(narrow_view(buffer, 1, 0, held));
    } else if (buffer.dim() <= 1) {
      room.copy_(buffer);
    }
    copy.buffers_.push_back(std::move(room));
  }
  copy.query_history_ = query_history_.Clone();
  if (in_blocks()) {
    copy.blocks_.pool = blocks_.pool;
    copy.blocks_.ids.resize(static_cast<std::size_t>(kv_heads_));
    copy.size_ = 0;
    if (Status appended = copy.AppendToBlocks(keys(), values(), size_); !appended.ok()) {
      return appended.WithContext("copying a KV cache");
    }
    copy.size_ = size_;
  }
  copy.RefreshViews();
  return copy;
}

void LayerKVCache::RefreshViews() {
  live_.resize(buffers_.size());
  for (std::size_t i = 0; i < buffers_.size(); ++i) {
    const bool pooled = in_blocks() && (i == kKeys || i == kValues);  // their buffers stay empty
    live_[i] = pooled ? buffers_[i] : narrow_view(buffers_[i], 1, 0, size_);
  }
}

int64_t LayerKVCache::held_tokens() const {
  int64_t held = kv_heads_ * size_;
  for (const int64_t v : vacant_) held -= v;
  return held;
}

int64_t LayerKVCache::kv_bytes() const { return held_tokens() * (KvBytesPerToken() / kv_heads_); }

int64_t LayerKVCache::capacity() const {
  return in_blocks() ? blocks_.width() * blocks_.pool->block_tokens() : capacity_;
}

int64_t LayerKVCache::reserved_kv_bytes() const {
  if (in_blocks()) return blocks_.total() * blocks_.pool->block_tokens() * (KvBytesPerToken() / kv_heads_);
  return capacity_ * KvBytesPerToken();
}

int64_t LayerKVCache::reserved_kv_bytes_after(int64_t more) const {
  if (in_blocks()) {
    int64_t blocks = 0;
    for (int64_t h = 0; h < kv_heads_; ++h) {
      const auto head = static_cast<std::size_t>(h);
      blocks += std::max(static_cast<int64_t>(blocks_.ids[head].size()), BlocksFor(size_ - vacant_[head] + more));
    }
    return blocks * blocks_.pool->block_tokens() * (KvBytesPerToken() / kv_heads_);
  }
  return GrownCapacity(size_ + more) * KvBytesPerToken();
}

int64_t LayerKVCache::KvBytesPerToken() const {
  return 2 * kv_heads_ * head_dim_ * static_cast<int64_t>(buffers_[kKeys].element_size());
}

int64_t LayerKVCache::GrowCapacity(int64_t capacity, int64_t needed, int64_t room) {
  return std::max(needed, std::min(std::max({needed, 2 * capacity, kInitialCapacity}), room));
}

int64_t LayerKVCache::GrownCapacity(int64_t capacity) const {
  if (capacity <= capacity_) return capacity_;
  // No room beyond what the rest of the sequence can fill (expected_tokens_ counts evicted tokens too).
  const int64_t room = expected_tokens_ > 0 ? size_ + expected_tokens_ - tokens_seen_
                                            : std::numeric_limits<int64_t>::max();
  return GrowCapacity(capacity_, capacity, room);
}

int64_t LayerKVCache::state_bytes() const {
  int64_t bytes = 0;
  for (std::size_t i = kPositions + 1; i < buffers_.size(); ++i) {
    bytes += buffers_[i].numel() / std::max<int64_t>(1, capacity_) * size_ * static_cast<int64_t>(buffers_[i].element_size());
  }
  return bytes;
}

bool LayerKVCache::on_host() const { return buffers_[kPositions].device().is_cpu(); }

void LayerKVCache::ExpectTokens(int64_t total, bool allocate_now) {
  expected_tokens_ = total;
  // In blocks, keys and values take a block when they need one: nothing is reserved ahead.
  if (allocate_now && !in_blocks()) Reserve(size_ + std::max<int64_t>(0, total - tokens_seen_));
}

void LayerKVCache::Reserve(int64_t capacity) {
  if (capacity <= capacity_) return;
  const int64_t grown = GrownCapacity(capacity);
  for (std::size_t i = 0; i < buffers_.size(); ++i) {
    at::Tensor& buffer = buffers_[i];
    if (in_blocks() && (i == kKeys || i == kValues)) continue;  // in the pool's blocks
    std::vector<int64_t> shape = buffer.sizes().vec();
    shape[1] = grown;
    // Not zero-filled: nothing reads past size_ (Append writes every row it adds, state rows included), and the
    // host's untouched pages then cost no memory.
    at::Tensor bigger = at::empty(shape, buffer.options());
    bigger.narrow(1, 0, size_).copy_(buffer.narrow(1, 0, size_));
    buffer = bigger;
  }
  capacity_ = grown;
  RefreshViews();
}

Status LayerKVCache::Append(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& positions) {
  if (!positions.defined() || positions.dim() != 1) {
    return Status::InvalidArgument("positions of appended tokens must be a 1-D tensor [t]");
  }
  const int64_t t = positions.size(0);
  for (const at::Tensor* tensor : {&keys, &values}) {
    if (head_dim_ == 0 && !tensor->defined()) continue;
    if (!tensor->defined() || tensor->dim() != 3 || tensor->size(0) != kv_heads_ || tensor->size(1) != t ||
        tensor->size(2) != head_dim_) {
      const std::vector<int64_t> kv_shape = {kv_heads_, t, head_dim_};
      return Status::InvalidArgument("appended keys/values must be " + shape_to_string(kv_shape) + ", got " +
                                     (tensor->defined() ? shape_to_string(tensor->sizes().vec()) : "nothing"));
    }
  }
  if (t == 0) return Status::Ok();
  if (in_blocks() && head_dim_ > 0) NAMM_RETURN_IF_ERROR(AppendToBlocks(keys, values, t));
  Reserve(size_ + t);
  // On the host the rows are copied in place (the engine appends every layer's chunk of every sequence: a
  // tensor operation per buffer was most of an append's time); elsewhere by tensor operations.
  const bool host = on_host() && positions.device().is_cpu() && positions.scalar_type() == at::kLong &&
                    (head_dim_ == 0 || in_blocks() ||
                     (internal::host_rows(keys, buffers_[kKeys]) && internal::host_rows(values, buffers_[kValues])));
  const bool rectangular_kv = head_dim_ > 0 && !in_blocks();
  if (host) {
    if (rectangular_kv) {
      internal::copy_rows_on_host(keys, buffers_[kKeys], size_);
      internal::copy_rows_on_host(values, buffers_[kValues], size_);
    }
    const int64_t* p = positions.data_ptr<int64_t>();
    const int64_t step = positions.stride(0);
    int64_t* slots = buffers_[kPositions].data_ptr<int64_t>();
    for (int64_t h = 0; h < kv_heads_; ++h) {
      for (int64_t i = 0; i < t; ++i) slots[h * capacity_ + size_ + i] = p[i * step];
    }
    for (std::size_t i = kPositions + 1; i < buffers_.size(); ++i) {
      const at::Tensor& buffer = buffers_[i];
      const int64_t row = buffer.numel() / (kv_heads_ * capacity_) * static_cast<int64_t>(buffer.element_size());
      auto* base = static_cast<char*>(buffer.data_ptr());
      for (int64_t h = 0; h < kv_heads_; ++h) {
        std::memset(base + (h * capacity_ + size_) * row, 0, static_cast<std::size_t>(t * row));
      }
    }
  } else {
    if (rectangular_kv) {
      buffers_[kKeys].narrow(1, size_, t).copy_(keys);
      buffers_[kValues].narrow(1, size_, t).copy_(values);
    }
    buffers_[kPositions].narrow(1, size_, t).copy_(positions.unsqueeze(0).expand({kv_heads_, t}));
    for (std::size_t i = kPositions + 1; i < buffers_.size(); ++i) buffers_[i].narrow(1, size_, t).zero_();
  }
  size_ += t;
  tokens_seen_ += t;
  RefreshViews();
  return Status::Ok();
}

Status LayerKVCache::AppendToBlocks(const at::Tensor& keys, const at::Tensor& values, int64_t t) {
  KvBlockPool& pool = *blocks_.pool;
  // Head h's slot j (j >= its vacant slots) is row j - vacant of its blocks.
  int64_t wanted = 0;
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const auto head = static_cast<std::size_t>(h);
    wanted += std::max<int64_t>(0, BlocksFor(size_ + t - vacant_[head]) - static_cast<int64_t>(blocks_.ids[head].size()));
  }
  if (wanted > 0) {
    std::vector<int32_t> taken;
    NAMM_RETURN_IF_ERROR(pool.Allocate(wanted, taken));
    auto next = taken.begin();
    for (int64_t h = 0; h < kv_heads_; ++h) {
      auto& head = blocks_.ids[static_cast<std::size_t>(h)];
      const int64_t more = BlocksFor(size_ + t - vacant_[static_cast<std::size_t>(h)]) - static_cast<int64_t>(head.size());
      if (more <= 0) continue;
      head.insert(head.end(), next, next + more);
      next += more;
    }
  }
  const int64_t block = pool.block_tokens(), mask = block - 1;
  const int shift = pool.block_shift();
  const bool host_float = pool.options().device().is_cpu() && pool.options().dtype() == at::kFloat &&
                          keys.device().is_cpu() && values.device().is_cpu() && keys.scalar_type() == at::kFloat &&
                          values.scalar_type() == at::kFloat && keys.stride(2) == 1 && values.stride(2) == 1;
  if (host_float) {
    // The table's addresses are looked up again only when blocks were taken (or it was dropped).
    const int64_t width = blocks_.width();
    if (wanted > 0 || blocks_.key_rows.size() != static_cast<std::size_t>(kv_heads_ * width)) RefreshBlockTable();
    const auto row_bytes = static_cast<int64_t>(head_dim_ * sizeof(float));
    for (int64_t h = 0; h < kv_heads_; ++h) {
      const float* k = keys.data_ptr<float>() + h * keys.stride(0);
      const float* v = values.data_ptr<float>() + h * values.stride(0);
      const int64_t vacant = vacant_[static_cast<std::size_t>(h)];
      for (int64_t i = 0; i < t; ++i) {
        if (size_ + i < vacant) continue;  // a clone's vacant slots
        const int64_t j = size_ + i - vacant, slot = h * width + (j >> shift), row = (j & mask) * head_dim_;
        // The blocks are the pool's, written through its storage (key_rows only reads).
        internal::copy_row(reinterpret_cast<char*>(const_cast<float*>(blocks_.key_rows[static_cast<std::size_t>(slot)] + row)),
                           reinterpret_cast<const char*>(k + i * keys.stride(1)), row_bytes);
        internal::copy_row(reinterpret_cast<char*>(const_cast<float*>(blocks_.value_rows[static_cast<std::size_t>(slot)] + row)),
                           reinterpret_cast<const char*>(v + i * values.stride(1)), row_bytes);
      }
    }
    return Status::Ok();
  }
  blocks_.key_rows.clear();
  blocks_.value_rows.clear();
  WriteRows(keys, values, size_);
  return Status::Ok();
}

void LayerKVCache::RefreshBlockTable() {
  const KvBlockPool& pool = *blocks_.pool;
  const int64_t width = blocks_.width();
  blocks_.key_rows.assign(static_cast<std::size_t>(kv_heads_ * width), nullptr);
  blocks_.value_rows.assign(blocks_.key_rows.size(), nullptr);
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const auto& head = blocks_.ids[static_cast<std::size_t>(h)];
    for (std::size_t b = 0; b < head.size(); ++b) {
      blocks_.key_rows[static_cast<std::size_t>(h * width) + b] = pool.key_data(head[b]);
      blocks_.value_rows[static_cast<std::size_t>(h * width) + b] = pool.value_data(head[b]);
    }
  }
}

// Off the host kernel's path, by tensor operations: one write of every row where the pool is one slab (a device's
// pool with a limit), else a copy per block and head. keys/values [kv_heads, t, head_dim] are slots first.. of
// every head; a head's vacant slots among them are not written (its blocks start after them).
void LayerKVCache::WriteRows(const at::Tensor& keys, const at::Tensor& values, int64_t first) {
  KvBlockPool& pool = *blocks_.pool;
  const int64_t t = keys.size(1), block = pool.block_tokens(), mask = block - 1;
  const int shift = pool.block_shift();
  if (pool.one_slab()) {
    std::vector<int64_t> block_ids, rows, sources;
    block_ids.reserve(static_cast<std::size_t>(kv_heads_ * t));
    rows.reserve(block_ids.capacity());
    sources.reserve(block_ids.capacity());
    for (int64_t h = 0; h < kv_heads_; ++h) {
      const int64_t vacant = vacant_[static_cast<std::size_t>(h)];
      for (int64_t j = std::max(first, vacant); j < first + t; ++j) {
        block_ids.push_back(blocks_.ids[static_cast<std::size_t>(h)][static_cast<std::size_t>((j - vacant) >> shift)]);
        rows.push_back((j - vacant) & mask);
        sources.push_back(h * t + j - first);
      }
    }
    const auto index = [&](const std::vector<int64_t>& v) {
      return at::tensor(v, at::TensorOptions().dtype(at::kLong).device(at::kCPU)).to(pool.options().device());
    };
    at::Tensor k = keys.reshape({kv_heads_ * t, head_dim_}), v = values.reshape({kv_heads_ * t, head_dim_});
    if (static_cast<int64_t>(sources.size()) < kv_heads_ * t) {
      const at::Tensor held = index(sources);
      k = k.index_select(0, held);
      v = v.index_select(0, held);
    }
    pool.Write(index(block_ids), index(rows), k, v);
    return;
  }
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const int64_t vacant = vacant_[static_cast<std::size_t>(h)];
    for (int64_t i = std::max<int64_t>(0, vacant - first); i < t;) {
      const int64_t r = first + i - vacant, rows = std::min(t - i, block - (r & mask));
      const int32_t id = blocks_.ids[static_cast<std::size_t>(h)][static_cast<std::size_t>(r >> shift)];
      pool.keys(id).narrow(0, r & mask, rows).copy_(keys[h].narrow(0, i, rows));
      pool.values(id).narrow(0, r & mask, rows).copy_(values[h].narrow(0, i, rows));
      i += rows;
    }
  }
}

// Each head's kept tokens move front to back within its blocks (its token i to row j <= i - vacant), then the
// blocks past its last kept one go back to the pool. kept[h]: head h's tokens kept (its row's last entries).
void LayerKVCache::GatherInBlocks(const int64_t* index, int64_t k, const std::vector<int64_t>& kept) {
  KvBlockPool& pool = *blocks_.pool;
  if (!blocks_.key_rows.empty()) {
    const int64_t mask = pool.block_tokens() - 1, width = blocks_.width();
    const int shift = pool.block_shift();
    const auto row_bytes = static_cast<std::size_t>(head_dim_ * sizeof(float));
    for (int64_t h = 0; h < kv_heads_; ++h) {
      const int64_t vacant = vacant_[static_cast<std::size_t>(h)], count = kept[static_cast<std::size_t>(h)];
      const int64_t* own = index + h * k + (k - count);
      for (std::vector<const float*>* rows : {&blocks_.key_rows, &blocks_.value_rows}) {
        const auto row = [&](int64_t j) {
          return const_cast<float*>((*rows)[static_cast<std::size_t>(h * width + (j >> shift))]) + (j & mask) * head_dim_;
        };
        for (int64_t j = 0; j < count; ++j) {
          const int64_t i = own[j] - vacant;
          if (i != j) std::memcpy(row(j), row(i), row_bytes);
        }
      }
    }
  } else {  // by tensor operations: the kept rows copied out, then written back from each head's first block
    const at::Tensor indices =
        at::from_blob(const_cast<int64_t*>(index), {kv_heads_, k}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
    const at::Tensor where = indices.clamp_min(0).to(options_.device()).unsqueeze(2).expand({kv_heads_, k, head_dim_});
    const at::Tensor keys = FromBlocks(false).gather(1, where), values = FromBlocks(true).gather(1, where);
    for (int64_t h = 0; h < kv_heads_; ++h) vacant_[static_cast<std::size_t>(h)] = k - kept[static_cast<std::size_t>(h)];
    WriteRows(keys, values, 0);  // a -1's row (slot 0's copy) is vacant: not written
  }
  bool freed = false;
  for (int64_t h = 0; h < kv_heads_; ++h) {
    auto& head = blocks_.ids[static_cast<std::size_t>(h)];
    const int64_t keep = BlocksFor(kept[static_cast<std::size_t>(h)]), held = static_cast<int64_t>(head.size());
    if (keep >= held) continue;
    pool.Free(head.data() + keep, held - keep);
    head.resize(static_cast<std::size_t>(keep));
    freed = true;
  }
  if (freed && !blocks_.key_rows.empty()) RefreshBlockTable();
}

Status LayerKVCache::Gather(const at::Tensor& indices) {
  if (!indices.defined() || indices.dim() != 2 || indices.size(0) != kv_heads_ ||
      indices.scalar_type() != at::kLong) {
    return Status::InvalidArgument("retained indices must be int64 [kv_heads=" + std::to_string(kv_heads_) +
                                   ", k], got " +
                                   (indices.defined() ? shape_to_string(indices.sizes().vec()) : "nothing"));
  }
  const int64_t k = indices.size(1);
  if (k > size_) return Status::InvalidArgument("cannot retain " + std::to_string(k) + " of " +
                                                std::to_string(size_) + " tokens");
  if (on_host() && indices.device().is_cpu()) return GatherOnHost(indices.contiguous());
  if (ragged_) return Status::FailedPrecondition("a ragged KV cache gathers with indices on the host");
  if (k > 0) {
    // The checks' three numbers in one transfer: each read waits for the device's queued work.
    const at::Tensor unordered = k > 1 ? indices.diff(1, 1).le(0).sum() : at::zeros({}, indices.options());
    const at::Tensor checks = at::stack({indices.min(), indices.max(), unordered}).to(at::kCPU);
    const int64_t* c = checks.data_ptr<int64_t>();
    if (c[0] < 0 || c[1] >= size_) {
      return Status::InvalidArgument("retained index out of range [0, " + std::to_string(size_) +
                                     ") (vacant slots, -1, need a cache on the host)");
    }
    if (c[2] > 0) return Status::InvalidArgument("retained indices must be strictly ascending per head");
  }
  if (k == size_) return Status::Ok();  // k ascending indices below size: all of them, in order
  if (in_blocks() && head_dim_ > 0) {
    const at::Tensor host = indices.to(at::kCPU).contiguous();
    GatherInBlocks(host.data_ptr<int64_t>(), k, std::vector<int64_t>(static_cast<std::size_t>(kv_heads_), k));
  }
  const at::Tensor index = indices.to(buffers_[kPositions].device());
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    at::Tensor& buffer = buffers_[b];
    if (in_blocks() && (b == kKeys || b == kValues)) continue;
    // Broadcast the [kv_heads, k] indices over the trailing dimensions of this buffer.
    std::vector<int64_t> view_shape = {kv_heads_, k}, expand_shape = buffer.sizes().vec();
    view_shape.resize(static_cast<std::size_t>(buffer.dim()), 1);
    expand_shape[1] = k;
    at::Tensor kept = Live(buffer).gather(1, index.view(view_shape).expand(expand_shape));
    buffer.narrow(1, 0, k).copy_(kept);
  }
  size_ = k;
  RefreshViews();
  return Status::Ok();
}

Status LayerKVCache::CheckHostIndices(const int64_t* index, int64_t k, std::vector<int64_t>& kept) const {
  kept.assign(static_cast<std::size_t>(kv_heads_), k);
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const int64_t* row = index + h * k;
    int64_t first = 0;
    while (first < k && row[first] == -1) ++first;
    kept[static_cast<std::size_t>(h)] = k - first;
    if (k > 0 && first == k) return Status::InvalidArgument("KV head " + std::to_string(h) + " would keep no token");
    for (int64_t j = first; j < k; ++j) {
      if (row[j] < 0 || row[j] >= size_) {
        return Status::InvalidArgument("retained index out of range [0, " + std::to_string(size_) +
                                       ") (-1, a vacant slot, only before a head's kept tokens)");
      }
      if (j > first && row[j] <= row[j - 1]) {
        return Status::InvalidArgument("retained indices must be strictly ascending per head");
      }
    }
  }
  return Status::Ok();
}

// Ascending indices move every kept row to a slot at or before its own, so each head compacts in place, front
// to back, with no copy of the cache. A head that leaves slots vacant puts its rows after them (through a copy
// of its kept rows: they may move either way), and its vacant slots get zeros and position -1.
Status LayerKVCache::GatherOnHost(const at::Tensor& indices) {
  const int64_t k = indices.size(1);
  const int64_t* index = indices.data_ptr<int64_t>();
  std::vector<int64_t> kept;
  NAMM_RETURN_IF_ERROR(CheckHostIndices(index, k, kept));
  bool leaves_vacant = false;
  for (const int64_t count : kept) leaves_vacant = leaves_vacant || count < k;
  // Every slot, in order (a ragged cache's vacant ones staying vacant: all_token_indices).
  if (k == size_ && !leaves_vacant) return Status::Ok();
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const auto head = static_cast<std::size_t>(h);
    for (int64_t j = k - kept[head]; j < k; ++j) {
      if (index[h * k + j] < vacant_[head]) {
        return Status::InvalidArgument("retained index " + std::to_string(index[h * k + j]) + " of KV head " +
                                       std::to_string(h) + " names a vacant slot (the head holds slots " +
                                       std::to_string(vacant_[head]) + ".." + std::to_string(size_ - 1) + ")");
      }
    }
  }
  if (in_blocks() && head_dim_ > 0) GatherInBlocks(index, k, kept);
  std::vector<char> moved;
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    const at::Tensor& buffer = buffers_[b];
    // Keys and values in blocks leave empty buffers here (a row of 0 bytes).
    const int64_t row = buffer.numel() / (kv_heads_ * capacity_) * static_cast<int64_t>(buffer.element_size());
    if (row == 0) continue;
    auto* base = static_cast<char*>(buffer.data_ptr());
    for (int64_t h = 0; h < kv_heads_; ++h) {
      char* head = base + h * capacity_ * row;
      const int64_t count = kept[static_cast<std::size_t>(h)], vacant = k - count;
      const int64_t* own = index + h * k + vacant;
      if (vacant > 0) {
        moved.resize(static_cast<std::size_t>(count * row));
        for (int64_t j = 0; j < count; ++j) std::memcpy(moved.data() + j * row, head + own[j] * row, static_cast<std::size_t>(row));
        std::memcpy(head + vacant * row, moved.data(), moved.size());
        if (b == kPositions) {
          std::fill_n(reinterpret_cast<int64_t*>(head), vacant, int64_t{-1});
        } else {
          std::memset(head, 0, static_cast<std::size_t>(vacant * row));
        }
        continue;
      }
      // Runs of consecutive kept tokens move together (one copy each); rows already in place stay.
      for (int64_t j = 0; j < k;) {
        int64_t run = 1;
        while (j + run < k && own[j + run] == own[j] + run) ++run;
        if (own[j] != j) std::memmove(head + j * row, head + own[j] * row, static_cast<std::size_t>(run * row));
        j += run;
      }
    }
  }
  ragged_ = false;
  for (int64_t h = 0; h < kv_heads_; ++h) {
    vacant_[static_cast<std::size_t>(h)] = k - kept[static_cast<std::size_t>(h)];
    ragged_ = ragged_ || vacant_[static_cast<std::size_t>(h)] > 0;
  }
  size_ = k;
  RefreshViews();
  return Status::Ok();
}

}  // namespace namm
