#include "namm/worker/llama_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

#include "aten.h"
#include "fused_attention.h"
#include "namm/batch_invariant.h"
#include "namm/cpu_threads.h"
#include "namm/query_history.h"
#include "namm/tensor_view.h"
#include "namm/worker/rope.h"

namespace namm::worker {

struct LlamaModel::RopeEntry {
  at::Tensor positions;  // [t] int64
  RopeTables tables;     // [t, head_dim] each
};

// Entries by (first position, length); cleared whole when it would pass kMaxBytes (a table is cheap to make
// again, and a long generation reaches a new one per decoded token).
struct LlamaModel::RopeCache {
  static constexpr int64_t kMaxBytes = int64_t{64} << 20;
  std::mutex mutex;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const RopeEntry>> entries;
  int64_t bytes = 0;
};

// Every layer's products of a packed batch (float32, host) in buffers of the batch's rows, the same for every
// layer: a small model's decode step otherwise allocated ten tensors per layer (`--profile 1`: 52 of a step's
// 115 top-level operators in stories260K were at::empty), a fifth of a single sequence's decoding time in
// malloc and tensor bookkeeping. Buffers grow to the most rows seen and are views of that (a pass's rows are
// their front); a pass holds its workspace alone, and returns it to the model's pool at its end unless its
// buffers passed kKeptBytes (a large model's long prefill: those are freed as before, not held).
struct LlamaModel::Workspace {
  static constexpr int64_t kKeptBytes = int64_t{64} << 20;
  int64_t capacity = 0, bytes = 0;
  at::Tensor normed_buffer, q_buffer, k_buffer, v_buffer, heads_buffer, projected_buffer, gate_buffer, up_buffer;
  at::Tensor normed, q, k, v, heads_out, projected, gate, up;  // [rows, width] views for the current pass

  void Fit(int64_t rows, const LlamaConfig& c, const at::TensorOptions& options) {
    const int64_t q_width = c.n_heads * c.head_dim, kv_width = c.n_kv_heads * c.head_dim;
    if (rows > capacity) {
      capacity = rows;
      const auto make = [&](int64_t width) { return at::empty({capacity, width}, options); };
      normed_buffer = make(c.dim);
      q_buffer = make(q_width);
      k_buffer = make(kv_width);
      v_buffer = make(kv_width);
      heads_buffer = make(q_width);
      projected_buffer = make(c.dim);
      gate_buffer = make(c.hidden_dim);
      up_buffer = make(c.hidden_dim);
      bytes = capacity * (2 * c.dim + 2 * q_width + 2 * kv_width + 2 * c.hidden_dim) * 4;
    }
    const auto front = [&](const at::Tensor& buffer) { return narrow_view(buffer, 0, 0, rows); };
    normed = front(normed_buffer);
    q = front(q_buffer);
    k = front(k_buffer);
    v = front(v_buffer);
    heads_out = front(heads_buffer);
    projected = front(projected_buffer);
    gate = front(gate_buffer);
    up = front(up_buffer);
  }
};

struct LlamaModel::WorkspacePool {
  std::mutex mutex;
  std::vector<std::unique_ptr<Workspace>> idle;

