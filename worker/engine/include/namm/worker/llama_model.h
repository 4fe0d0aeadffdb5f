// The Llama forward pass over a chunk of tokens, with a per-layer KV cache that a memory policy prunes.
//
// For each layer (pre-norm residual blocks):
//   h = x + W_o · attention(RoPE(W_q · rms(x)), cache ∪ RoPE(W_k · rms(x)), cache ∪ W_v · rms(x))
//     (Qwen3: RoPE(rms_head(W_q · rms(x))), each head normalized; Qwen2: W_q/W_k/W_v carry biases)
//   x = h + W_down · (silu(W_gate · rms(h)) ⊙ W_up · rms(h))
// logits = W_lm · rms(x). Query head i reads KV head i / (heads / kv_heads). A chunk's queries see every cached
// token plus the chunk's tokens up to themselves (causal), except those a sliding window (Mistral, Qwen with
// use_sliding_window) puts out of reach; evicted tokens are simply gone from the cache, and every cached key
// keeps the rotation of its absolute position.
#pragma once

#include <algorithm>
#include <memory>

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "namm/batch_invariant.h"
#include "namm/kv_cache.h"
#include "namm/policies/memory_policy.h"
#include "namm/status.h"
#include "namm/worker/llama_weights.h"

namespace namm::worker {

struct RopeTables;

// Puts `model`'s KV caches in blocks of block_tokens tokens from one pool holding at most max_kv_bytes (0: no
// limit) of keys and values (LayerKVCache, kv_block_pool.h); block_tokens 0 leaves them rectangular. Before the
// model serves (namm-api, namm-worker serve).
class LlamaModel;
Status use_kv_blocks(LlamaModel& model, int64_t block_tokens, int64_t max_kv_bytes);

// An exception as a sequence's error (Internal): its message's first line (a torch error's stack frames and source
// paths stay out of what clients see), said to be out of memory when it was.
Status failure_status(const std::exception& e);

class LlamaModel {
 public:
  static Result<LlamaModel> Load(const std::string& path, const LoadOptions& options);
  LlamaModel(LoadedModel loaded, at::TensorOptions options);

  const LlamaConfig& config() const { return config_; }
  const LlamaWeights& weights() const { return weights_; }
  const at::TensorOptions& options() const { return options_; }

  // Attention runs a chunk's queries in blocks of rows so that heads x rows x cache size (the scores and the
  // probabilities alive at once) stays under this many elements, kAttentionBlockElements by default; the result
  // does not depend on it. 1 runs one query at a time.
  void set_attention_block_elements(int64_t elements) { attention_block_elements_ = std::max<int64_t>(1, elements); }

  // One empty cache per layer, carrying `policy`'s per-token state; its keys and values in blocks of the pool
  // set here, if one is (null: rectangular caches). The pool's head_dim, dtype and device must be the model's.
  std::vector<LayerKVCache> NewCaches(const MemoryPolicy& policy) const;
  Status set_kv_block_pool(std::shared_ptr<KvBlockPool> pool);
  const std::shared_ptr<KvBlockPool>& kv_block_pool() const { return kv_block_pool_; }

  // Runs `tokens` [t] (int64) as the next t tokens of the sequence whose state is `caches`: their keys and
  // values are appended, and if the policy needs_attention() each layer's attention probabilities
  // [heads, t, cache size] are handed to policy.Observe (then dropped). Positions continue from
  // caches[0].tokens_seen(). Returns float32 logits [t, vocab] if all_logits, else [1, vocab] for the last token.
  // Memory updates (eviction) are the caller's business (see Generator).
  Result<at::Tensor> Forward(const at::Tensor& tokens, std::vector<LayerKVCache>& caches, MemoryPolicy& policy,
                             bool all_logits) const;

  // One sequence's part of a batched forward pass: Forward's arguments.
  struct Step {
    at::Tensor tokens;  // [t] int64, t >= 1
    std::vector<LayerKVCache>* caches;
    MemoryPolicy* policy;
    bool all_logits = false;
  };
  // Forward for several sequences in one pass: their tokens go through every dense product together (packed
  // one after another, of any lengths), each through attention over its own cache with its own policy. A
  // sequence's logits are the same bits as Forward gives it alone on the CPU in float32 (batch_invariant.h),
  // and equal up to rounding elsewhere. An error in one sequence (its policy's, say) is its result alone: the
  // others go on. With contain_exceptions, so is an exception thrown by one sequence's part (its cache growing
  // out of memory, its policy): its result is the error (failure_status); without, exceptions propagate, so that
  // a caller can retry with less (NammExecutor splits its batch on out of memory). An exception in the shared
  // products propagates either way. A small model's batch on the CPU in float32 runs in groups on the thread
  // budget (GroupsApart), with the same results; then which rows find a KV block pool dry first depends on
  // timing, and so does which of several exceptions propagates (each group finishes before it does).
  std::vector<Result<at::Tensor>> ForwardBatch(const std::vector<Step>& steps, bool contain_exceptions = false) const;

