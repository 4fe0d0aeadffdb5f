#include "namm/worker/llama_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <utility>

#include "aten.h"
#include "namm/batch_invariant.h"
#include "namm/query_history.h"
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

std::pair<at::Tensor, at::Tensor> LlamaModel::RotateQueriesAndKeys(int layer, const at::Tensor& q_rows,
                                                                   const at::Tensor& k_rows,
                                                                   const RopeTables& rope) const {
  const LlamaLayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
  const int64_t rows = q_rows.size(0), hd = config_.head_dim, heads = config_.n_heads, kv_heads = config_.n_kv_heads;
  // Qwen3 normalizes each head's query and key before rotating them.
  at::Tensor q = q_rows, k = k_rows;
  if (config_.qk_norm) {
    q = invariant_rms_norm(q.reshape({rows * heads, hd}), w.q_norm, config_.norm_eps);
    k = invariant_rms_norm(k.reshape({rows * kv_heads, hd}), w.k_norm, config_.norm_eps);
  }
  // Row r's table applies to all of its heads.
  const RopeTables per_row{rope.cos.unsqueeze(1), rope.sin.unsqueeze(1)};
  return {apply_rope(q.reshape({rows, heads, hd}), per_row), apply_rope(k.reshape({rows, kv_heads, hd}), per_row)};
}

bool LlamaModel::KernelAttends(const at::Tensor& q, const LayerKVCache& cache, const MemoryPolicy& policy) const {
  return row_invariant(q) &&
         (!policy.needs_attention() || config_.n_heads * q.size(1) * cache.size() <= attention_block_elements_);
}

Result<at::Tensor> LlamaModel::Attend(int layer, const at::Tensor& q, LayerKVCache& cache, MemoryPolicy& policy) const {
  const int64_t t = q.size(1), hd = config_.head_dim, heads = config_.n_heads, kv_heads = config_.n_kv_heads;
  const int64_t group = heads / kv_heads;
  const at::Tensor positions = cache.positions().select(0, 0).narrow(0, cache.size() - t, t);
  // The chunk's queries go through attention in blocks of rows, so that the scores and probabilities alive at
  // once ([heads, rows, n] each) stay near attention_block_elements_ whatever the chunk and the cache: at 32k
  // cached tokens a 128-token chunk's probabilities alone were 512 MiB on an 8B-shaped model. Rows are
  // independent, and policies observe each block (its first query's index says where it lies).
  const int64_t n = cache.size(), n_old = n - t, first_query = cache.tokens_seen() - t;
  const int64_t block = std::clamp<int64_t>(attention_block_elements_ / (heads * n), 1, t);
  const at::Tensor q_grouped = q.reshape({kv_heads, group, t, hd});  // query head h = kv head h / group, member h % group
  const int64_t window = config_.window_of(layer);
  const bool windowed = window > 0 && cache.tokens_seen() > window;
  at::Tensor out = at::empty({kv_heads, group, t, hd}, q.options());
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
        .copy_(at::bmm(probs.to(q.scalar_type()).view({kv_heads, group * rows, n}), cache.values())
                   .view({kv_heads, group, rows, hd}));
  }
  if (history > 0) {
    NAMM_RETURN_IF_ERROR(cache.query_history().Record(q.narrow(1, t - history, history),
                                                     log_sum_exp.view({heads, history}), first_query + t - history,
                                                     window, policy.query_history()));
  }
  return out.view({heads, t, hd}).transpose(0, 1).reshape({t, heads * hd});
}

at::Tensor LlamaModel::FeedForward(const LlamaLayerWeights& w, const at::Tensor& x) const {
  return invariant_linear(
      invariant_silu_mul(invariant_linear(x, w.w_gate, w.b_gate), invariant_linear(x, w.w_up, w.b_up)), w.w_down,
      w.b_down);
}

