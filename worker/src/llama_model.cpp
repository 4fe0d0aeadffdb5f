#include "namm/worker/llama_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "aten.h"
#include "namm/query_history.h"
#include "namm/worker/rope.h"

namespace namm::worker {

namespace {

// x [t, in] times w^T [in, out] (+ b). One row (a decoded token) is a matrix-vector product: at::linear on a
// [1, in] input runs a GEMM whose packing copies the whole weight matrix on every call (OpenBLAS's
// sgemm_incopy: 44% of decode time on an 8B-shaped model), where a GEMV reads it once.
at::Tensor Project(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = at::Tensor()) {
  if (x.size(0) != 1) return at::linear(x, w, b);
  // (at::linear and at::matmul on a 1-D input still run a one-row GEMM; at::mv is the GEMV.)
  at::Tensor y = at::mv(w, x.select(0, 0));
  if (b.defined()) y.add_(b);
  return y.unsqueeze(0);
}

}  // namespace

Result<LlamaModel> LlamaModel::Load(const std::string& path, const LoadOptions& options) {
  NAMM_ASSIGN_OR_RETURN(LoadedModel loaded, load_model(path, options));
  return LlamaModel(std::move(loaded), at::TensorOptions().dtype(options.dtype).device(options.device));
}

LlamaModel::LlamaModel(LoadedModel loaded, at::TensorOptions options)
    : config_(std::move(loaded.config)),
      weights_(std::move(loaded.weights)),
      options_(options),
      inv_freq_(rope_inverse_frequencies(config_, options.device())),
      attention_block_elements_(options.device().is_cpu() ? kAttentionBlockElements : kDeviceAttentionBlockElements) {}

std::vector<LayerKVCache> LlamaModel::NewCaches(const MemoryPolicy& policy) const {
  std::vector<LayerKVCache> caches;
  caches.reserve(static_cast<std::size_t>(config_.n_layers));
  for (int64_t l = 0; l < config_.n_layers; ++l) {
    caches.emplace_back(config_.n_kv_heads, config_.head_dim, options_, policy.token_state());
  }
  return caches;
}

at::Tensor LlamaModel::RmsNorm(const at::Tensor& x, const at::Tensor& weight) const {
  // In float32 whatever the compute dtype, as Hugging Face's LlamaRMSNorm does.
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor normalized = x32 * at::rsqrt(x32.square().mean(-1, /*keepdim=*/true) + config_.norm_eps);
  return weight * normalized.to(x.scalar_type());
}

Result<at::Tensor> LlamaModel::Attention(int layer, const at::Tensor& x, const at::Tensor& positions,
                                         const RopeTables& rope, LayerKVCache& cache, MemoryPolicy& policy) const {
  const LlamaLayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
  const int64_t t = x.size(0), hd = config_.head_dim, heads = config_.n_heads, kv_heads = config_.n_kv_heads;
  const int64_t group = heads / kv_heads;
  // Projections, as [heads, t, head_dim]; Qwen3 normalizes each head's query and key before rotating them.
  at::Tensor q = Project(x, w.wq, w.bq).view({t, heads, hd});
  at::Tensor k = Project(x, w.wk, w.bk).view({t, kv_heads, hd});
  if (config_.qk_norm) {
    q = RmsNorm(q, w.q_norm);
    k = RmsNorm(k, w.k_norm);
  }
  q = apply_rope(q.transpose(0, 1), rope);
  k = apply_rope(k.transpose(0, 1), rope);
  const at::Tensor v = Project(x, w.wv, w.bv).view({t, kv_heads, hd}).transpose(0, 1);
  NAMM_RETURN_IF_ERROR(cache.Append(k, v, positions));

  // The chunk's queries go through attention in blocks of rows, so that the scores and probabilities alive at
  // once ([heads, rows, n] each) stay near attention_block_elements_ whatever the chunk and the cache: at 32k
  // cached tokens a 128-token chunk's probabilities alone were 512 MiB on an 8B-shaped model. Rows are
  // independent, and policies observe each block (its first query's index says where it lies).
  const int64_t n = cache.size(), n_old = n - t, first_query = cache.tokens_seen() - t;
  const int64_t block = std::clamp<int64_t>(attention_block_elements_ / (heads * n), 1, t);
  const at::Tensor q_grouped = q.reshape({kv_heads, group, t, hd});  // query head h = kv head h / group, member h % group
  const int64_t window = config_.window_of(layer);
  const bool windowed = window > 0 && cache.tokens_seen() > window;
  at::Tensor out = at::empty({kv_heads, group, t, hd}, x.options());
  // A policy that recomputes earlier queries' attention gets the newest queries with their log-sum-exp.
  const int64_t history = std::min(policy.query_history(), t);
  at::Tensor log_sum_exp = history > 0 ? at::empty({kv_heads, group, history}, options_.dtype(at::kFloat)) : at::Tensor();
  for (int64_t b0 = 0; b0 < t; b0 += block) {
    const int64_t rows = std::min(block, t - b0);
    // Scores of every query head against its KV head's cache: [kv_heads, group, rows, n]. The group's queries
    // are stacked as rows of one batched product per KV head (a broadcast matmul would copy the cache group times).
    at::Tensor scores = at::bmm(q_grouped.narrow(2, b0, rows).reshape({kv_heads, group * rows, hd}),
                                cache.keys().transpose(1, 2))
                            .view({kv_heads, group, rows, n});
    scores.mul_(1.0 / std::sqrt(static_cast<double>(hd)));
    // Causal among the chunk's own tokens (row r is chunk token b0 + r); every older cached token is visible.
    const at::Tensor future = at::ones({rows, t}, options_.dtype(at::kBool)).triu(b0 + 1);
    scores.narrow(3, n_old, t).masked_fill_(future, -std::numeric_limits<float>::infinity());
    // A sliding window hides keys window or more positions behind the query (by position: eviction leaves gaps).
    if (windowed) {
      const at::Tensor behind =
          positions.narrow(0, b0, rows).view({1, rows, 1}) - cache.positions().unsqueeze(1);  // [kv_heads, rows, n]
      scores.masked_fill_(behind.ge(window).unsqueeze(1), -std::numeric_limits<float>::infinity());
    }
    // Probabilities in float32, and the log-sum-exp of the rows the query history keeps.
    const int64_t lo = std::max(b0, t - history);
    const at::Tensor probs = attention_probabilities(
        scores, lo - b0, lo < b0 + rows ? log_sum_exp.narrow(2, lo - (t - history), b0 + rows - lo) : at::Tensor());
    scores = at::Tensor();  // freed before the policy and the next product
    if (policy.needs_attention()) {
      NAMM_RETURN_IF_ERROR(policy.Observe(layer, probs.view({heads, rows, n}), first_query + b0, cache));
    }
    out.narrow(2, b0, rows)
        .copy_(at::bmm(probs.to(x.scalar_type()).view({kv_heads, group * rows, n}), cache.values())
                   .view({kv_heads, group, rows, hd}));
  }
  if (history > 0) {
    NAMM_RETURN_IF_ERROR(cache.query_history().Record(q.narrow(1, t - history, history),
                                                     log_sum_exp.view({heads, history}), first_query + t - history,
                                                     window, policy.query_history()));
  }
  return Project(out.view({heads, t, hd}).transpose(0, 1).reshape({t, heads * hd}), w.wo, w.bo);
}

at::Tensor LlamaModel::FeedForward(const LlamaLayerWeights& w, const at::Tensor& x) const {
  return Project(at::silu(Project(x, w.w_gate, w.b_gate)) * Project(x, w.w_up, w.b_up), w.w_down, w.b_down);
}

Result<at::Tensor> LlamaModel::Forward(const at::Tensor& tokens, std::vector<LayerKVCache>& caches,
                                       MemoryPolicy& policy, bool all_logits) const {
  if (tokens.dim() != 1 || tokens.size(0) == 0) return Status::InvalidArgument("Forward needs a non-empty [t] token tensor");
  if (static_cast<int64_t>(caches.size()) != config_.n_layers) {
    return Status::InvalidArgument("Forward needs one cache per layer (" + std::to_string(config_.n_layers) + ")");
  }
  const int64_t t = tokens.size(0), start = caches[0].tokens_seen();
  // Checked where the ids are: host ids (as the generator passes them) cost no device round trip per token.
  const at::Tensor checked = tokens.device().is_cpu() ? tokens.to(at::kLong).contiguous() : tokens.to(at::kLong);
  bool in_vocabulary = true;
  if (checked.device().is_cpu()) {
    const int64_t* id = checked.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i) in_vocabulary = in_vocabulary && id[i] >= 0 && id[i] < config_.vocab_size;
  } else {
    in_vocabulary = checked.min().item<int64_t>() >= 0 && checked.max().item<int64_t>() < config_.vocab_size;
  }
  if (!in_vocabulary) {
    return Status::InvalidArgument("token id outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
  }
  const at::Tensor ids = checked.to(options_.device());
  const at::Tensor positions = at::arange(start, start + t, options_.dtype(at::kLong));
  // One table of rotations for every layer; dynamic NTK rescales from the length this call reaches.
  const RopeTables rope =
      rope_tables(rope_depends_on_length(config_) ? rope_inverse_frequencies(config_, options_.device(), start + t)
                                                  : inv_freq_,
                  positions, config_.rope_scaling.yarn_attention_factor());

  at::Tensor x = weights_.token_embedding.index_select(0, ids);  // [t, dim]
  for (int layer = 0; layer < static_cast<int>(config_.n_layers); ++layer) {
    const LlamaLayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
    NAMM_ASSIGN_OR_RETURN(at::Tensor attended,
                          Attention(layer, RmsNorm(x, w.attention_norm), positions, rope,
                                    caches[static_cast<std::size_t>(layer)], policy));
    x = x + attended;
    x = x + FeedForward(w, RmsNorm(x, w.ffn_norm));
  }
  const at::Tensor last = all_logits ? x : x.narrow(0, t - 1, 1);
  return Project(RmsNorm(last, weights_.final_norm), weights_.lm_head).to(at::kFloat);
}

}  // namespace namm::worker
