#include "namm/query_history.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "aten.h"
#include "cpu_kernels/tensor_kernels.h"
#ifdef NAMM_CUDA_KERNELS
#include "cuda_kernels/tensor_kernels.h"
#endif
#include "host_rows.h"
#include "namm/dtype.h"
#include "namm/kv_cache.h"
#include "namm/stft_features.h"
#include "namm/tensor_view.h"

namespace namm {

at::Tensor attention_probabilities(const at::Tensor& scores, int64_t lse_from, const at::Tensor& lse_out) {
  const int64_t rows = scores.size(-2);
#ifdef NAMM_CUDA_KERNELS
  if (cuda::takes(scores) && (!lse_out.defined() || lse_out.device() == scores.device())) {
    const int64_t n = scores.size(-1);
    const at::Tensor flat = scores.reshape({-1, rows, n});
    const at::Tensor probs = at::empty(scores.sizes(), scores.options().dtype(at::kFloat));
    cuda::softmax_rows_into(flat, lse_from, lse_out.defined() ? lse_out.view({flat.size(0), rows - lse_from}) : lse_out,
                            probs.view({-1, rows, n}));
    return probs;
  }
#endif
  const at::Tensor scores_f32 = scores.to(at::kFloat);
  if (lse_out.defined()) lse_out.copy_(scores_f32.narrow(-2, lse_from, rows - lse_from).logsumexp(-1));
  return scores_f32.softmax(-1);
}

Status QueryHistory::Record(const at::Tensor& queries, const at::Tensor& log_sum_exp, int64_t first_query,
                            int64_t window, int64_t keep) {
  if (!queries.defined() || queries.dim() != 3 || !log_sum_exp.defined() || log_sum_exp.dim() != 2 ||
      log_sum_exp.size(0) != queries.size(0) || log_sum_exp.size(1) != queries.size(1) || keep < 1) {
    return Status::InvalidArgument("query history needs queries [q_heads, t, head_dim] and their log-sum-exp "
                                   "[q_heads, t]");
  }
  const int64_t t = queries.size(1);
  // A call with at least `keep` queries replaces the history (the engine records only a call's newest ones).
  if (t >= keep) size_ = 0;
  if (size_ > 0 && first_query != first_query_ + size_) {
    return Status::InvalidArgument("query history holds queries " + std::to_string(first_query_) + ".." +
                                   std::to_string(first_query_ + size_ - 1) + "; cannot append query " +
                                   std::to_string(first_query));
  }
  // Fixed storage for `keep` queries, made once: rows are shifted within it, never reallocated.
  const at::Tensor lse = log_sum_exp.scalar_type() == at::kFloat ? log_sum_exp : log_sum_exp.to(at::kFloat);
  if (!query_store_.defined() || query_store_.size(0) != queries.size(0) || query_store_.size(1) != keep ||
      query_store_.size(2) != queries.size(2) || query_store_.scalar_type() != queries.scalar_type() ||
      query_store_.device() != queries.device()) {
    if (size_ > 0) {
      return Status::InvalidArgument("query history holds queries of another shape or kind than " +
                                     shape_to_string(queries.sizes().vec()));
    }
    query_store_ = at::empty({queries.size(0), keep, queries.size(2)}, queries.options());
    lse_store_ = at::empty({queries.size(0), keep}, lse.options());
  }
  const int64_t take = std::min(t, keep);  // of this call's queries, the newest `keep`
  if (size_ == 0) first_query_ = first_query + t - take;
  if (const int64_t drop = size_ + take - keep; drop > 0) {
    Shift(drop);
    first_query_ += drop;
    size_ -= drop;
  }
  if (queries.device().is_cpu() && lse.device().is_cpu() && queries.stride(2) == 1) {
    // Row by row on the host (no tensor operation: this runs per layer, sequence and step).
    // (Sizes, strides and addresses read once: each is a call into libtorch.)
    const auto elem = static_cast<int64_t>(queries.element_size()), hd = queries.size(2), heads = queries.size(0);
    const int64_t q_head = queries.stride(0), q_row = queries.stride(1), l_head = lse.stride(0), l_row = lse.stride(1);
    const auto* q = static_cast<const char*>(queries.data_ptr());
    auto* q_store = static_cast<char*>(query_store_.data_ptr());
    const float* l = lse.data_ptr<float>();
    float* l_store = lse_store_.data_ptr<float>();
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < take; ++i) {
        const int64_t from = t - take + i, to = size_ + i;
        internal::copy_row(q_store + ((h * keep + to) * hd) * elem, q + (h * q_head + from * q_row) * elem, hd * elem);
        l_store[h * keep + to] = l[h * l_head + from * l_row];
      }
    }
  } else {
    query_store_.narrow(1, size_, take).copy_(queries.narrow(1, t - take, take));
    lse_store_.narrow(1, size_, take).copy_(lse.narrow(1, t - take, take));
  }
  size_ += take;
  window_ = window;
  queries_ = narrow_view(query_store_, 1, 0, size_);
  log_sum_exp_ = narrow_view(lse_store_, 1, 0, size_);
  return Status::Ok();
}