  std::unique_ptr<Workspace> Take() {
    std::lock_guard<std::mutex> lock(mutex);
    if (idle.empty()) return std::make_unique<Workspace>();
    std::unique_ptr<Workspace> ws = std::move(idle.back());
    idle.pop_back();
    return ws;
  }
  void Give(std::unique_ptr<Workspace> ws) {
    if (ws->bytes > Workspace::kKeptBytes) return;
    std::lock_guard<std::mutex> lock(mutex);
    idle.push_back(std::move(ws));
  }
};

Result<LlamaModel> LlamaModel::Load(const std::string& path, const LoadOptions& options) {
  NAMM_ASSIGN_OR_RETURN(LoadedModel loaded, load_model(path, options));
  return LlamaModel(std::move(loaded), at::TensorOptions().dtype(options.dtype).device(options.device));
}

LlamaModel::LlamaModel(LoadedModel loaded, at::TensorOptions options)
    : config_(std::move(loaded.config)),
      weights_(std::move(loaded.weights)),
      options_(options),
      inv_freq_(rope_inverse_frequencies(config_, options.device())),
      attention_block_elements_(options.device().is_cpu() ? kAttentionBlockElements : kDeviceAttentionBlockElements),
      rope_cache_(std::make_shared<RopeCache>()),
      workspaces_(std::make_shared<WorkspacePool>()) {
  for (const LlamaLayerWeights& w : weights_.layers) {
    projections_.push_back(Projections{{w.wq, w.bq}, {w.wk, w.bk}, {w.wv, w.bv}, {w.wo, w.bo},
                                       {w.w_gate, w.b_gate}, {w.w_up, w.b_up}, {w.w_down, w.b_down}});
  }
  head_ = InvariantLinear(weights_.lm_head, at::Tensor());
}

std::vector<LayerKVCache> LlamaModel::NewCaches(const MemoryPolicy& policy) const {
  std::vector<LayerKVCache> caches;
  caches.reserve(static_cast<std::size_t>(config_.n_layers));
  for (int64_t l = 0; l < config_.n_layers; ++l) {
    caches.emplace_back(config_.n_kv_heads, config_.head_dim, options_, policy.token_state(), kv_block_pool_);
  }
  return caches;
}

Status use_kv_blocks(LlamaModel& model, int64_t block_tokens, int64_t max_kv_bytes) {
  if (block_tokens == 0) return model.set_kv_block_pool(nullptr);
  if (block_tokens < 0 || max_kv_bytes < 0) return Status::InvalidArgument("--kv-block-tokens must be 0 or more");
  const LlamaConfig& c = model.config();
  const int64_t block_bytes = KvBlockPool::BlockBytes(block_tokens, c.head_dim, model.options().dtype().toScalarType());
  const int64_t max_blocks = max_kv_bytes / block_bytes;
  NAMM_ASSIGN_OR_RETURN(std::shared_ptr<KvBlockPool> pool,
                        KvBlockPool::Create(block_tokens, c.head_dim, model.options(), max_blocks));
  if (max_kv_bytes > 0 && max_blocks < c.n_layers * c.n_kv_heads) {
    return Status::InvalidArgument("--max-kv-bytes " + std::to_string(max_kv_bytes) + " holds fewer KV blocks (" +
                                   std::to_string(max_blocks) + " of " + std::to_string(block_bytes) +
                                   " bytes) than one token needs (a block per layer and KV head)");
  }
  return model.set_kv_block_pool(std::move(pool));
}

Status LlamaModel::set_kv_block_pool(std::shared_ptr<KvBlockPool> pool) {
  if (pool != nullptr && (pool->head_dim() != config_.head_dim || pool->options().dtype() != options_.dtype() ||
                          pool->options().device() != options_.device())) {
    return Status::InvalidArgument("the KV block pool's heads (" + std::to_string(pool->head_dim()) +
                                   " elements) do not match the model's (" + std::to_string(config_.head_dim) +
                                   "), or its dtype or device differ");
  }
  kv_block_pool_ = std::move(pool);
  return Status::Ok();
}

// Where each sequence of a batch lies in the packed rows: rows [offset, offset + length), at the positions and
// with the RoPE tables of its entry (null for a sequence that failed its checks).
struct LlamaModel::Packing {
  std::vector<int64_t> offset, length;
  std::vector<std::shared_ptr<const RopeEntry>> tables;
  // Where the rotation is by tensor operations (not our in-place kernel): every row's tables, [total, 1,
  // head_dim] in the model's dtype, made once per forward pass rather than per layer (on a GPU, six launches
  // fewer per layer and step).
  RopeTables per_row;

