// NAMM-augmented generation (spec §1.4, §1.6, §5.3): chunked prefill, memory updates at every multiple of
// n_up tokens (prefill and decoding alike), the policy's end-of-prefill hook, then greedy decoding (or seeded
// sampling) or teacher-forced tokens, and the per-generation report.
//
// The prompt is cut at absolute multiples of the chunk size (which must divide n_up), so memory updates fall
// exactly at sequence lengths 512, 1024, ... Each update runs after the chunk's logits have been computed, as
// in the reference; prompts shorter than n_up are never evicted by update, and a prompt's tail after its last
// multiple of n_up is scored at the next boundary, which may come during decoding. Teacher-forced tokens are
// chunked the same way, continuing from the prompt.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "namm/policies/memory_policy.h"
#include "namm/status.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

struct GenerationOptions {
  int64_t max_new_tokens = 128;
  std::vector<std::string> stop_strings;  // the text is cut before the first occurrence, and generation stops
  // The answer's text as the prompt's continuation (decode_continuation over the prompt's last tokens: a
  // completion keeps the leading space its first token carries); false: decoded alone, as the reference does.
  bool text_continues_prompt = false;
  int64_t chunk_size = 128;               // prefill chunk length; must divide memory_update_interval
  int64_t memory_update_interval = 512;   // n_up
  // Longest sequence (prompt + new tokens) allowed; 0: the model's context length. Larger values run the model
  // beyond the positions it was trained on (RoPE extrapolates), which evicting policies may make tolerable.
  int64_t max_context = 0;
  std::vector<int64_t> eos_ids;           // generation stops at any of them (not included in the output)
  bool record_logits = false;             // keep the float32 logits of every position (tests, likelihoods)
  // Sampling instead of greedy decoding when > 0: token t with probability softmax(logits / temperature)[t],
  // drawn with a counter-based generator, so the sample is a pure function of (seed, step).
  double temperature = 0.0;
  uint64_t seed = 0;
  std::vector<int64_t> banned_ids;        // never generated (e.g. EOS, to sample text of a fixed length)
  // Teacher forcing: `forced_tokens` are fed after the prompt instead of generated ones (max_new_tokens must be
  // 0), and forced_logits are recorded. They are not part of the prefill: the policy's end-of-prefill hook runs
  // before them, as before decoding. With no forced tokens, forced_logits is the prompt's last position.
  bool teacher_forcing = false;
  std::vector<int64_t> forced_tokens;
  // Record when each token left each layer's cache, per KV head (GenerationResult::retention): what
  // `generate --explain` draws.
  bool record_retention = false;
};

// The prompt tokens an answer's text is decoded after (GenerationOptions::text_continues_prompt): the prompt's
// last few, or none.
std::vector<int64_t> answer_context(const std::vector<int64_t>& prompt_ids, const GenerationOptions& options);

// When every token of a sequence left the cache: evicted_at[(layer * kv_heads + head) * positions + p] is the
// sequence length at the memory update (or end-of-prefill compression) that dropped position p from that head
// of that layer, -1 for a token still cached at the end.
struct Retention {
  int64_t layers = 0, kv_heads = 0, positions = 0;
  int64_t cached = 0;  // positions [0, cached) went through the cache (the last generated token never does)
  std::vector<int32_t> evicted_at;
};

// Cache sizes after one memory update.
struct MemoryUpdateRecord {
  int64_t sequence_length = 0;      // tokens processed when the update ran (a multiple of n_up, or the prompt)
  std::vector<int64_t> cache_sizes;  // per layer: tokens kept per KV head (heads=own: their mean, rounded)
  bool end_of_prefill = false;       // the policy's end-of-prefill compression rather than a memory update
};

struct GenerationResult {
  std::string text;                  // decoded answer, special tokens skipped, cut at a stop string
  std::vector<int64_t> token_ids;    // generated ids (without the EOS that ended generation)
  int64_t prompt_tokens = 0;
  std::string stop_reason;           // "eos", "max_new_tokens" or "stop_string"
  std::vector<MemoryUpdateRecord> updates;
  std::vector<int64_t> final_cache_sizes;  // per layer, at the end of generation
  double prefill_seconds = 0, decode_seconds = 0;
  int64_t decode_steps = 0;          // forward passes of single generated tokens
  // Prompt tokens this sequence did not compute: a batch's sequence with the same prompt ran them, and this one
  // copied its caches (GenerationBatch's prefix sharing; exact, so only the time differs).
  int64_t shared_prefix_tokens = 0;
  int64_t peak_kv_bytes = 0;         // keys + values of all layers at their largest
  int64_t peak_policy_state_bytes = 0;  // the policy's per-token state and query history at the same point
  // Cache sizes in tokens per KV head, averaged over layers: the mean over every query processed (prompt,
  // decoded and forced tokens) of the number of cached tokens it attended to, the same mean over the answer's
  // queries only (decoded or forced tokens; 0 without any), and the largest size held. A full cache over L
  // tokens has a mean of (L + 1) / 2 and a peak of L.
  double mean_kv_tokens = 0;
  double answer_kv_tokens = 0;
  double peak_kv_tokens = 0;
  at::Tensor prompt_logits;          // [prompt_tokens, vocab] when record_logits
  at::Tensor generated_logits;       // [n, vocab] when record_logits: logits that chose each generated token
  // With teacher_forcing: [n_forced + 1, vocab] float32, the logits after the prompt's last token and after each
  // forced token (row i predicts forced token i).
  at::Tensor forced_logits;
  Retention retention;               // with record_retention