// Rows [drop, size_) moved to [0, size_ - drop) in both stores (overlapping: through a copy off the host).
void QueryHistory::Shift(int64_t drop) {
  const int64_t kept = size_ - drop;
  if (kept <= 0) return;
  for (at::Tensor* store : {&query_store_, &lse_store_}) {
    if (store->device().is_cpu() && store->is_contiguous()) {
      const int64_t row = (store->dim() == 3 ? store->size(2) : 1) * static_cast<int64_t>(store->element_size());
      auto* base = static_cast<char*>(store->data_ptr());
      for (int64_t h = 0; h < store->size(0); ++h) {
        char* head = base + h * store->size(1) * row;
        std::memmove(head, head + drop * row, static_cast<std::size_t>(kept * row));
      }
    } else {
      store->narrow(1, 0, kept).copy_(store->narrow(1, drop, kept).clone());
    }
  }
}

QueryHistory QueryHistory::Clone() const {
  QueryHistory copy = *this;
  if (query_store_.defined()) {
    copy.query_store_ = query_store_.clone();
    copy.lse_store_ = lse_store_.clone();
    copy.queries_ = copy.query_store_.narrow(1, 0, size_);
    copy.log_sum_exp_ = copy.lse_store_.narrow(1, 0, size_);
  }
  return copy;
}

int64_t QueryHistory::bytes() const {
  if (size_ == 0) return 0;
  return queries_.numel() * queries_.element_size() + log_sum_exp_.numel() * log_sum_exp_.element_size();
}

Result<at::Tensor> QueryHistory::Products(const LayerKVCache& cache, int64_t from, int64_t to) const {
  if (from < first_query_ || to > first_query_ + size() || from > to) {
    return Status::FailedPrecondition("the attention of queries " + std::to_string(from) + ".." +
                                      std::to_string(to - 1) + " was asked for, but the query history holds " +
                                      std::to_string(first_query_) + ".." + std::to_string(first_query_ + size() - 1));
  }
  const int64_t heads = queries_.size(0), rows = to - from, kv_heads = cache.kv_heads(), n = cache.size();
  if (heads % kv_heads != 0 || queries_.size(2) != cache.head_dim()) {
    return Status::InvalidArgument("recorded queries " + shape_to_string(queries_.sizes().vec()) +
                                   " do not fit a cache of " + std::to_string(kv_heads) + " KV heads of " +
                                   std::to_string(cache.head_dim()));
  }
  const int64_t group = heads / kv_heads, hd = cache.head_dim();
  const at::Tensor q = narrow_view(queries_, 1, from - first_query_, rows).reshape({kv_heads, group * rows, hd});
  return at::bmm(q, cache.keys().transpose(1, 2)).view({heads, rows, n});
}

namespace {
double ScoreScale(const LayerKVCache& cache) { return 1.0 / std::sqrt(static_cast<double>(cache.head_dim())); }

// A ragged cache's vacant slots (KV head h's first vacant[h]) got nothing: zeros in `per_kv_head` [kv_heads, ..., n].
void ZeroVacant(const LayerKVCache& cache, const at::Tensor& per_kv_head) {
  const int64_t* vacant = cache.vacant();
  if (vacant == nullptr) return;
  for (int64_t h = 0; h < cache.kv_heads(); ++h) {
    if (vacant[h] > 0) per_kv_head[h].narrow(-1, 0, vacant[h]).zero_();
  }
}
}  // namespace