  // The tables of the pass's rows, as apply_rope applies them to every head of a row.
  RopeTables PerRow(at::ScalarType dtype) const {
    std::vector<at::Tensor> cos, sin;
    for (const auto& entry : tables) {
      if (!entry) continue;
      cos.push_back(entry->tables.cos);
      sin.push_back(entry->tables.sin);
    }
    const auto joined = [&](const std::vector<at::Tensor>& parts) {
      return (parts.size() == 1 ? parts.front() : at::cat(parts, 0)).unsqueeze(1).to(dtype);
    };
    return {joined(cos), joined(sin)};
  }
};

std::pair<at::Tensor, at::Tensor> LlamaModel::RotateQueriesAndKeys(int layer, const at::Tensor& q_rows,
                                                                   const at::Tensor& k_rows,
                                                                   const Packing& packing) const {
  const LlamaLayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
  const int64_t rows = q_rows.size(0), hd = config_.head_dim, heads = config_.n_heads, kv_heads = config_.n_kv_heads;
  // Qwen3 normalizes each head's query and key before rotating them.
  at::Tensor q = q_rows, k = k_rows;
  if (config_.qk_norm) {
    q = invariant_rms_norm(q.reshape({rows * heads, hd}), w.q_norm, config_.norm_eps).view({rows, heads * hd});
    k = invariant_rms_norm(k.reshape({rows * kv_heads, hd}), w.k_norm, config_.norm_eps).view({rows, kv_heads * hd});
  }
  if (row_invariant(q) && q.is_contiguous() && k.is_contiguous()) {
    // In place, each sequence's rows by its own tables (the same bits as apply_rope): the products' outputs are
    // this pass's own.
    for (std::size_t s = 0; s < packing.tables.size(); ++s) {
      if (!packing.tables[s]) continue;
      const RopeTables& table = packing.tables[s]->tables;
      invariant_rope_(q, heads, packing.offset[s], table.cos, table.sin);
      invariant_rope_(k, kv_heads, packing.offset[s], table.cos, table.sin);
    }
    return {q.view({rows, heads, hd}), k.view({rows, kv_heads, hd})};
  }
  // Elsewhere by tensor operations; row r's table applies to all of its heads.
  const RopeTables per_row =
      packing.per_row.cos.defined() ? packing.per_row : packing.PerRow(q.scalar_type());
  return {apply_rope(q.reshape({rows, heads, hd}), per_row), apply_rope(k.reshape({rows, kv_heads, hd}), per_row)};
}

std::shared_ptr<const LlamaModel::RopeEntry> LlamaModel::RopeFor(int64_t start, int64_t t) const {
  RopeCache& cache = *rope_cache_;
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    if (const auto it = cache.entries.find({start, t}); it != cache.entries.end()) return it->second;
  }
  // Computed as the sequence alone would compute it; dynamic NTK rescales from the length it reaches.
  auto entry = std::make_shared<RopeEntry>();
  entry->positions = at::arange(start, start + t, options_.dtype(at::kLong));
  entry->tables = rope_tables(rope_depends_on_length(config_)
                                  ? rope_inverse_frequencies(config_, options_.device(), start + t)
                                  : inv_freq_,
                              entry->positions, config_.rope_scaling.yarn_attention_factor());
  const int64_t bytes = 2 * t * config_.head_dim * 4 + t * 8;
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (cache.bytes + bytes > RopeCache::kMaxBytes) {
    cache.entries.clear();
    cache.bytes = 0;
  }
  if (cache.entries.emplace(std::make_pair(start, t), entry).second) cache.bytes += bytes;
  return entry;
}

bool LlamaModel::KernelReads(const at::Tensor& q, const LayerKVCache& cache) const {
  return row_invariant(q) && (!cache.in_blocks() || cache.block_view().keys != nullptr);
}

bool LlamaModel::KernelAttends(const at::Tensor& q, int64_t t, const LayerKVCache& cache,
                                const MemoryPolicy& policy) const {
  return KernelReads(q, cache) &&
         (!policy.needs_attention() || config_.n_heads * t * cache.size() <= attention_block_elements_);
}