Status LlamaModel::CheckStep(const Step& step) const {
  if (step.caches == nullptr || step.policy == nullptr) return Status::InvalidArgument("Forward needs caches and a policy");
  if (step.tokens.dim() != 1 || step.tokens.size(0) == 0) {
    return Status::InvalidArgument("Forward needs a non-empty [t] token tensor");
  }
  if (static_cast<int64_t>(step.caches->size()) != config_.n_layers) {
    return Status::InvalidArgument("Forward needs one cache per layer (" + std::to_string(config_.n_layers) + ")");
  }
  // Checked where the ids are: host ids (as the generator passes them) cost no device round trip per token.
  const at::Tensor ids = step.tokens.to(at::kLong);
  bool in_vocabulary = true;
  if (ids.device().is_cpu()) {
    const at::Tensor host = ids.contiguous();
    const int64_t* id = host.data_ptr<int64_t>();
    for (int64_t i = 0; i < host.size(0); ++i) in_vocabulary = in_vocabulary && id[i] >= 0 && id[i] < config_.vocab_size;
  } else {
    in_vocabulary = ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < config_.vocab_size;
  }
  if (!in_vocabulary) {
    return Status::InvalidArgument("token id outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
  }
  return Status::Ok();
}

Result<at::Tensor> LlamaModel::Forward(const at::Tensor& tokens, std::vector<LayerKVCache>& caches,
                                       MemoryPolicy& policy, bool all_logits) const {
  return std::move(ForwardBatch({Step{tokens, &caches, &policy, all_logits}}).front());
}

// Where each sequence of a batch lies in the packed rows: rows [offset, offset + length), at its positions; the
// RoPE tables of all rows, each sequence's part computed as it alone would compute it.
struct LlamaModel::Packing {
  std::vector<int64_t> offset, length;
  std::vector<at::Tensor> positions;
  RopeTables rope;  // [total rows, head_dim] each
};

void LlamaModel::AttendBatch(int layer, const std::vector<Step>& steps, const Packing& packing, const at::Tensor& q,
                             const at::Tensor& k, const at::Tensor& v, const at::Tensor& heads_out,
                             std::vector<Status>& errors) const {
  const auto count = steps.size();
  const int64_t q_width = config_.n_heads * config_.head_dim;
  std::vector<at::Tensor> queries(count);
  std::vector<AttentionRequest> kernel_inputs;
  std::vector<std::size_t> kernel_sequences;
  const int64_t window = config_.window_of(layer);
  for (std::size_t s = 0; s < count; ++s) {
    if (!errors[s].ok()) continue;
    LayerKVCache& cache = (*steps[s].caches)[static_cast<std::size_t>(layer)];
    MemoryPolicy& policy = *steps[s].policy;
    const int64_t first = packing.offset[s], t = packing.length[s];
    const at::Tensor v_heads = v.narrow(0, first, t).reshape({t, config_.n_kv_heads, config_.head_dim});
    if (Status appended = cache.Append(k.narrow(0, first, t).transpose(0, 1), v_heads.transpose(0, 1),
                                       packing.positions[s]);
        !appended.ok()) {
      errors[s] = std::move(appended);
      continue;
    }
    queries[s] = q.narrow(0, first, t).transpose(0, 1);  // [heads, t, head_dim]
    if (KernelAttends(queries[s], cache, policy)) {
      AttentionRequest in;
      in.q = q.narrow(0, first, t).reshape({t, q_width});
      in.keys = cache.keys();
      in.values = cache.values();
      in.key_positions = cache.positions();
      in.first_position = cache.tokens_seen() - t;
      in.window = window > 0 && cache.tokens_seen() > window ? window : 0;
      in.out = heads_out.narrow(0, first, t);
      in.probabilities = policy.needs_attention();
      in.log_sum_exp = policy.query_history() > 0;
      kernel_inputs.push_back(std::move(in));
      kernel_sequences.push_back(s);
      continue;
    }
    Result<at::Tensor> out = Attend(layer, queries[s], cache, policy);
    if (!out.ok()) {
      errors[s] = out.status();
      continue;
    }
    heads_out.narrow(0, first, t).copy_(*out);
  }
  const std::vector<AttentionResult> attended =
      kernel_inputs.empty() ? std::vector<AttentionResult>()
                            : invariant_attention(kernel_inputs, config_.n_heads,
                                                  1.0 / std::sqrt(static_cast<double>(config_.head_dim)));
  // What the policies see: the chunk's attention probabilities, and the newest queries with their log-sum-exp.
  for (std::size_t i = 0; i < kernel_sequences.size(); ++i) {
    const std::size_t s = kernel_sequences[i];
    LayerKVCache& cache = (*steps[s].caches)[static_cast<std::size_t>(layer)];
    MemoryPolicy& policy = *steps[s].policy;
    const int64_t t = packing.length[s], first_query = cache.tokens_seen() - t;
    Status observed = Status::Ok();
    if (policy.needs_attention()) observed = policy.Observe(layer, attended[i].probabilities, first_query, cache);
    const int64_t history = std::min(policy.query_history(), t);
    if (observed.ok() && history > 0) {
      observed = cache.query_history().Record(queries[s].narrow(1, t - history, history),
                                              attended[i].log_sum_exp.narrow(1, t - history, history),
                                              first_query + t - history, window, policy.query_history());
    }
    if (!observed.ok()) errors[s] = std::move(observed);
  }
}

std::vector<Result<at::Tensor>> LlamaModel::ForwardBatch(const std::vector<Step>& steps) const {
  // Sequence s is rows [offset[s], offset[s] + length[s]) of the packed hidden states; a failed one keeps its
  // rows (nothing reads them) and its error.
  const auto count = steps.size();
  std::vector<Status> errors(count);
  Packing packing{std::vector<int64_t>(count), std::vector<int64_t>(count), std::vector<at::Tensor>(count), {}};
  std::vector<int64_t>& offset = packing.offset;
  std::vector<int64_t>& length = packing.length;
  std::vector<at::Tensor> ids, cos, sin;
  // A table depends only on the rows' first position and count, so sequences in lockstep share one.
  std::map<std::pair<int64_t, int64_t>, RopeTables> tables;
  int64_t total = 0;
  for (std::size_t s = 0; s < count; ++s) {
    const Step& step = steps[s];
    errors[s] = CheckStep(step);
    if (!errors[s].ok()) continue;
    const int64_t t = step.tokens.size(0), start = (*step.caches)[0].tokens_seen();
    offset[s] = total;
    length[s] = t;
    total += t;
    ids.push_back(step.tokens.to(at::kLong).to(options_.device()));
    packing.positions[s] = at::arange(start, start + t, options_.dtype(at::kLong));
    // Computed as the sequence alone would compute it; dynamic NTK rescales from the length it reaches.
    auto [table, made] = tables.try_emplace({start, t});
    if (made) {
      table->second = rope_tables(rope_depends_on_length(config_)
                                      ? rope_inverse_frequencies(config_, options_.device(), start + t)
                                      : inv_freq_,
                                  packing.positions[s], config_.rope_scaling.yarn_attention_factor());
    }
    cos.push_back(table->second.cos);
    sin.push_back(table->second.sin);
  }
  const auto alive = [&](std::size_t s) { return errors[s].ok(); };

  const int64_t q_width = config_.n_heads * config_.head_dim;
  if (ids.empty()) return std::vector<Result<at::Tensor>>(errors.begin(), errors.end());
  packing.rope = ids.size() == 1 ? RopeTables{cos.front(), sin.front()} : RopeTables{at::cat(cos, 0), at::cat(sin, 0)};
  at::Tensor x = weights_.token_embedding.index_select(0, at::cat(ids, 0));  // [total, dim]
  for (int layer = 0; layer < static_cast<int>(config_.n_layers); ++layer) {
    const LlamaLayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
    const at::Tensor normed = invariant_rms_norm(x, w.attention_norm, config_.norm_eps);
    const auto [q, k] =
        RotateQueriesAndKeys(layer, invariant_linear(normed, w.wq, w.bq), invariant_linear(normed, w.wk, w.bk), packing.rope);
    const at::Tensor v = invariant_linear(normed, w.wv, w.bv);
    const at::Tensor heads_out = at::zeros({total, q_width}, x.options());
    AttendBatch(layer, steps, packing, q, k, v, heads_out, errors);
    x = x + invariant_linear(heads_out, w.wo, w.bo);
    x = x + FeedForward(w, invariant_rms_norm(x, w.ffn_norm, config_.norm_eps));
  }
  // The rows whose logits are wanted, through the final norm and the head together.
  std::vector<at::Tensor> wanted;
  for (std::size_t s = 0; s < count; ++s) {
    if (!alive(s)) continue;
    wanted.push_back(steps[s].all_logits ? x.narrow(0, offset[s], length[s]) : x.narrow(0, offset[s] + length[s] - 1, 1));
  }
  std::vector<Result<at::Tensor>> results(errors.begin(), errors.end());
  if (wanted.empty()) return results;
  const at::Tensor logits =
      invariant_linear(invariant_rms_norm(at::cat(wanted, 0), weights_.final_norm, config_.norm_eps), weights_.lm_head)
          .to(at::kFloat);
  int64_t at_row = 0;
  for (std::size_t s = 0; s < count; ++s) {
    if (!alive(s)) continue;
    const int64_t rows = steps[s].all_logits ? length[s] : 1;
    results[s] = logits.narrow(0, at_row, rows);
    at_row += rows;
  }
  return results;
}

}  // namespace namm::worker
