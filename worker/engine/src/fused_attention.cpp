#include "fused_attention.h"

#include <optional>

#include "aten.h"

// libtorch 2.x has a fused attention; Debian's 1.13 does not (namm_core's BAM scorer makes the same test).
#if __has_include(<ATen/ops/scaled_dot_product_attention.h>)
#include <ATen/ops/scaled_dot_product_attention.h>
#define NAMM_HAVE_FUSED_ATTENTION 1
#endif

namespace namm::worker {

bool fused_causal_attention(const at::Tensor& q_heads, const at::Tensor& keys, const at::Tensor& values,
                            double scale, const at::Tensor& out) {
#ifdef NAMM_HAVE_FUSED_ATTENTION
  if (!q_heads.is_cuda()) return false;
  const int64_t heads = q_heads.size(0), t = q_heads.size(1), hd = q_heads.size(2);
  const int64_t kv_heads = keys.size(0), n = keys.size(1), group = heads / kv_heads;
  // A KV head's query heads stacked as its rows ([1, kv_heads, group * t, hd]: head h = kv * group + g), so that
  // no key or value is copied per query head.
  const at::Tensor q = q_heads.reshape({1, kv_heads, group * t, hd});
  // Row (g, r) is chunk token r, whose own position in the cache is n - t + r: it sees the keys up to that one.
  // One query (a decode step) sees every key: no mask, which lets the flash kernel take it.
  std::optional<at::Tensor> visible;
  if (t > 1) {
    const at::TensorOptions index = keys.options().dtype(at::kLong);
    const at::Tensor last_seen = at::arange(n - t, n, index).repeat({group});
    visible = at::arange(n, index).unsqueeze(0).le(last_seen.unsqueeze(1));  // [group * t, n]
  }
  const at::Tensor o =
      at::scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0), visible, 0.0, false, scale);
  out.view({t, kv_heads, group, hd}).copy_(o.reshape({kv_heads, group, t, hd}).permute({2, 0, 1, 3}));
  return true;
#else
  (void)q_heads, (void)keys, (void)values, (void)scale, (void)out;
  return false;
#endif
}

}  // namespace namm::worker
