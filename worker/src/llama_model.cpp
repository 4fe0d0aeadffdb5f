#include "namm/worker/llama_model.h"

#include <cmath>
#include <limits>

#include "aten.h"
#include "namm/worker/rope.h"

namespace namm::worker {

Result<LlamaModel> LlamaModel::Load(const std::string& path, const LoadOptions& options) {
  NAMM_ASSIGN_OR_RETURN(LoadedModel loaded, load_model(path, options));
  return LlamaModel(std::move(loaded), at::TensorOptions().dtype(options.dtype).device(options.device));
}

LlamaModel::LlamaModel(LoadedModel loaded, at::TensorOptions options)
    : config_(std::move(loaded.config)),
      weights_(std::move(loaded.weights)),
      options_(options),
      inv_freq_(rope_inverse_frequencies(config_).to(options.device())) {}

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
                                         LayerKVCache& cache, MemoryPolicy& policy) const {
  const LlamaLayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
  const int64_t t = x.size(0), hd = config_.head_dim, heads = config_.n_heads, kv_heads = config_.n_kv_heads;
  const int64_t group = heads / kv_heads;
  // Projections, as [heads, t, head_dim].
  const RopeTables rope = rope_tables(inv_freq_, positions);
  const at::Tensor q = apply_rope(at::linear(x, w.wq, w.bq).view({t, heads, hd}).transpose(0, 1), rope);
  const at::Tensor k = apply_rope(at::linear(x, w.wk, w.bk).view({t, kv_heads, hd}).transpose(0, 1), rope);
  const at::Tensor v = at::linear(x, w.wv, w.bv).view({t, kv_heads, hd}).transpose(0, 1);
  NAMM_RETURN_IF_ERROR(cache.Append(k, v, positions));

  // Scores of every query head against its KV head's cache: [kv_heads, group, t, n].
  const int64_t n = cache.size(), n_old = n - t;
  at::Tensor scores = q.reshape({kv_heads, group, t, hd}).matmul(cache.keys().transpose(1, 2).unsqueeze(1));
  scores.mul_(1.0 / std::sqrt(static_cast<double>(hd)));
  // Causal among the chunk's own tokens; every older cached token is visible.
  const at::Tensor future = at::ones({t, t}, options_.dtype(at::kBool)).triu(1);
  scores.narrow(3, n_old, t).masked_fill_(future, -std::numeric_limits<float>::infinity());
  const at::Tensor probs = scores.to(at::kFloat).softmax(-1);
  if (policy.needs_attention()) {
    NAMM_RETURN_IF_ERROR(policy.Observe(layer, probs.view({heads, t, n}), cache));
  }
  const at::Tensor out = probs.to(x.scalar_type()).matmul(cache.values().unsqueeze(1));  // [kv, group, t, hd]
  return at::linear(out.reshape({heads, t, hd}).transpose(0, 1).reshape({t, heads * hd}), w.wo, w.bo);
}

at::Tensor LlamaModel::FeedForward(const LlamaLayerWeights& w, const at::Tensor& x) const {
  return at::linear(at::silu(at::linear(x, w.w_gate, w.b_gate)) * at::linear(x, w.w_up, w.b_up), w.w_down, w.b_down);
}

Result<at::Tensor> LlamaModel::Forward(const at::Tensor& tokens, std::vector<LayerKVCache>& caches,
                                       MemoryPolicy& policy, bool all_logits) const {
  if (tokens.dim() != 1 || tokens.size(0) == 0) return Status::InvalidArgument("Forward needs a non-empty [t] token tensor");
  if (static_cast<int64_t>(caches.size()) != config_.n_layers) {
    return Status::InvalidArgument("Forward needs one cache per layer (" + std::to_string(config_.n_layers) + ")");
  }
  const int64_t t = tokens.size(0), start = caches[0].tokens_seen();
  const at::Tensor ids = tokens.to(options_.device(), at::kLong);
  if (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= config_.vocab_size) {
    return Status::InvalidArgument("token id outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
  }
  const at::Tensor positions = at::arange(start, start + t, options_.dtype(at::kLong));

  at::Tensor x = weights_.token_embedding.index_select(0, ids);  // [t, dim]
  for (int layer = 0; layer < static_cast<int>(config_.n_layers); ++layer) {
    const LlamaLayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
    NAMM_ASSIGN_OR_RETURN(at::Tensor attended,
                          Attention(layer, RmsNorm(x, w.attention_norm), positions,
                                    caches[static_cast<std::size_t>(layer)], policy));
    x = x + attended;
    x = x + FeedForward(w, RmsNorm(x, w.ffn_norm));
  }
  const at::Tensor last = all_logits ? x : x.narrow(0, t - 1, 1);
  return at::linear(RmsNorm(last, weights_.final_norm), weights_.lm_head).to(at::kFloat);
}

}  // namespace namm::worker