  double prefill_tokens_per_second() const;
  double decode_tokens_per_second() const;
};

class Generator {
 public:
  Generator(const LlamaModel& model, const Tokenizer& tokenizer) : model_(model), tokenizer_(tokenizer) {}

  // Generates greedily after `prompt_ids` (already templated, e.g. starting with BOS). `policy` serves this
  // one sequence. Fails if the prompt plus max_new_tokens exceed options.max_context (default: the model's
  // context length).
  Result<GenerationResult> Generate(const std::vector<int64_t>& prompt_ids, MemoryPolicy& policy,
                                    const GenerationOptions& options) const;

  // One sequence of a batch: Generate's arguments (each sequence has its own policy object and options).
  struct Request {
    std::vector<int64_t> prompt_ids;
    MemoryPolicy* policy = nullptr;
    GenerationOptions options;
  };
  // Generates several sequences in lockstep, one batched forward pass (LlamaModel::ForwardBatch) per step:
  // each sequence runs its own chunks (cut at its own multiples of its chunk size), memory updates and decoding
  // exactly as Generate would run it alone, and leaves the batch when it stops; a long prompt's prefill holds
  // the others for one chunk per step. Results (or errors) in request order; on the CPU in float32 each is the
  // same bits as Generate gives that sequence alone, whatever it ran beside. Timings are the batch's: the
  // seconds of the passes the sequence took part in.
  std::vector<Result<GenerationResult>> GenerateBatch(const std::vector<Request>& requests) const;

 private:
  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
};

// The loop of GenerateBatch opened for continuous batching (namm-api): sequences join and leave between steps,
// and each Step() is one batched forward pass in which every unfinished sequence advances one chunk of its
// prompt (or forced tokens) or one generated token. A sequence's result is the same as GenerateBatch's, whenever
// it joined and whatever ran beside it. Sequences that begin together with the same prompt and policies that
// observe alike (MemoryPolicy::prefix_key: NAMMs, whatever their parameters) compute the prompt up to the first
// memory update once: one of them runs it, the others copy its caches (exact, so nothing changes but the time).
// Not thread-safe: one thread joins, steps and leaves.
class GenerationBatch {
 public:
  GenerationBatch(const LlamaModel& model, const Tokenizer& tokenizer);
  ~GenerationBatch();
  GenerationBatch(const GenerationBatch&) = delete;
  GenerationBatch& operator=(const GenerationBatch&) = delete;

  // Adds a sequence (its policy must outlive it) that takes part from the next Step(), and returns its id. A
  // request that cannot begin (an empty prompt, a prompt over the context, ...) is finished at once with its
  // error.
  int64_t Join(Generator::Request request);
  // One batched forward pass over the unfinished sequences, then their memory updates and next tokens. False
  // when there was none. With `step_tokens` > 0 a pass takes every decoding sequence (a token each), then chunks
  // of the others in the order they joined while the pass holds at most `step_tokens` tokens (at least one
  // chunk): a long prompt's prefill no longer advances every prompt together, so first tokens come in arrival
  // order. Each sequence's result is the same whatever the budget.
  bool Step(int64_t step_tokens = 0);
  // Whether `id` has finished (its result or error is ready). Ids must be joined and not yet left.
  bool finished(int64_t id) const;
  // The tokens generated so far.
  const std::vector<int64_t>& tokens(int64_t id) const;
  // Keys and values held now, all layers (0 once finished).
  int64_t kv_bytes(int64_t id) const;
  // Their storage allocated now (LayerKVCache::reserved_kv_bytes), and what the next Step() may add to it (an
  // upper bound: a step within a token budget may leave the sequence out).
  int64_t reserved_bytes(int64_t id) const;
  int64_t growth_bytes(int64_t id) const;
  // Holds a sequence back (true: it takes no part in Step() and keeps its caches as they are) or lets it go
  // on (false). A scheduler out of memory holds the rows whose next step would grow their caches: an evicting
  // policy's neighbours give blocks back at their memory updates, where preempting a row would recompute its
  // prompt. Its result is the same, only later. A held sequence neither leads nor follows a shared prefix.
  void Hold(int64_t id, bool held);
  // Removes a sequence and frees its caches. Its result or error when it had finished; FailedPrecondition
  // ("left before it finished") otherwise.
  Result<GenerationResult> Leave(int64_t id);
  // Sequences joined and not left, finished or not.
  std::size_t size() const;

  // Whether an exception in one sequence's part of a step (its cache growing out of memory, its policy) fails
  // that sequence alone with failure_status's error while the others go on (a server's requests), rather than
  // propagating out of Step() (the default: NammExecutor retries a batch that ran out of memory with less). An
  // exception in the batch's shared products then fails every sequence of the step, each with that error.
  void set_contain_failures(bool on) { contain_failures_ = on; }

 private:
  struct Entry;
  // Sequences that have not begun and share a prefix (Sequence::PrefixKey and the prompt) wait for one leader's:
  // the prefix is computed once per batch, and each follower's result stays the same bits as alone.
  void SharePrefixes();
  void Unpark(Entry& leader);
  // Unpark, and out of its leader's followers.
  void Detach(Entry& entry);

  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
  std::map<int64_t, std::unique_ptr<Entry>> entries_;  // by id: the order of the batch's rows
  int64_t next_id_ = 0;
  bool contain_failures_ = false;
};

}  // namespace namm::worker
