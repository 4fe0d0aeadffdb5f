// The model's causal attention through libtorch's fused kernels (flash, memory-efficient or cuDNN attention) on a
// CUDA device, for the policies that observe nothing: no [heads, rows, n] block of scores or probabilities in
// device memory (only a [group * rows, n] mask of the keys each row sees), and a launch or two per block of rows
// instead of a dozen.
#pragma once

#include <ATen/core/Tensor.h>

namespace namm::worker {

// Attends a chunk's t newest tokens (the last t of the cache's n) to every older cached token and to the chunk's
// own up to themselves, scaled by 1 / sqrt(head_dim), as the block path does (LlamaModel::Attend), and writes
// out = [t, heads * head_dim]. q_heads [heads, t, head_dim] (any strides), keys and values [kv_heads, n,
// head_dim] (rows contiguous) with every slot a token (no vacant slots) and no sliding window; blocks of rows
// whose masks hold at most max_block_elements. Returns false, writing nothing, where libtorch has no fused
// kernel (Debian's 1.13) or the tensors are not on a CUDA device; the caller then attends itself.
bool fused_causal_attention(const at::Tensor& q_heads, const at::Tensor& keys, const at::Tensor& values,
                            int64_t max_block_elements, const at::Tensor& out);

}  // namespace namm::worker