Status LlamaModel::Attend(int layer, const at::Tensor& q_rows, const at::Tensor& q_heads, LayerKVCache& cache,
                          MemoryPolicy& policy, const at::Tensor& out) const {
  const int64_t t = q_rows.size(0), hd = config_.head_dim, heads = config_.n_heads, kv_heads = config_.n_kv_heads;
  const int64_t group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  // The chunk's queries go through attention in blocks of rows, so that the scores and probabilities alive at
  // once ([heads, rows, n] each) stay near attention_block_elements_ whatever the chunk and the cache: at 32k
  // cached tokens a 128-token chunk's probabilities alone were 512 MiB on an 8B-shaped model. Rows are
  // independent, and policies observe each block (its first query's index says where it lies).
  const int64_t n = cache.size(), n_old = n - t, first_query = cache.tokens_seen() - t;
  const int64_t block = std::clamp<int64_t>(attention_block_elements_ / (heads * n), 1, t);
  const int64_t window = config_.window_of(layer);
  const bool windowed = window > 0 && cache.tokens_seen() > window;
  // A policy that observes nothing on a GPU: libtorch's fused attention, where it has one and where it was
  // measured faster than the blocks below on an H200 (performance.md): prefill chunks of 512 rows (Llama 3 8B at
  // 12k and 32k tokens: prefill 1.5-3x faster) and decode steps over 8k keys or more. Chunks of 128 rows (an
  // 8B-shaped 2-layer model at 4k and 16k) and decode steps over 4k keys were slower.
  constexpr int64_t kFusedMinRows = 512, kFusedMinDecodeKeys = 8192;
  const bool fused_pays = t >= kFusedMinRows || (t == 1 && n >= kFusedMinDecodeKeys);
  if (fused_pays && !policy.needs_attention() && policy.query_history() == 0 && !windowed &&
      cache.vacant() == nullptr &&
      fused_causal_attention(q_heads, cache.keys(), cache.values(), attention_block_elements_, out)) {
    return Status::Ok();
  }
  // On our kernel where it reads the cache (each block the same bits as one call for every row), else with
  // libtorch's operations (any device and dtype).
  const bool kernel = KernelReads(q_rows, cache);
  // A policy that recomputes earlier queries' attention gets the newest queries with their log-sum-exp.
  const int64_t history = std::min(policy.query_history(), t);
  const at::Tensor log_sum_exp = history > 0 ? at::empty({heads, history}, options_.dtype(at::kFloat)) : at::Tensor();
  // The kernel's probabilities: one buffer for every block, [heads, rows, n] at its front.
  const at::Tensor kernel_probabilities =
      kernel && policy.needs_attention() ? at::empty({heads * block * n}, options_.dtype(at::kFloat)) : at::Tensor();
  for (int64_t b0 = 0; b0 < t; b0 += block) {
    const int64_t rows = std::min(block, t - b0);
    const int64_t lo = std::max(b0, t - history);  // the block's first row whose log-sum-exp the history keeps
    const at::Tensor block_lse =
        lo < b0 + rows ? log_sum_exp.narrow(1, lo - (t - history), b0 + rows - lo) : at::Tensor();
    at::Tensor probs;  // [heads, rows, n] float32 when the policy observes
    if (kernel) {
      const int64_t seen = n_old + b0 + rows;  // keys the block's last row sees
      AttentionRequest in;
      in.q = narrow_view(q_rows, 0, b0, rows);
      if (cache.in_blocks()) {
        in.blocks = cache.block_view();
        in.blocks.tokens = seen;
      } else {
        in.keys = narrow_view(cache.keys(), 1, 0, seen);
        in.values = narrow_view(cache.values(), 1, 0, seen);
      }
      in.key_positions = cache.positions();
      in.vacant = cache.vacant();
      in.first_position = first_query + b0;
      in.window = windowed ? window : 0;
      in.out = narrow_view(out, 0, b0, rows);
      in.probabilities = kernel_probabilities.defined();
      if (in.probabilities) {
        in.probabilities_out = kernel_probabilities.narrow(0, 0, heads * rows * n).view({heads, rows, n});
      }
      in.log_sum_exp = block_lse.defined();
      const AttentionResult result = std::move(invariant_attention({in}, heads, scale).front());
      if (in.log_sum_exp) block_lse.copy_(result.log_sum_exp.narrow(1, lo - b0, b0 + rows - lo));
      probs = result.probabilities;
    } else {
      // Scores of every query head against its KV head's cache: [kv_heads, group, rows, n]. The group's queries
      // are stacked as rows of one batched product per KV head (a broadcast matmul would copy the cache group times).
      const at::Tensor q_grouped = q_heads.narrow(1, b0, rows).reshape({kv_heads, group * rows, hd});
      // Scaled in the product (one rounding, no pass over the scores).
      at::Tensor scores = at::empty({kv_heads, group * rows, n}, q_grouped.options());
      scores.baddbmm_(q_grouped, cache.keys().transpose(1, 2), /*beta=*/0, /*alpha=*/scale);
      scores = scores.view({kv_heads, group, rows, n});
      // Causal among the chunk's own tokens (row r is chunk token b0 + r); every older cached token is visible.
      // The chunk's last token (a decode step's only one) hides nothing.
      if (b0 + 1 < t) {
        const at::Tensor future = at::ones({rows, t}, options_.dtype(at::kBool)).triu(b0 + 1);
        scores.narrow(3, n_old, t).masked_fill_(future, -std::numeric_limits<float>::infinity());
      }
      // A sliding window hides keys window or more positions behind the query (by position: eviction leaves gaps).
      if (windowed) {
        const at::Tensor query_positions = cache.positions().select(0, 0).narrow(0, n_old + b0, rows);
        const at::Tensor behind =
            query_positions.view({1, rows, 1}) - cache.positions().unsqueeze(1);  // [kv_heads, rows, n]
        scores.masked_fill_(behind.ge(window).unsqueeze(1), -std::numeric_limits<float>::infinity());
      }
      // A ragged cache's vacant slots hold no token.
      if (const int64_t* vacant = cache.vacant(); vacant != nullptr) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          if (vacant[h] > 0) scores[h].narrow(2, 0, vacant[h]).fill_(-std::numeric_limits<float>::infinity());
        }
      }
      // Probabilities in float32, and the log-sum-exp of the rows the query history keeps.
      const at::Tensor p = attention_probabilities(
          scores, lo - b0, block_lse.defined() ? block_lse.view({kv_heads, group, b0 + rows - lo}) : at::Tensor());
      scores = at::Tensor();  // freed before the next product
      narrow_view(out, 0, b0, rows)
          .view({rows, kv_heads, group, hd})
          .copy_(at::bmm(p.to(q_rows.scalar_type()).view({kv_heads, group * rows, n}), cache.values())
                     .view({kv_heads, group, rows, hd})
                     .permute({2, 0, 1, 3}));
      probs = p.view({heads, rows, n});
    }
    if (policy.needs_attention()) NAMM_RETURN_IF_ERROR(policy.Observe(layer, probs, first_query + b0, cache));
  }
  if (history > 0) {
    NAMM_RETURN_IF_ERROR(cache.query_history().Record(q_heads.narrow(1, t - history, history), log_sum_exp,
                                                     first_query + t - history, window, policy.query_history()));
  }
  return Status::Ok();
}

