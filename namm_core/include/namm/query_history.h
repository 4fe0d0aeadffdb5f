// The last few queries of one layer, kept so that the attention they paid can be computed again later over the
// cache as it is then (tokens evicted since are simply absent; tokens that arrived since get zero).
//
// Why: the NAMM's spectrogram frame at a hop end needs the attention every cached token received from the 32
// latest queries. Keeping those samples per token costs 32 floats per token and KV head (+25% over a bf16 KV
// cache at head_dim 128). Keeping the queries instead costs a fixed ~31 x q_heads x head_dim per layer, and
// the attention of an earlier query q is exp(scale q.k - lse_q) with the log-sum-exp lse_q of q's scores at the
// time it ran: the softmax's normalizer does not change when keys are evicted later.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "namm/feature_constants.h"
#include "namm/status.h"

namespace namm {

class LayerKVCache;

// The attention probabilities of `scores` [..., rows, n] (-inf where hidden) as float32, softmax over the keys,
// and with `lse_out` defined ([..., rows - lse_from] float32) the log-sum-exp of rows lse_from .. rows - 1: what
// the engine hands to policies and to QueryHistory::Record. One CUDA kernel where observe_kernels_run_on()
// (instead of a conversion, a softmax and a logsumexp of ~6 launches), else libtorch operators.
at::Tensor attention_probabilities(const at::Tensor& scores, int64_t lse_from, const at::Tensor& lse_out);

class QueryHistory {
 public:
  // Appends queries with absolute indices first_query .. first_query + t - 1 (contiguous with those already held
  // unless t >= keep, which replaces them): post-RoPE queries [q_heads, t, head_dim] in the keys' dtype, the log-sum-exp of
  // their scaled, masked scores [q_heads, t] float32, and the sliding window their layer applies (0: none). Only
  // the newest `keep` are held, in storage for `keep` made at the first call (copied into, not reallocated).
  Status Record(const at::Tensor& queries, const at::Tensor& log_sum_exp, int64_t first_query, int64_t window,
                int64_t keep);

  int64_t first_query() const { return first_query_; }
  int64_t size() const { return size_; }
  int64_t heads() const { return query_store_.defined() ? query_store_.size(0) : 0; }
  // A copy sharing no storage with this history.
  QueryHistory Clone() const;
  // Bytes held (queries and log-sum-exp).
  int64_t bytes() const;

  // Attention probabilities [q_heads, to - from, cache.size()] float32 of the held queries [from, to) over the
  // cache's keys, computed as the forward pass did (scores in the keys' dtype, scaled by 1 / sqrt(head_dim),
  // then float32), zero for keys after the query or outside its window.
  Result<at::Tensor> Attention(const LayerKVCache& cache, int64_t from, int64_t to) const;

  // gqa_mean_into(Attention(cache, from, to), precision, out): out [kv_heads, to - from, cache.size()] float32,
  // innermost stride 1. On the CPU (and with NAMM_CUDA_KERNELS on a GPU) the probabilities, their mask and the
  // mean are one pass after the product.
  Status GqaMeanAttention(const LayerKVCache& cache, int64_t from, int64_t to, AttentionPrecision precision,
                          const at::Tensor& out) const;

 private:
  // The products q.k of queries [from, to) with the cache's keys, [q_heads, to - from, n] in the keys' dtype,
  // unscaled; the checks every user needs.
  Result<at::Tensor> Products(const LayerKVCache& cache, int64_t from, int64_t to) const;
  // Products scaled by 1 / sqrt(head_dim) as the forward pass scaled them (in the keys' dtype), then float32.
  Result<at::Tensor> Scores(const LayerKVCache& cache, int64_t from, int64_t to) const;

  // Moves rows [drop, size_) of the stores to the front.
  void Shift(int64_t drop);

  // Room for `keep` queries [q_heads, keep, head_dim] and their log-sum-exp [q_heads, keep], made once; the first
  // size_ rows are held (queries_ and log_sum_exp_ view them).
  at::Tensor query_store_, lse_store_;
  at::Tensor queries_, log_sum_exp_;
  int64_t size_ = 0;
  int64_t first_query_ = 0;
  int64_t window_ = 0;
};

}  // namespace namm
