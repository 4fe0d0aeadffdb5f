// The NAMM memory policy (spec §2): at every memory update, for each layer and KV head,
//   spectrogram EMA (streamed by Observe) -> z-score normalization -> [recency embedding, features]
//   -> scorer -> selection,
// with one parameter vector shared by all layers and heads.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "namm/cache_budget.h"
#include "namm/feature_norm.h"
#include "namm/policies/memory_policy.h"
#include "namm/namm_model.h"
#include "namm/scorer.h"

namespace namm {

class NammPolicy final : public MemoryPolicy {
 public:
  // Binds the model's parameters on `device` (where the caches and attention will live). The normalizer starts
  // from the model's statistics and, if they are still collecting, keeps folding in every update it sees.
  static Result<std::unique_ptr<NammPolicy>> Create(const NammModel& model, at::Device device = at::kCPU);

  // When the scorer is constant (constant_score: e.g. all-zero parameters), the features cannot change any
  // decision: Select skips them and the scorer, and Observe does nothing unless statistics are still being
  // collected. The kept tokens are exactly those of the full pipeline. Tracing disables the shortcut.
  std::string name() const override;
  // "namm.samples" [32] and "namm.ema" [17] float32 per token (see SpectrogramState), only "namm.ema" when
  // observing with the query history; none when the features are not needed (constant scorer, frozen
  // statistics, no tracing).
  std::vector<TokenStateSpec> token_state() const override;
  bool needs_attention() const override { return true; }
  // Forgets what an earlier sequence's passes left (the carried rows).
  Status BeginSequence(const SequenceInfo& info) override;
  // The carried rows' bytes.
  int64_t state_bytes() const override;
  // 31 with the query history on (a frame's queries before the one Observe() is given), else 0.
  int64_t query_history() const override;
  Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache) override;
  // Fails unless the sequence length is a multiple of the STFT hop (16), where every frame is complete.
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;
  // With keep_prompt: the NAMM's selection at the prompt's end (any length: the frames completed so far);
  // otherwise nothing.
  Result<std::optional<at::Tensor>> EndPrefill(int layer, LayerKVCache& cache) override;
  // Every update's NAMM (each its own parameters) in one pass on the CPU: features, scorer and selection of
  // every (sequence, KV head) as tasks of our kernels, without tensor operations; each result the same bits as
  // Select() alone (Select() is this with one update).
  std::vector<Result<at::Tensor>> SelectTogether(const std::vector<MemoryUpdate>& updates) override;
  // Until the first update a NAMM's parameters play no part: NAMMs observing the same way (precision, query
  // history, whether features are needed at all) share a prefix, whatever their parameters.
  std::string prefix_key() const override;
  void AdoptPrefix(const MemoryPolicy& leader) override;

  // What the last Select() computed, kept only while tracing is on.
  struct Trace {
    at::Tensor features;  // [kv_heads, n, 25]: 8 recency dims, then 17 normalized spectrogram bins
    at::Tensor scores;    // [kv_heads, n]: raw scorer output, before the newest token is forced to be kept
                          // (heads=own: -inf at a head's vacant slots)
    at::Tensor keep;      // [kv_heads, k] int64, ascending (heads=own: -1 first for each slot a head leaves)
  };
  // Enable before creating the caches (the constant-score shortcut may otherwise have dropped the features).
  void set_tracing(bool on) { tracing_ = on; }

  // Keep no attention samples per token (32 floats per token and KV head) but only the EMA: at each hop end the
  // frame is taken from the attention rows Observe() is given, those of the same call's earlier blocks, and,
  // for queries of earlier calls, the attention computed again from the cache's QueryHistory (which the engine
  // must record: query_history() > 0). The features are the same up to float rounding (exp(s - lse) instead of
  // the softmax). For engines; a caller that only has attention matrices (namm-tool score) leaves it off.
  // Set before creating the caches.
  void set_observe_from_query_history(bool on) { from_history_ = on; }
  const Trace& last_trace() const { return trace_; }

  // A deployment's knob (namm:FILE,budget=N|ratio=R|threshold=T): each KV head keeps its N best-scored tokens
  // (top-k over the NAMM's scores), or ceil(R x the prompt's tokens) of them, or the tokens scoring at least T
  // instead of 0. A NAMM that learned its threshold (dynamic selection) takes budget= or ratio= as a cap.
  // Deliberately beyond the reference, whose NAMM keeps what scores >= 0 and has no knob (docs/namm-core.md).
  struct SelectionKnob {
    std::optional<int64_t> budget;
    std::optional<double> ratio;
    std::optional<double> threshold;
  };
  Status set_selection_knob(const SelectionKnob& knob);
  // The knob's budget= or ratio= (a task variant's budget: namm/tasks/task_variant.h).
  void set_selection_budget(const CacheBudget& budget);
  const SelectionConfig& selection() const { return architecture_.selection; }

  // namm:FILE,prompt=keep: the whole prompt stays cached while it is read (memory updates that fall inside it
  // keep every token) and the NAMM's first eviction is at the prompt's end (EndPrefill), as SnapKV compresses;
  // later updates as usual. Every kept token's keys and values were then computed with the whole prompt in the
  // cache, at the cost of holding it during prefill. Deliberately beyond the reference, which evicts at every
  // update (docs/namm-core.md). Set before BeginSequence.
  void set_keep_prompt(bool keep) { keep_prompt_ = keep; }
  bool keep_prompt() const { return keep_prompt_; }