 private:
  // Qwen3's per-head norms and RoPE on a batch's packed projected queries [rows, heads * head_dim] and keys
  // [rows, kv_heads * head_dim], each sequence's rows by its own tables (in place on the CPU in float32):
  // [rows, heads, head_dim] and [rows, kv_heads, head_dim]. Element-wise, so a row's numbers do not depend on
  // the others.
  struct Packing;
  std::pair<at::Tensor, at::Tensor> RotateQueriesAndKeys(int layer, const at::Tensor& q, const at::Tensor& k,
                                                         const Packing& packing) const;
  // The positions [t] and RoPE tables of a chunk of t rows from position `start`, computed once and kept
  // (RopeCache): every step of every batch needs them again.
  struct RopeEntry;
  std::shared_ptr<const RopeEntry> RopeFor(int64_t start, int64_t t) const;
  // Whether the batched CPU kernel (invariant_attention) can attend over `cache` with the packed queries q:
  // float32 on the CPU, the keys and values readable where they lie.
  bool KernelReads(const at::Tensor& q, const LayerKVCache& cache) const;
  // Whether a sequence of t rows runs its attention in the batch's one kernel call: the kernel reads it, and the
  // probabilities its policy observes, if any, are within attention_block_elements_.
  bool KernelAttends(const at::Tensor& q, int64_t t, const LayerKVCache& cache, const MemoryPolicy& policy) const;
  // A prepared sequence's attention over its cache in blocks of rows, the policy observing each block: on the
  // kernel where it reads the cache (a sequence whose probabilities exceed attention_block_elements_; each block
  // the same bits as one call for every row), else with libtorch's operations (any device and dtype). q_rows:
  // the queries [t, heads * head_dim], q_heads: the same as [heads, t, head_dim]; the heads' outputs before W_o
  // are written into out's rows [t, heads * head_dim].
  Status Attend(int layer, const at::Tensor& q_rows, const at::Tensor& q_heads, LayerKVCache& cache,
                MemoryPolicy& policy, const at::Tensor& out) const;
  // Attention of `layer` for every sequence of a batch without an error yet, from the packed rotated queries and
  // keys [rows, heads, head_dim] and values [rows, kv_heads * head_dim]: each one's keys and values cached; then, on the CPU in float32, one kernel call for all of them (each query's numbers
  // independent of the others'), else one sequence at a time; the policies observe. Writes the heads' outputs
  // into heads_out's rows; an error stays with its sequence.
  void AttendBatch(int layer, const std::vector<Step>& steps, const Packing& packing, const at::Tensor& q,
                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& heads_out,
                   std::vector<Status>& errors, bool contain_exceptions) const;
  // ForwardBatch on one packed batch: every dense product over all of its rows at once.
  std::vector<Result<at::Tensor>> ForwardPacked(const std::vector<Step>& steps, bool contain_exceptions) const;
  // A CPU float32 batch of a small model with at least a sequence per thread, in groups of about equal work, one
  // per thread of the budget, each a packed batch of its own (ForwardBatch runs them apart); none (one packed
  // batch) otherwise. Float32 only: there a row's numbers do not depend on its batch (batch_invariant.h), so
  // grouping by the thread budget changes none. A small model's step is each row's own arithmetic in products
  // too small for the kernels' pool to split (a fork and join costs more), so one packed batch ran on one core
  // whatever the budget: groups apart gave namm-api 1.4x the tokens/s at 8 clients on 2 cores
  // (docs/performance.md). Each thread then reads every weight, which costs nothing while a layer's weights stay
  // in its cache, and much on a large model whose products the pool does split (measured on 2 cores, 8 clients:
  // layers of 2.8 MB 1.18x, 11 MB 1.0x, 60 MB 0.81x): up to kApartLayerBytes.
  std::vector<std::vector<std::size_t>> GroupsApart(const std::vector<Step>& steps) const;
  static constexpr int64_t kApartLayerBytes = int64_t{4} << 20;
  // A layer's products, prepared once (batch_invariant.h: InvariantLinear).
  struct Projections {
    InvariantLinear q, k, v, o, gate, up, down;
  };
  // Float32 host buffers a packed batch's layers write their products into, reused by every layer of a pass and
  // taken from a pool by the next pass (ForwardPacked).
  struct Workspace;
  struct WorkspacePool;
  // p.down(silu(p.gate(x)) * p.up(x)), into ws's buffers when given.
  at::Tensor FeedForward(const Projections& p, const at::Tensor& x, Workspace* ws = nullptr) const;
  Status CheckStep(const Step& step) const;

  LlamaConfig config_;
  LlamaWeights weights_;
  at::TensorOptions options_;
  std::shared_ptr<KvBlockPool> kv_block_pool_;
  at::Tensor inv_freq_;
  int64_t attention_block_elements_;  // kAttentionBlockElements on the CPU, kDeviceAttentionBlockElements elsewhere
  std::vector<Projections> projections_;  // per layer
  InvariantLinear head_;
  struct RopeCache;
  std::shared_ptr<RopeCache> rope_cache_;  // shared by copies of the model (its config and weights are too)
  std::shared_ptr<WorkspacePool> workspaces_;  // likewise
};

}  // namespace namm::worker