Result<at::Tensor> QueryHistory::Scores(const LayerKVCache& cache, int64_t from, int64_t to) const {
  NAMM_ASSIGN_OR_RETURN(at::Tensor products, Products(cache, from, to));
  if (products.device().is_cpu() && products.scalar_type() == at::kFloat && products.is_contiguous()) {
    // On this thread, as mul_ computes it (times the scale in float32): for the 32,768 elements and more of a
    // decode step's earlier rows, mul_ forks libtorch's OpenMP pool, whose thread then spins for milliseconds
    // on the core our kernels' pool needs (measured: 9% of namm-api's samples at one client).
    const auto scale = static_cast<float>(ScoreScale(cache));
    float* p = products.data_ptr<float>();
    for (int64_t i = 0, count = products.numel(); i < count; ++i) p[i] *= scale;
    return products;
  }
  return products.mul_(ScoreScale(cache)).to(at::kFloat);
}

Result<at::Tensor> QueryHistory::Attention(const LayerKVCache& cache, int64_t from, int64_t to) const {
  NAMM_ASSIGN_OR_RETURN(at::Tensor probs, Scores(cache, from, to));
  const int64_t heads = probs.size(0), rows = to - from, kv_heads = cache.kv_heads(), n = cache.size();
  probs.sub_(log_sum_exp_.narrow(1, from - first_query_, rows).unsqueeze(2)).exp_();
  // Keys after the query, or window or more positions behind it, got nothing.
  const at::Tensor query_positions = at::arange(from, to, cache.positions().options()).view({1, rows, 1});
  const at::Tensor key_positions = cache.positions().unsqueeze(1);  // [kv_heads, 1, n]
  at::Tensor hidden = key_positions.gt(query_positions);            // [kv_heads, rows, n], no int64 temporary
  if (window_ > 0) hidden.logical_or_(key_positions.le(query_positions - window_));
  probs.view({kv_heads, heads / kv_heads, rows, n}).masked_fill_(hidden.unsqueeze(1), 0.0);
  ZeroVacant(cache, probs.view({kv_heads, heads / kv_heads, rows, n}));
  return probs;
}

Status QueryHistory::GqaMeanAttention(const LayerKVCache& cache, int64_t from, int64_t to,
                                      AttentionPrecision precision, const at::Tensor& out) const {
  // The cache's device, not its keys: keys() of a cache in blocks is a copy of them all.
#ifdef NAMM_CUDA_KERNELS
  if (cuda::takes(out) && out.device() == cache.device()) {
    NAMM_ASSIGN_OR_RETURN(at::Tensor products, Products(cache, from, to));
    if (cuda::takes(products)) {  // a dtype the kernel reads
      cuda::scores_gqa_mean_into(products, ScoreScale(cache), log_sum_exp_.narrow(1, from - first_query_, to - from),
                                 cache.positions(), from, window_, precision == AttentionPrecision::kBf16, out);
      ZeroVacant(cache, out);
      return Status::Ok();
    }
  }
#endif
  if (!cache.device().is_cpu() || cache.tokens_seen() > std::numeric_limits<int32_t>::max()) {
    NAMM_ASSIGN_OR_RETURN(at::Tensor probs, Attention(cache, from, to));
    gqa_mean_into(probs, precision, out);
    return Status::Ok();
  }
  NAMM_ASSIGN_OR_RETURN(at::Tensor scores, Scores(cache, from, to));
  TORCH_CHECK(out.dim() == 3 && out.size(0) == cache.kv_heads() && out.size(1) == to - from &&
                  out.size(2) == cache.size() && out.stride(2) == 1 && out.scalar_type() == at::kFloat,
              "GqaMeanAttention: out ", out.sizes(), " is not [", cache.kv_heads(), ", ", to - from, ", ", cache.size(),
              "] float32");
  cpu::scores_gqa_mean_into(scores, narrow_view(log_sum_exp_, 1, from - first_query_, to - from),
                            cache.positions().to(at::kInt), from, window_, precision == AttentionPrecision::kBf16,
                            out, cpu::kernels());
  ZeroVacant(cache, out);
  return Status::Ok();
}

}  // namespace namm