at::Tensor LlamaModel::FeedForward(const Projections& p, const at::Tensor& x, Workspace* ws) const {
  if (ws == nullptr) return p.down(invariant_silu_mul(p.gate(x), p.up(x)));
  const at::Tensor gate = p.gate(x, ws->gate);
  return p.down(invariant_silu_mul(gate, p.up(x, ws->up), gate), ws->projected);  // SwiGLU in place of gate
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

void LlamaModel::AttendBatch(int layer, const std::vector<Step>& steps, const Packing& packing, const at::Tensor& q,
                             const at::Tensor& k, const at::Tensor& v, const at::Tensor& heads_out,
                             std::vector<Status>& errors, bool contain_exceptions) const {
  const auto count = static_cast<int64_t>(steps.size());
  const int64_t q_width = config_.n_heads * config_.head_dim;
  // The packed rows' views made once per layer, token-major (q_flat) and head-major ([heads, total, head_dim]):
  // per sequence only a narrow_view of them, views being a tenth of a step's time outside the arithmetic on
  // small models.
  const at::Tensor q_flat = q.reshape({q.size(0), q_width});
  const at::Tensor q_by_head = q.transpose(0, 1);
  const at::Tensor k_by_head = k.transpose(0, 1);
  const at::Tensor v_by_head = v.reshape({v.size(0), config_.n_kv_heads, config_.head_dim}).transpose(0, 1);
  std::vector<char> in_kernel(steps.size(), 0);
  const int64_t window = config_.window_of(layer);
  const auto cache_of = [&](std::size_t s) -> LayerKVCache& { return (*steps[s].caches)[static_cast<std::size_t>(layer)]; };
  // Sequences apart on the thread budget (the coarsest grain: each has its own cache and policy) where each has
  // real work, else on this thread: a fork and join costs more than appending a chunk.
  // Item i is sequence sequences[i] (all of them, in order, when null). With contain_exceptions, what a
  // sequence's part throws is its error alone.
  const auto for_each_sequence = [&](bool apart, int64_t n, const std::vector<std::size_t>* sequences,
                                     const std::function<void(int64_t)>& part) {
    const std::function<void(int64_t)> fn = !contain_exceptions ? part : [&](int64_t i) {
      try {
        part(i);
      } catch (const std::exception& e) {
        const auto item = static_cast<std::size_t>(i);
        errors[sequences != nullptr ? (*sequences)[item] : item] = failure_status(e);
      }
    };
    if (apart) {
      parallel_items(n, fn);
    } else {
      for (int64_t i = 0; i < n; ++i) fn(i);
    }
  };
  // Each sequence's keys and values cached, and its attention unless the kernel takes it (on the CPU in half
  // precision libtorch's operations attend each sequence: apart).
  for_each_sequence(q.device().is_cpu() && !row_invariant(q), count, nullptr, [&](int64_t item) {
    const auto s = static_cast<std::size_t>(item);
    if (!errors[s].ok()) return;
    LayerKVCache& cache = cache_of(s);
    MemoryPolicy& policy = *steps[s].policy;
    const int64_t first = packing.offset[s], t = packing.length[s];
    if (Status appended = cache.Append(narrow_view(k_by_head, 1, first, t), narrow_view(v_by_head, 1, first, t),
                                       packing.tables[s]->positions);
        !appended.ok()) {
      errors[s] = std::move(appended);
      return;
    }
    if (KernelAttends(q, t, cache, policy)) {
      in_kernel[s] = 1;
      return;
    }
    // Attention a block of rows at a time: on the kernel when its probabilities are too many at once, else
    // with libtorch's operations.
    if (Status attended = Attend(layer, narrow_view(q_flat, 0, first, t), narrow_view(q_by_head, 1, first, t), cache,
                                 policy, narrow_view(heads_out, 0, first, t));
        !attended.ok()) {
      errors[s] = std::move(attended);
    }
  });
  std::vector<AttentionRequest> kernel_inputs;
  std::vector<std::size_t> kernel_sequences;
  for (std::size_t s = 0; s < steps.size(); ++s) {
    if (!in_kernel[s]) continue;
    const LayerKVCache& cache = cache_of(s);
    const MemoryPolicy& policy = *steps[s].policy;
    const int64_t first = packing.offset[s], t = packing.length[s];
    AttentionRequest in;
    in.q = narrow_view(q_flat, 0, first, t);
    if (cache.in_blocks()) {
      in.blocks = cache.block_view();
    } else {
      in.keys = cache.keys();
      in.values = cache.values();
    }
    in.key_positions = cache.positions();
    in.vacant = cache.vacant();
    in.first_position = cache.tokens_seen() - t;
    in.window = window > 0 && cache.tokens_seen() > window ? window : 0;
    in.out = narrow_view(heads_out, 0, first, t);
    in.probabilities = policy.needs_attention();
    in.log_sum_exp = policy.query_history() > 0;
    kernel_inputs.push_back(std::move(in));
    kernel_sequences.push_back(s);
  }
  std::vector<AttentionResult> attended;
  try {
    if (!kernel_inputs.empty()) {
      attended = invariant_attention(kernel_inputs, config_.n_heads, 1.0 / std::sqrt(static_cast<double>(config_.head_dim)));
    }
  } catch (const std::exception& e) {
    if (!contain_exceptions) throw;
    for (std::size_t s : kernel_sequences) errors[s] = failure_status(e);  // the call's outputs are theirs alone
    kernel_sequences.clear();
  }
  // What the policies see: the chunk's attention probabilities, and the newest queries with their log-sum-exp
  // (a NAMM's observation folds its spectrogram: apart).
  bool observing = false;
  for (std::size_t s : kernel_sequences) observing = observing || steps[s].policy->needs_attention();
  for_each_sequence(observing, static_cast<int64_t>(kernel_sequences.size()), &kernel_sequences, [&](int64_t i) {
    const std::size_t s = kernel_sequences[static_cast<std::size_t>(i)];
    const AttentionResult& result = attended[static_cast<std::size_t>(i)];
    LayerKVCache& cache = cache_of(s);
    MemoryPolicy& policy = *steps[s].policy;
    const int64_t t = packing.length[s], first_query = cache.tokens_seen() - t;
    Status observed = Status::Ok();
    if (policy.needs_attention()) observed = policy.Observe(layer, result.probabilities, first_query, cache);
    const int64_t history = std::min(policy.query_history(), t);
    if (observed.ok() && history > 0) {
      const at::Tensor newest = narrow_view(q_by_head, 1, packing.offset[s] + t - history, history);
      observed = cache.query_history().Record(newest,
                                              narrow_view(result.log_sum_exp, 1, t - history, history),
                                              first_query + t - history, window, policy.query_history());
    }
    if (!observed.ok()) errors[s] = std::move(observed);
  });
}

Status failure_status(const std::exception& e) {
  const auto* torch = dynamic_cast<const c10::Error*>(&e);
  std::string message = torch != nullptr ? torch->what_without_backtrace() : e.what();
  message.resize(std::min(message.size(), message.find('\n')));
  const bool memory = dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
                      dynamic_cast<const std::bad_alloc*>(&e) != nullptr ||
                      message.find("out of memory") != std::string::npos;
  return Status::Internal(memory && message.find("out of memory") == std::string::npos ? "out of memory: " + message
                                                                                       : message);
}

std::vector<Result<at::Tensor>> LlamaModel::ForwardBatch(const std::vector<Step>& steps, bool contain_exceptions) const {
  const std::vector<std::vector<std::size_t>> groups = GroupsApart(steps);
  if (groups.size() <= 1) return ForwardPacked(steps, contain_exceptions);
  std::vector<Result<at::Tensor>> results(steps.size(), Result<at::Tensor>(Status::Internal("not run")));
  parallel_items(static_cast<int64_t>(groups.size()), [&](int64_t g) {
    const std::vector<std::size_t>& group = groups[static_cast<std::size_t>(g)];
    std::vector<Step> part;
    part.reserve(group.size());
    for (std::size_t s : group) part.push_back(steps[s]);
    std::vector<Result<at::Tensor>> out = ForwardPacked(part, contain_exceptions);
    for (std::size_t i = 0; i < group.size(); ++i) results[group[i]] = std::move(out[i]);
  });
  return results;
}

std::vector<std::vector<std::size_t>> LlamaModel::GroupsApart(const std::vector<Step>& steps) const {
  const int threads = cpu_threads();
  const LlamaConfig& c = config_;
  const int64_t q_width = c.n_heads * c.head_dim, kv_width = c.n_kv_heads * c.head_dim;
  const int64_t layer_weights = c.dim * (2 * q_width + 2 * kv_width) + 3 * c.dim * c.hidden_dim;
  const int64_t layer_bytes = layer_weights * static_cast<int64_t>(c10::elementSize(options_.dtype().toScalarType()));
  // At least a sequence per thread: a group's products run on its thread alone, where with fewer groups than
  // threads the pool would have split the larger ones (a prefill chunk's) over all of them.
  if (threads <= 1 || steps.size() < static_cast<std::size_t>(threads) || !options_.device().is_cpu() ||
      options_.dtype() != at::kFloat || layer_bytes > kApartLayerBytes) {
    return {};
  }
  // A step's work, roughly: its rows' products and their attention over the cache (multiply-adds).
  std::vector<int64_t> work;
  work.reserve(steps.size());
  for (const Step& step : steps) {
    const int64_t t = step.tokens.dim() == 1 ? step.tokens.size(0) : 1;
    const int64_t cached = step.caches != nullptr && !step.caches->empty() ? step.caches->front().size() : 0;
    work.push_back(t * (layer_weights + 2 * q_width * (cached + t)));
  }
  return balanced_groups(work, static_cast<std::size_t>(threads));
}

std::vector<Result<at::Tensor>> LlamaModel::ForwardPacked(const std::vector<Step>& steps, bool contain_exceptions) const {
  // Sequence s is rows [offset[s], offset[s] + length[s]) of the packed hidden states; a failed one keeps its
  // rows (nothing reads them) and its error.
  const auto count = steps.size();
  std::vector<Status> errors(count);
  Packing packing{std::vector<int64_t>(count), std::vector<int64_t>(count),
                  std::vector<std::shared_ptr<const RopeEntry>>(count), RopeTables{}};
  std::vector<int64_t>& offset = packing.offset;
  std::vector<int64_t>& length = packing.length;
  std::vector<at::Tensor> ids;
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
    // A table depends only on the rows' first position and count: sequences in lockstep, and every batch that
    // reaches the same positions, share one.
    packing.tables[s] = RopeFor(start, t);
  }
  const auto alive = [&](std::size_t s) { return errors[s].ok(); };

  const int64_t q_width = config_.n_heads * config_.head_dim;
  if (ids.empty()) return std::vector<Result<at::Tensor>>(errors.begin(), errors.end());
  if (!options_.device().is_cpu() || options_.dtype() != at::kFloat) {
    packing.per_row = packing.PerRow(options_.dtype().toScalarType());
  }
  at::Tensor x = weights_.token_embedding.index_select(0, ids.size() == 1 ? ids.front() : at::cat(ids, 0));  // [total, dim]
  // On the host in float32 the layers' products go into one workspace's buffers; elsewhere into new tensors.
  std::unique_ptr<Workspace> workspace;
  if (options_.device().is_cpu() && options_.dtype() == at::kFloat) {
    workspace = workspaces_->Take();
    workspace->Fit(total, config_, x.options());
  }
  Workspace* ws = workspace.get();
  const auto buffer = [&](at::Tensor Workspace::*member) { return ws != nullptr ? ws->*member : at::Tensor(); };
  for (int layer = 0; layer < static_cast<int>(config_.n_layers); ++layer) {
    const LlamaLayerWeights& w = weights_.layers[static_cast<std::size_t>(layer)];
    const Projections& p = projections_[static_cast<std::size_t>(layer)];
    const at::Tensor normed = invariant_rms_norm(x, w.attention_norm, config_.norm_eps, buffer(&Workspace::normed));
    const auto [q, k] = RotateQueriesAndKeys(layer, p.q(normed, buffer(&Workspace::q)),
                                             p.k(normed, buffer(&Workspace::k)), packing);
    const at::Tensor v = p.v(normed, buffer(&Workspace::v));
    // Every live sequence's rows are written by its attention; a failed one's are never read.
    const at::Tensor heads_out = ws != nullptr ? ws->heads_out : at::empty({total, q_width}, x.options());
    AttendBatch(layer, steps, packing, q, k, v, heads_out, errors, contain_exceptions);
    x.add_(p.o(heads_out, buffer(&Workspace::projected)));  // x is this pass's own (the embedding rows' copy)
    x.add_(FeedForward(p, invariant_rms_norm(x, w.ffn_norm, config_.norm_eps, buffer(&Workspace::normed)), ws));
  }
  if (workspace) workspaces_->Give(std::move(workspace));
  // The rows whose logits are wanted, through the final norm and the head together.
  std::vector<at::Tensor> wanted;
  for (std::size_t s = 0; s < count; ++s) {
    if (!alive(s)) continue;
    wanted.push_back(steps[s].all_logits ? narrow_view(x, 0, offset[s], length[s])
                                         : narrow_view(x, 0, offset[s] + length[s] - 1, 1));
  }
  std::vector<Result<at::Tensor>> results(errors.begin(), errors.end());
  if (wanted.empty()) return results;
  const at::Tensor logits =
      head_(invariant_rms_norm(at::cat(wanted, 0), weights_.final_norm, config_.norm_eps))
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
