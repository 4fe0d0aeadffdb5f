// Row copies between host tensors without a tensor operation (the KV cache's appends and the query history's
// records run per layer, sequence and step: a dispatched copy per buffer was most of their time).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace namm::internal {

// Whether copy_rows_on_host can read `from` into `to`: both on the host, one dtype and rank, each of `from`'s
// rows (its dimensions after the first two) contiguous.
inline bool host_rows(const at::Tensor& from, const at::Tensor& to) {
  if (!from.device().is_cpu() || !to.device().is_cpu() || from.scalar_type() != to.scalar_type() ||
      from.dim() != to.dim() || from.dim() < 2) {
    return false;
  }
  int64_t expected = 1;
  for (int64_t d = from.dim() - 1; d >= 2; --d) {
    if (from.stride(d) != expected) return false;
    expected *= from.size(d);
  }
  return true;
}

// `bytes` from `from` to `to` (not overlapping): rows of a few dozen bytes (a small model's key, a token's
// positions) copied in place, where a call to memcpy per row cost more than the copy.
inline void copy_row(char* to, const char* from, int64_t bytes) {
  if (bytes % 8 == 0 && bytes <= 128) {
    for (int64_t w = 0; w < bytes; w += 8) {
      uint64_t word;
      std::memcpy(&word, from + w, 8);
      std::memcpy(to + w, &word, 8);
    }
  } else {
    std::memcpy(to, from, static_cast<std::size_t>(bytes));
  }
}

// from [heads, t, row...] (host_rows) into slots [at, at + t) of to [heads, capacity, row...] (contiguous), byte
// for byte: what to.narrow(1, at, t).copy_(from) does.
inline void copy_rows_on_host(const at::Tensor& from, const at::Tensor& to, int64_t at) {
  const int64_t heads = from.size(0), t = from.size(1), row = from.numel() / std::max<int64_t>(1, heads * t);
  const auto elem = static_cast<int64_t>(from.element_size());
  const auto* src = static_cast<const char*>(from.data_ptr());
  auto* dst = static_cast<char*>(to.data_ptr());
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < t; ++i) {
      copy_row(dst + (h * to.size(1) + at + i) * row * elem, src + (h * from.stride(0) + i * from.stride(1)) * elem,
               row * elem);
    }
  }
}

}  // namespace namm::internal
