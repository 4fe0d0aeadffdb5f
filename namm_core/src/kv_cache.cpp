#include "namm/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "aten.h"
#include "host_rows.h"
#include "namm/dtype.h"

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
  RefreshViews();
}

at::Tensor LayerKVCache::keys() const { return live_[kKeys]; }
at::Tensor LayerKVCache::values() const { return live_[kValues]; }
at::Tensor LayerKVCache::positions() const { return live_[kPositions]; }

at::Tensor LayerKVCache::state(const std::string& name) const {
  for (std::size_t i = kPositions + 1; i < names_.size(); ++i) {
    if (names_[i] == name) return live_[i];
  }
  TORCH_CHECK(false, "the KV cache has no per-token state '", name, "'");
}

LayerKVCache LayerKVCache::Clone() const {
  LayerKVCache copy = *this;
  for (at::Tensor& buffer : copy.buffers_) buffer = buffer.clone();
  copy.query_history_ = query_history_.Clone();
  copy.RefreshViews();
  return copy;
}

void LayerKVCache::RefreshViews() {
  live_.resize(buffers_.size());
  for (std::size_t i = 0; i < buffers_.size(); ++i) live_[i] = buffers_[i].narrow(1, 0, size_);
}

int64_t LayerKVCache::kv_bytes() const { return size_ * KvBytesPerToken(); }

int64_t LayerKVCache::reserved_kv_bytes() const { return capacity_ * KvBytesPerToken(); }

int64_t LayerKVCache::reserved_kv_bytes_after(int64_t more) const { return GrownCapacity(size_ + more) * KvBytesPerToken(); }

int64_t LayerKVCache::KvBytesPerToken() const {
  return 2 * kv_heads_ * head_dim_ * static_cast<int64_t>(buffers_[kKeys].element_size());
}

int64_t LayerKVCache::GrownCapacity(int64_t capacity) const {
  if (capacity <= capacity_) return capacity_;
  const int64_t grown = std::max({capacity, 2 * capacity_, kInitialCapacity});
  // No room beyond what the rest of the sequence can fill (expected_tokens_ counts evicted tokens too).
  if (expected_tokens_ <= 0) return grown;
  return std::max(capacity, std::min(grown, size_ + expected_tokens_ - tokens_seen_));
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
  if (allocate_now) Reserve(size_ + std::max<int64_t>(0, total - tokens_seen_));
}

void LayerKVCache::Reserve(int64_t capacity) {
  if (capacity <= capacity_) return;
  const int64_t grown = GrownCapacity(capacity);
  for (auto& buffer : buffers_) {
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
  Reserve(size_ + t);
  // On the host the rows are copied in place (the engine appends every layer's chunk of every sequence: a
  // tensor operation per buffer was most of an append's time); elsewhere by tensor operations.
  const bool host = on_host() && positions.device().is_cpu() && positions.scalar_type() == at::kLong &&
                    (head_dim_ == 0 || (internal::host_rows(keys, buffers_[kKeys]) && internal::host_rows(values, buffers_[kValues])));
  if (host) {
    if (head_dim_ > 0) {
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
    if (head_dim_ > 0) {
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
  if (k > 0) {
    const int64_t lo = indices.min().item<int64_t>(), hi = indices.max().item<int64_t>();
    if (lo < 0 || hi >= size_) {
      return Status::InvalidArgument("retained index out of range [0, " + std::to_string(size_) + ")");
    }
    if (k > 1 && !indices.diff(1, 1).gt(0).all().item<bool>()) {
      return Status::InvalidArgument("retained indices must be strictly ascending per head");
    }
  }
  if (k == size_) return Status::Ok();  // k ascending indices below size: all of them, in order
  const at::Tensor index = indices.to(buffers_[kPositions].device());
  for (auto& buffer : buffers_) {
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

// Ascending indices move every kept row to a slot at or before its own, so each head compacts in place, front
// to back, with no copy of the cache.
Status LayerKVCache::GatherOnHost(const at::Tensor& indices) {
  const int64_t k = indices.size(1);
  const int64_t* index = indices.data_ptr<int64_t>();
  for (int64_t h = 0; h < kv_heads_; ++h) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = index[h * k + j];
      if (i < 0 || i >= size_) {
        return Status::InvalidArgument("retained index out of range [0, " + std::to_string(size_) + ")");
      }
      if (j > 0 && i <= index[h * k + j - 1]) {
        return Status::InvalidArgument("retained indices must be strictly ascending per head");
      }
    }
  }
  if (k == size_) return Status::Ok();
  for (const at::Tensor& buffer : buffers_) {
    const int64_t row = buffer.numel() / (kv_heads_ * capacity_) * static_cast<int64_t>(buffer.element_size());
    if (row == 0) continue;
    auto* base = static_cast<char*>(buffer.data_ptr());
    for (int64_t h = 0; h < kv_heads_; ++h) {
      char* head = base + h * capacity_ * row;
      const int64_t* kept = index + h * k;
      // Runs of consecutive kept tokens move together (one copy each); rows already in place stay.
      for (int64_t j = 0; j < k;) {
        int64_t run = 1;
        while (j + run < k && kept[j + run] == kept[j] + run) ++run;
        if (kept[j] != j) std::memmove(head + j * row, head + kept[j] * row, static_cast<std::size_t>(run * row));
        j += run;
      }
    }
  }
  size_ = k;
  RefreshViews();
  return Status::Ok();
}

}  // namespace namm