  // namm:FILE,heads=own: each KV head keeps its own count of tokens — those its scores keep
  // (select_own_counts_on_host) — where the reference pads every head of a layer to the layer's largest count with
  // its best tokens below the threshold. The caches become ragged (kv_cache.h): a head's dropped slots hold no
  // storage in blocks and get no attention, so the model reads fewer tokens than with the reference's padding
  // and the scores may differ from the reference's. Each head's features, scorer and budget input then see only
  // its own tokens (statistics being collected count only the slots a head holds). Deliberately beyond the
  // reference (docs/namm-core.md). The caches must be on the CPU (Select refuses a device's: a ragged gather runs
  // on the host). Set before BeginSequence.
  void set_own_head_counts(bool own);
  bool own_head_counts() const { return own_head_counts_; }
  // The statistics in use, including any gathered by this policy while collecting.
  const FeatureNormalizer& normalizer() const { return normalizer_; }

 private:
  NammPolicy(const NammModel& model, std::unique_ptr<Scorer> scorer, at::Tensor selection_params);

  // The features are needed unless the scorer is constant and no statistics are being gathered.
  bool FeaturesNeeded() const;
  // What the budget input adds to each token's features for a head of n tokens (budget_input.h); empty: nothing.
  // With own head counts, n is the head's own.
  std::vector<float> BudgetShift(int64_t n) const;
  // Select()'s preconditions.
  Status CheckSelect(const LayerKVCache& cache) const;
  // With keep_prompt, a memory update that falls inside the prompt: it keeps every token.
  bool ReadingPrompt(const LayerKVCache& cache) const {
    return keep_prompt_ && !at_prompt_end_ && cache.tokens_seen() <= prompt_tokens_;
  }
  // Select() by tensor operations: any device, tracing, the constant-score shortcut.
  Result<at::Tensor> SelectWithTensors(int layer, LayerKVCache& cache);
  // This policy's updates on a device (its sequence's layers), by tensor operations over all of them at once
  // where it can (SelectOnDevice in the source), else each by SelectWithTensors.
  std::vector<Result<at::Tensor>> SelectOnDevice(const std::vector<MemoryUpdate>& updates);
  // The selection of host scores [kv_heads][n] (the newest raised in place): the architecture's rule, or with own
  // head counts each head's own over the slots it holds.
  int64_t SelectOnHost(float* scores, const LayerKVCache& cache, std::vector<int64_t>& keep,
                       std::vector<int64_t>& order) const;
  // The carried rows of `layer` (CarriedRows) for queries [from, to) into out [kv_heads, to - from, n], if they
  // cover them and the cache has only grown since; false (nothing written) otherwise.
  bool CopyCarriedRows(int layer, const LayerKVCache& cache, int64_t from, int64_t to, const at::Tensor& out) const;
  // An update of `layer` keeping keep [kv_heads][k] (host memory) applied to its carried rows; null: dropped.
  // Called by Select() whichever path it takes, with the cache as it is before the update.
  void GatherCarriedRows(int layer, const LayerKVCache& cache, const int64_t* keep, int64_t k);
  // Observe() with the query history: folds the frames that end within the given rows.
  void ObserveFromHistory(const at::Tensor& attention, int layer, int64_t first_query, LayerKVCache& cache);
  // GQA-reduced attention of queries [from, to) before this Observe() call's, query-major, written into out
  // [kv_heads, to - from, n]: remembered from the same layer's earlier blocks of the same forward pass, else
  // computed from the query history.
  void EarlierRowsInto(int layer, const LayerKVCache& cache, int64_t from, int64_t to, const at::Tensor& out) const;

  NammArchitecture architecture_;
  std::optional<CacheBudget> knob_budget_;  // set_selection_knob's budget or ratio, resolved at each BeginSequence()
  std::unique_ptr<Scorer> scorer_;
  std::optional<float> constant_score_;
  bool observe_skipped_ = false;
  at::Tensor selection_params_;
  std::vector<float> budget_embedding_;  // [kFeatureDim] with budget_input (budget_input.h), else empty
  FeatureNormalizer normalizer_;
  bool tracing_ = false;
  Trace trace_;
  bool from_history_ = false;
  bool keep_prompt_ = false;
  bool own_head_counts_ = false;
  int64_t prompt_tokens_ = 0;   // BeginSequence's prompt
  bool at_prompt_end_ = false;  // within EndPrefill's selection
  // The reduced rows of the current forward pass's latest blocks of one layer (at most the 31 newest), valid
  // while the cache neither grows nor changes: (first query, query-major rows [kv_heads, r, n]).
  struct RememberedRows {
    int layer = -1;
    int64_t tokens_seen = -1, size = -1;
    std::vector<std::pair<int64_t, at::Tensor>> blocks;
    bool ValidFor(int l, const LayerKVCache& cache) const {
      return layer == l && tokens_seen == cache.tokens_seen() && size == cache.size();
    }
  };
  RememberedRows remembered_;
  // Per layer, the reduced rows of the last forward pass's newest queries (16 to 31), so that the next pass's
  // first frame takes its earlier queries from them instead of computing their attention again from the query
  // history: [kv_heads, r, size] over the cache as it was (size tokens), from query `first`. The next pass's new
  // tokens are after those queries (zero), and an update by Select() gathers their columns as the cache's. Kept
  // only on the host and while small (kCarriedRowsMaxBytes per layer: the small models of training; a large model's long cache
  // keeps the query history's bounded state and computes them again).
  static constexpr int64_t kCarriedRowsMaxBytes = int64_t{1} << 20;
  struct CarriedRows {
    int64_t first = 0, tokens_seen = -1, size = -1;
    at::Tensor rows;
  };
  std::vector<CarriedRows> carried_;
  at::Tensor spare_rows_;  // storage of the rows just replaced, for the next to reuse
  // Storage of an observation's samples ([kv_heads, queries, size]) on the host while they fit
  // kCarriedRowsMaxBytes, reused from call to call instead of allocated per layer and step.
  at::Tensor samples_storage_;
};

}  // namespace namm
