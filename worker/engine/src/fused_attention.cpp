#include "fused_attention.h"

#include <algorithm>
#include <optional>

#include "aten.h"

// libtorch 2.x has a fused attention; Debian's 1.13 does not (namm_core's BAM scorer makes the same test).
#if __has_include(<ATen/ops/scaled_dot_product_attention.h>)
#include <ATen/ops/scaled_dot_product_attention.h>
#define NAMM_HAVE_FUSED_ATTENTION 1
#endif

namespace namm::worker {

bool fused_causal_attention(const at::Tensor& q_heads, const at::Tensor& keys, const at::Tensor& values,
                            int64_t max_block_elements, const at::Tensor& out) {
#ifdef NAMM_HAVE_FUSED_ATTENTION
  if (!q_heads.is_cuda()) return false;
  const int64_t heads = q_heads.size(0), t = q_heads.size(1), hd = q_heads.size(2);
  const int64_t kv_heads = keys.size(0), n = keys.size(1), group = heads / kv_heads;
  // Blocks of the chunk's rows whose masks hold at most max_block_elements (a chunk of 32k rows over 32k keys
  // would otherwise mask 4G of them, and the memory-efficient kernel indexes its mask in 32 bits).
  const int64_t block = std::clamp<int64_t>(max_block_elements / std::max<int64_t>(1, group * n), 1, t);
  const at::TensorOptions index_options = keys.options().dtype(at::kLong);
  for (int64_t r0 = 0; r0 < t; r0 += block) {
    const int64_t rows = std::min(block, t - r0), seen = n - t + r0 + rows;  // keys the block's last row sees
    // A KV head's query heads stacked as its rows ([1, kv_heads, group * rows, hd]: head h = kv * group + g), so
    // that no key or value is copied per query head.
    const at::Tensor q = q_heads.narrow(1, r0, rows).reshape({1, kv_heads, group * rows, hd});
    // Row (g, r) is chunk token r0 + r, at n - t + r0 + r in the cache: it sees the keys up to that one. One query
    // (a decode step) sees every key: no mask, which lets the flash kernel take it.
    std::optional<at::Tensor> visible;
    if (rows > 1) {
      const at::Tensor last_seen = at::arange(seen - rows, seen, index_options).repeat({group});
      visible = at::arange(seen, index_options).unsqueeze(0).le(last_seen.unsqueeze(1));  // [group * rows, seen]
    }
    // Scaled by 1 / sqrt(head_dim), the model's scale and the fused kernel's default.
    const at::Tensor o = at::scaled_dot_product_attention(q, keys.narrow(1, 0, seen).unsqueeze(0),
                                                          values.narrow(1, 0, seen).unsqueeze(0), visible);
    out.narrow(0, r0, rows)
        .view({rows, kv_heads, group, hd})
        .copy_(o.reshape({kv_heads, group, rows, hd}).permute({2, 0, 1, 3}));
  }
  return true;
#else
  (void)q_heads, (void)keys, (void)values, (void)max_block_elements, (void)out;
  return false;
#endif
}

}  // namespace namm::worker
