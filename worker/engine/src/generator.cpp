#include "namm/worker/generator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>

#include <c10/core/InferenceMode.h>

#include "aten.h"

namespace namm::worker {

std::vector<int64_t> answer_context(const std::vector<int64_t>& prompt_ids, const GenerationOptions& options) {
  // A few tokens: enough for a decoder's treatment of the text's start (a leading space dropped, spaces cleaned
  // up before punctuation).
  constexpr std::size_t kContextTokens = 4;
  if (!options.text_continues_prompt) return {};
  const std::size_t keep = std::min(kContextTokens, prompt_ids.size());
  return std::vector<int64_t>(prompt_ids.end() - static_cast<std::ptrdiff_t>(keep), prompt_ids.end());
}

// Named rather than anonymous: GenerationBatch::Entry (declared in the header) holds a Sequence.
namespace generation_internal {

using Clock = std::chrono::steady_clock;

// SplitMix64 of (seed, step): a counter-based stream, so step k's draw needs no state.
double UniformDraw(uint64_t seed, uint64_t step) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (step + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

// The next token: argmax, or a sample from softmax(logits / temperature) computed in float64.
int64_t ChooseToken(const at::Tensor& logits, const GenerationOptions& options, uint64_t step) {
  at::Tensor scores = logits.to(at::kDouble).cpu().contiguous();
  for (int64_t banned : options.banned_ids) {
    if (banned >= 0 && banned < scores.size(0)) scores[banned] = -std::numeric_limits<double>::infinity();
  }
  if (options.temperature <= 0) return scores.argmax().item<int64_t>();
  const at::Tensor scaled = scores / options.temperature;
  // A temperature so small that the logits over it overflow (1e-310) leaves softmax nothing but NaN, and the draw
  // token 0 each time; such a distribution is its limit, the argmax.
  if (!std::isfinite(scaled.max().item<double>())) return scores.argmax().item<int64_t>();
  const at::Tensor probs = scaled.softmax(0);
  const double* p = probs.data_ptr<double>();
  const double u = UniformDraw(options.seed, step);
  double cumulative = 0;
  int64_t last_possible = 0;
  for (int64_t t = 0; t < probs.size(0); ++t) {
    if (p[t] > 0) last_possible = t;
    cumulative += p[t];
    if (u < cumulative) return t;
  }
  return last_possible;  // rounding left u just above the total
}
double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Waits for the work queued before `t` on its device (a one-element copy to the host), so that a GPU's
// asynchronous kernels are timed where they ran. Nothing to wait for on the CPU.
void WaitForDevice(const at::Tensor& t) {
  if (!t.device().is_cpu()) (void)t.reshape({-1}).narrow(0, 0, 1).to(at::kCPU);
}

// The tokens a layer's KV heads hold, on average (a ragged cache's vacant slots not counted), rounded.
int64_t TokensPerHead(const LayerKVCache& cache) {
  return (2 * cache.held_tokens() + cache.kv_heads()) / (2 * cache.kv_heads());
}

// Bookkeeping shared by prefill and decoding: memory updates at multiples of n_up, the end-of-prefill hook, and
// cache sizes.
class CacheTracker {
 public:
  // With `positions` > 0, records evictions (GenerationResult::retention) over that many positions.
  CacheTracker(std::vector<LayerKVCache>& caches, MemoryPolicy& policy, int64_t n_up, GenerationResult& result,
               int64_t positions)
      : caches_(caches), policy_(policy), n_up_(n_up), result_(result) {
    if (positions > 0) {
      Retention& r = result_.retention;
      r.layers = static_cast<int64_t>(caches_.size());
      r.kv_heads = caches_.empty() ? 0 : caches_[0].kv_heads();
      r.positions = positions;
      r.evicted_at.assign(static_cast<std::size_t>(r.layers * r.kv_heads * positions), -1);
    }
  }

  // After a forward pass of `t` tokens: records sizes and the peak; true when the length is a multiple of n_up
  // (a memory update is due: AddUpdates, apply_memory_updates, then EndUpdate).
  bool Account(int64_t t) {
    int64_t kv = 0, state = 0;
    double held = 0, attended = 0;
    for (const auto& cache : caches_) {
      kv += cache.kv_bytes();
      state += cache.state_bytes() + cache.query_history().bytes();
      // The step's queries saw n - t + 1, ..., n cached tokens (n: the tokens a head holds, on average over heads).
      const double n = static_cast<double>(cache.held_tokens()) / static_cast<double>(cache.kv_heads());
      const auto steps = static_cast<double>(t);
      held += n;
      attended += steps * n - steps * (steps - 1) / 2;
    }
    state += policy_.state_bytes();
    const auto layers = static_cast<double>(caches_.size());
    attended_sum_ += attended / layers;
    queries_ += t;
    result_.mean_kv_tokens = attended_sum_ / static_cast<double>(queries_);
    if (answering_) {
      answer_sum_ += attended / layers;
      answer_queries_ += t;
      result_.answer_kv_tokens = answer_sum_ / static_cast<double>(answer_queries_);
    }
    result_.peak_kv_tokens = std::max(result_.peak_kv_tokens, held / layers);
    if (kv > result_.peak_kv_bytes) {
      result_.peak_kv_bytes = kv;
      result_.peak_policy_state_bytes = state;
    }
    return caches_[0].tokens_seen() % n_up_ == 0;
  }

  // Another sequence's accounts so far (a shared prefix: the same tokens through the same caches).
  void CopyAccountsFrom(const CacheTracker& other) {
    attended_sum_ = other.attended_sum_;
    answer_sum_ = other.answer_sum_;
    queries_ = other.queries_;
    answer_queries_ = other.answer_queries_;
    answering_ = other.answering_;
  }

  // The due update of every layer, for apply_memory_updates (with the batch's other sequences').
  void AddUpdates(std::vector<MemoryUpdate>& updates) {
    before_.clear();
    for (std::size_t layer = 0; layer < caches_.size(); ++layer) {
      before_.push_back(Positions(layer));
      updates.push_back(MemoryUpdate{&policy_, static_cast<int>(layer), &caches_[layer]});
    }
  }

  // The updates' statuses, one per layer in order: the first error, or the update recorded.
  Status EndUpdate(const Status* statuses) {
    const int64_t length = caches_[0].tokens_seen();
    MemoryUpdateRecord record{length, {}, false};
    for (std::size_t layer = 0; layer < caches_.size(); ++layer) {
      NAMM_RETURN_IF_ERROR(statuses[layer]);
      RecordEvictions(layer, before_[layer], length);
      record.cache_sizes.push_back(TokensPerHead(caches_[layer]));
    }
    result_.updates.push_back(std::move(record));
    return Status::Ok();
  }

  // The policy's end-of-prefill hook on every layer; recorded when it compressed any.
  Status EndPrefill() {
    MemoryUpdateRecord record{caches_[0].tokens_seen(), {}, true};
    bool compressed = false;
    for (std::size_t layer = 0; layer < caches_.size(); ++layer) {
      const at::Tensor before = Positions(layer);
      NAMM_ASSIGN_OR_RETURN(bool gathered, apply_end_of_prefill(policy_, static_cast<int>(layer), caches_[layer]));
      if (gathered) RecordEvictions(layer, before, caches_[0].tokens_seen());
      compressed = compressed || gathered;
      record.cache_sizes.push_back(TokensPerHead(caches_[layer]));
    }
    if (compressed) result_.updates.push_back(std::move(record));
    answering_ = true;
    return Status::Ok();
  }

 private:
  // A copy of a layer's cached positions [kv_heads, n] on the host, when recording evictions (a copy: the cache
  // gathers in place, so a view would change under us).
  at::Tensor Positions(std::size_t layer) const {
    if (result_.retention.positions == 0) return at::Tensor();
    return caches_[layer].positions().to(at::kCPU).clone(at::MemoryFormat::Contiguous);
  }
  // Positions held `before` an update and gone after it left at sequence length `length`. Each head's
  // positions are ascending before and after (a gather keeps the order).
  void RecordEvictions(std::size_t layer, const at::Tensor& before, int64_t length) {
    if (!before.defined()) return;
    Retention& r = result_.retention;
    const at::Tensor after = Positions(layer);
    const int64_t n_before = before.size(1), n_after = after.size(1);
    for (int64_t h = 0; h < r.kv_heads; ++h) {
      const int64_t* was = before.data_ptr<int64_t>() + h * n_before;
      const int64_t* is = after.data_ptr<int64_t>() + h * n_after;
      int32_t* evicted = r.evicted_at.data() + (static_cast<int64_t>(layer) * r.kv_heads + h) * r.positions;
      for (int64_t i = 0, j = 0; i < n_before; ++i) {
        while (j < n_after && is[j] < was[i]) ++j;
        if ((j == n_after || is[j] != was[i]) && was[i] >= 0 && was[i] < r.positions) {
          evicted[was[i]] = static_cast<int32_t>(length);
        }
      }
    }
  }

  std::vector<LayerKVCache>& caches_;
  MemoryPolicy& policy_;
  std::vector<at::Tensor> before_;  // per layer, the positions before a due update (when recording evictions)
  int64_t n_up_;
  GenerationResult& result_;
  double attended_sum_ = 0, answer_sum_ = 0;
  int64_t queries_ = 0, answer_queries_ = 0;
  bool answering_ = false;  // after the prompt
};

// Token ids as an int64 CPU tensor (the model moves them to its device).
at::Tensor IdTensor(const std::vector<int64_t>& ids) {
  return at::from_blob(const_cast<int64_t*>(ids.data()), {static_cast<int64_t>(ids.size())},
                       at::TensorOptions().dtype(at::kLong).device(at::kCPU))
      .clone();
}

Status CheckRequest(const Generator::Request& request, const LlamaConfig& config) {
  const GenerationOptions& options = request.options;
  const auto length = static_cast<int64_t>(request.prompt_ids.size());
  if (request.policy == nullptr) return Status::InvalidArgument("a sequence needs a memory policy");
  if (length == 0) return Status::InvalidArgument("the prompt is empty");
  if (options.chunk_size <= 0 || options.memory_update_interval <= 0 ||
      options.memory_update_interval % options.chunk_size != 0) {
    return Status::InvalidArgument("the chunk size (" + std::to_string(options.chunk_size) +
                                   ") must be positive and divide the memory update interval (" +
                                   std::to_string(options.memory_update_interval) + ")");
  }
  if (options.max_new_tokens < 0) return Status::InvalidArgument("max_new_tokens must be >= 0");
  const auto forced = static_cast<int64_t>(options.forced_tokens.size());
  if (!options.teacher_forcing && forced > 0) {
    return Status::InvalidArgument("forced tokens need teacher_forcing");
  }
  if (options.teacher_forcing && options.max_new_tokens > 0) {
    return Status::InvalidArgument("teacher-forced tokens and generated tokens cannot be combined");
  }
  const int64_t context = options.max_context > 0 ? options.max_context : config.context_length();
  // Compared without a sum that max_new_tokens = 2^63 - 1 (a task file's, a flag's) would overflow.
  if (options.max_new_tokens > context - length - forced) {
    const uint64_t more = static_cast<uint64_t>(options.max_new_tokens) + static_cast<uint64_t>(forced);
    return Status::InvalidArgument("the prompt (" + std::to_string(length) + " tokens) plus " +
                                   std::to_string(more) + " new tokens exceeds the context of " +
                                   std::to_string(context) + " tokens (" + config.rope_scaling.ToString() +
                                   "); shorten or truncate the prompt");
  }
  return Status::Ok();
}

// One sequence's generation, a step at a time: the prompt cut at absolute multiples of the chunk size (every
// position's logits kept when recording them, else the last one's), the policy's end-of-prefill hook, then
// teacher-forced tokens chunked the same way, or greedy decoding (or seeded sampling) one token per step.
class Sequence {
 public:
  Sequence(const LlamaModel& model, const Tokenizer& tokenizer, const Generator::Request& request)
      : model_(model), tokenizer_(tokenizer), request_(request), options_(request.options) {}

  Status Begin() {
    NAMM_RETURN_IF_ERROR(CheckRequest(request_, model_.config()));
    MemoryPolicy& policy = *request_.policy;
    const auto length = static_cast<int64_t>(request_.prompt_ids.size());
    const auto forced = static_cast<int64_t>(options_.forced_tokens.size());
    result_.prompt_tokens = length;
    NAMM_RETURN_IF_ERROR(policy.BeginSequence(SequenceInfo{request_.prompt_ids}));
    caches_ = model_.NewCaches(policy);
    // The sequence's length is bounded: a cache never grows past what the rest of the sequence can fill. One that
    // keeps everything is allocated once on the host, where pages cost memory only as they are written; on a
    // device (whose allocator commits what it hands out) it grows with the sequence, as a request's allowance
    // (max_tokens) may be far more than it uses.
    const bool allocate_now = !policy.may_evict() && model_.options().device().is_cpu();
    for (LayerKVCache& cache : caches_) cache.ExpectTokens(length + forced + options_.max_new_tokens, allocate_now);
    tracker_ = std::make_unique<CacheTracker>(
        caches_, policy, options_.memory_update_interval, result_,
        options_.record_retention ? length + forced + options_.max_new_tokens : 0);
    Feed(request_.prompt_ids, options_.record_logits);
    phase_ = Phase::kPrompt;
    return Status::Ok();
  }

  bool done() const { return phase_ == Phase::kDone; }
  bool prefilling() const { return phase_ == Phase::kPrompt; }
  bool decoding() const { return phase_ == Phase::kDecode; }
  int64_t tokens_seen() const { return caches_.empty() ? 0 : caches_[0].tokens_seen(); }

  // Prefix sharing (MemoryPolicy::prefix_key): sequences with equal keys and prompts compute the same caches
  // and accounts until the first memory update (or the prompt's end, if sooner); only one of them, the leader,
  // runs that prefix, and the others copy it (ForkFrom) once the leader's pass reaches fork_at() and before
  // its update. A key of "" never shares.
  std::string PrefixKey() const {
    const MemoryPolicy& policy = *request_.policy;
    if (done() || tokens_seen() != 0 || policy.prefix_key().empty()) return "";
    return policy.prefix_key() + "|" + std::to_string(options_.chunk_size) + "|" +
           std::to_string(options_.memory_update_interval) + "|" + std::to_string(options_.record_logits) + "|" +
           std::to_string(options_.record_retention) + "|" +
           std::to_string(static_cast<int64_t>(options_.forced_tokens.size()) + options_.max_new_tokens) + "|" +
           std::to_string(policy.may_evict()) + "|" + std::to_string(policy.query_history());
  }
  const std::vector<int64_t>& prompt() const { return request_.prompt_ids; }
  int64_t fork_at() const {
    return std::min(options_.memory_update_interval, static_cast<int64_t>(request_.prompt_ids.size()));
  }
  // Becomes `leader` as it stands after the pass that reached fork_at(): caches, accounts and the step's logits.
  // A pool too dry for the copy is this sequence's failure alone (KvBlockPool::IsExhausted), as an append's is.
  Status ForkFrom(const Sequence& leader) {
    for (std::size_t layer = 0; layer < caches_.size(); ++layer) {
      NAMM_ASSIGN_OR_RETURN(caches_[layer], leader.caches_[layer].Clone());
    }
    request_.policy->AdoptPrefix(*leader.request_.policy);
    tracker_->CopyAccountsFrom(*leader.tracker_);
    result_.mean_kv_tokens = leader.result_.mean_kv_tokens;
    result_.answer_kv_tokens = leader.result_.answer_kv_tokens;
    result_.peak_kv_tokens = leader.result_.peak_kv_tokens;
    result_.peak_kv_bytes = leader.result_.peak_kv_bytes;
    result_.peak_policy_state_bytes = leader.result_.peak_policy_state_bytes;
    result_.prefill_seconds = leader.result_.prefill_seconds;
    result_.shared_prefix_tokens = leader.tokens_seen();
    fed_ = leader.fed_;
    step_length_ = leader.step_length_;
    pieces_ = leader.pieces_;
    logits_ = leader.logits_;
    return Status::Ok();
  }
  const std::vector<int64_t>& tokens() const { return result_.token_ids; }
  int64_t kv_bytes() const {
    int64_t bytes = 0;
    for (const auto& cache : caches_) bytes += cache.kv_bytes();
    return bytes;
  }

  // Key and value storage held (all layers), and what the next step's tokens may add to it.
  int64_t reserved_bytes() const {
    int64_t bytes = 0;
    for (const auto& cache : caches_) bytes += cache.reserved_kv_bytes();
    return bytes;
  }
  int64_t growth_bytes() const {
    if (done() || caches_.empty()) return 0;
    const int64_t next = NextStepLength();
    int64_t bytes = 0;
    for (const auto& cache : caches_) bytes += cache.reserved_kv_bytes_after(next) - cache.reserved_kv_bytes();
    return bytes;
  }

  // How many tokens NextStep() will feed: a generated token, or the next chunk.
  int64_t NextStepLength() const { return phase_ == Phase::kDecode ? 1 : ChunkLength(); }

  // The tokens of this sequence's next forward pass.
  LlamaModel::Step NextStep() {
    if (phase_ == Phase::kDecode) {
      return {at::full({1}, next_token_, at::TensorOptions().dtype(at::kLong).device(at::kCPU)), &caches_,
              request_.policy, false};
    }
    step_length_ = ChunkLength();
    return {feed_.narrow(0, fed_, step_length_), &caches_, request_.policy, all_logits_};
  }

  // After a step, in three parts so that a batch's memory updates run together between them: the step's logits
  // (or its error) taken, true when a memory update is due; the due updates (AddUpdates, then
  // apply_memory_updates); then the rest of the step, with the updates' statuses (one per layer) if one was due.
  bool TakeLogits(Result<at::Tensor> logits) {
    if (!logits.ok()) {
      Fail(logits.status());
      return false;
    }
    if (phase_ == Phase::kDecode) {
      ++result_.decode_steps;
    } else {
      if (all_logits_) pieces_.push_back(*logits);
      fed_ += step_length_;
    }
    logits_ = std::move(*logits);
    return tracker_->Account(phase_ == Phase::kDecode ? 1 : step_length_);
  }
  void AddUpdates(std::vector<MemoryUpdate>& updates) { tracker_->AddUpdates(updates); }
  void FinishStep(const Status* update_statuses) {
    if (done()) return;
    Status status = update_statuses != nullptr ? tracker_->EndUpdate(update_statuses) : Status::Ok();
    if (status.ok()) status = Continue();
    if (!status.ok()) Fail(std::move(status));
  }

  // A pass of `seconds` this sequence took part in, prefilling or not when it began.
  void AddTime(bool prefilling, double seconds) {
    (prefilling ? result_.prefill_seconds : result_.decode_seconds) += seconds;
  }

  void Fail(Status error) {
    error_ = std::move(error);
    phase_ = Phase::kDone;
    caches_.clear();
  }

  Result<GenerationResult> TakeResult() {
    if (!error_.ok()) return std::move(error_);
    return std::move(result_);
  }

 private:
  enum class Phase { kPrompt, kForced, kDecode, kDone };

  // The next chunk of the prompt or forced tokens: up to the next multiple of the chunk size.
  int64_t ChunkLength() const {
    const int64_t seen = caches_[0].tokens_seen();
    return std::min(feed_.size(0) - fed_, options_.chunk_size - seen % options_.chunk_size);
  }

  void Feed(const std::vector<int64_t>& ids, bool all_logits) {
    feed_ = IdTensor(ids);
    fed_ = 0;
    all_logits_ = all_logits;
    pieces_.clear();
  }

  // The step's end, its logits taken and its memory update done: the next token, or the feed's end.
  Status Continue() {
    if (phase_ == Phase::kDecode) return Decide();
    if (fed_ < feed_.size(0)) return Status::Ok();
    return phase_ == Phase::kPrompt ? EndPrompt() : EndForced();
  }

  // The prompt's logits recorded, the end-of-prefill hook, then forced tokens or decoding.
  Status EndPrompt() {
    if (options_.record_logits) {
      result_.prompt_logits = at::cat(pieces_, 0);
      logits_ = result_.prompt_logits.narrow(0, result_.prompt_tokens - 1, 1);
    }
    NAMM_RETURN_IF_ERROR(tracker_->EndPrefill());
    if (options_.teacher_forcing) {
      result_.forced_logits = logits_;
      if (options_.forced_tokens.empty()) return Finish("forced");
      Feed(options_.forced_tokens, true);
      phase_ = Phase::kForced;
      return Status::Ok();
    }
    phase_ = Phase::kDecode;
    result_.stop_reason = "max_new_tokens";
    return Decide();
  }

  // Teacher-forced tokens (counted as decoding work): logits after the prompt and after each forced token.
  Status EndForced() {
    pieces_.insert(pieces_.begin(), result_.forced_logits);
    result_.forced_logits = at::cat(pieces_, 0);
    result_.decode_steps = static_cast<int64_t>(options_.forced_tokens.size());
    return Finish("forced");
  }

  // The next token from the latest logits, or the end of generation.
  Status Decide() {
    const std::size_t made = result_.token_ids.size();
    if (static_cast<int64_t>(made) >= options_.max_new_tokens) return Finish(result_.stop_reason);
    if (options_.record_logits) generated_logits_.push_back(logits_);
    const int64_t next = ChooseToken(logits_[0], options_, static_cast<uint64_t>(made));
    if (std::find(options_.eos_ids.begin(), options_.eos_ids.end(), next) != options_.eos_ids.end()) {
      return Finish("eos");
    }
    result_.token_ids.push_back(next);
    if (!options_.stop_strings.empty()) {
      const std::string text = AnswerText();
      if (std::any_of(options_.stop_strings.begin(), options_.stop_strings.end(),
                      [&](const std::string& stop) { return text.find(stop) != std::string::npos; })) {
        return Finish("stop_string");
      }
    }
    if (static_cast<int64_t>(result_.token_ids.size()) == options_.max_new_tokens) return Finish("max_new_tokens");
    next_token_ = next;
    return Status::Ok();
  }

  std::string AnswerText() const {
    return decode_continuation(tokenizer_, answer_context(request_.prompt_ids, options_), result_.token_ids);
  }

  Status Finish(const std::string& stop_reason) {
    result_.stop_reason = stop_reason;
    if (!generated_logits_.empty()) result_.generated_logits = at::cat(generated_logits_, 0);
    if (!options_.teacher_forcing) {
      result_.text = AnswerText();
      for (const auto& stop : options_.stop_strings) {
        const auto pos = result_.text.find(stop);
        if (pos != std::string::npos) result_.text.resize(pos);
      }
    }
    for (const auto& cache : caches_) result_.final_cache_sizes.push_back(TokensPerHead(cache));
    if (!caches_.empty()) result_.retention.cached = caches_[0].tokens_seen();
    phase_ = Phase::kDone;
    caches_.clear();
    return Status::Ok();
  }

  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
  const Generator::Request& request_;
  const GenerationOptions& options_;
  GenerationResult result_;
  Status error_;
  std::vector<LayerKVCache> caches_;
  std::unique_ptr<CacheTracker> tracker_;
  Phase phase_ = Phase::kPrompt;
  at::Tensor feed_;  // the prompt or the forced tokens
  int64_t fed_ = 0, step_length_ = 0;
  bool all_logits_ = false;
  std::vector<at::Tensor> pieces_;            // the feed's logits so far, when all are kept
  at::Tensor logits_;                         // [1, vocab]: the latest position's
  std::vector<at::Tensor> generated_logits_;  // when recording logits
  int64_t next_token_ = 0;
};

}  // namespace generation_internal

using generation_internal::Clock;
using generation_internal::Sequence;

double GenerationResult::prefill_tokens_per_second() const {
  return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
}

double GenerationResult::decode_tokens_per_second() const {
  return decode_seconds > 0 ? static_cast<double>(decode_steps) / decode_seconds : 0.0;
}

Result<GenerationResult> Generator::Generate(const std::vector<int64_t>& prompt_ids, MemoryPolicy& policy,
                                             const GenerationOptions& options) const {
  return std::move(GenerateBatch({Request{prompt_ids, &policy, options}}).front());
}

std::vector<Result<GenerationResult>> Generator::GenerateBatch(const std::vector<Request>& requests) const {
  GenerationBatch batch(model_, tokenizer_);
  std::vector<int64_t> ids;
  for (const Request& request : requests) ids.push_back(batch.Join(request));
  while (batch.Step()) {
  }
  std::vector<Result<GenerationResult>> results;
  for (int64_t id : ids) results.push_back(batch.Leave(id));
  return results;
}

// A sequence and the request it runs (which the sequence refers to, so both live in one node).
struct GenerationBatch::Entry {
  explicit Entry(Generator::Request r) : request(std::move(r)) {}
  Generator::Request request;
  std::unique_ptr<Sequence> sequence;
  Entry* leader = nullptr;         // the sequence whose prefix this one waits for
  std::vector<Entry*> followers;   // the sequences waiting for this one's prefix
  bool held = false;               // Hold(): out of Step() until let go
};

GenerationBatch::GenerationBatch(const LlamaModel& model, const Tokenizer& tokenizer)
    : model_(model), tokenizer_(tokenizer) {}

GenerationBatch::~GenerationBatch() = default;

// Generation runs in inference mode: no autograd bookkeeping on any operation (a view costs less, and the
// per-sequence path is hundreds of small operations per step). The tensors it makes (caches, logits) are
// inference tensors: callers read them, and nothing outside modifies them in place.
int64_t GenerationBatch::Join(Generator::Request request) {
  const c10::InferenceMode inference;
  auto entry = std::make_unique<Entry>(std::move(request));
  entry->sequence = std::make_unique<Sequence>(model_, tokenizer_, entry->request);
  if (Status begun = entry->sequence->Begin(); !begun.ok()) entry->sequence->Fail(std::move(begun));
  const int64_t id = next_id_++;
  entries_.emplace(id, std::move(entry));
  return id;
}

void GenerationBatch::SharePrefixes() {
  std::map<std::pair<std::string, std::vector<int64_t>>, Entry*> leaders;
  for (const auto& [id, entry] : entries_) {
    if (entry->held || entry->leader != nullptr || !entry->followers.empty()) continue;
    std::string key = entry->sequence->PrefixKey();
    if (key.empty()) continue;
    auto [it, first] = leaders.try_emplace({std::move(key), entry->sequence->prompt()}, entry.get());
    if (first) continue;
    entry->leader = it->second;
    it->second->followers.push_back(entry.get());
  }
}

void GenerationBatch::Unpark(Entry& leader) {
  for (Entry* follower : leader.followers) follower->leader = nullptr;
  leader.followers.clear();
}

bool GenerationBatch::Step(int64_t step_tokens) {
  const c10::InferenceMode inference;
  SharePrefixes();
  std::vector<Entry*> active;  // followers of a leader wait for its prefix
  std::vector<LlamaModel::Step> steps;
  // Decoding sequences first, a token each; then chunks (of prompts, or forced tokens) in the order the sequences
  // joined, while the step's token budget lasts. A chunk that does not fit waits, and so do the chunks after it,
  // except that a step always runs one chunk (every prompt keeps moving). A sequence's chunks are its own
  // multiples of its chunk size whenever they run, so its result does not change; only when.
  int64_t tokens = 0;
  bool chunked = false, budget_spent = false;
  for (const bool decode : {true, false}) {
    for (const auto& [id, entry] : entries_) {
      Sequence& sequence = *entry->sequence;
      if (sequence.done() || entry->held || entry->leader != nullptr || sequence.decoding() != decode) {
        continue;
      }
      const int64_t length = sequence.NextStepLength();
      if (!decode && (budget_spent || (step_tokens > 0 && tokens + length > step_tokens && chunked))) {
        budget_spent = true;
        continue;
      }
      chunked = chunked || !decode;
      tokens += length;
      active.push_back(entry.get());
      steps.push_back(sequence.NextStep());
    }
  }
  if (active.empty()) return false;
  const auto start = Clock::now();
  std::vector<bool> prefilling;
  for (const Entry* entry : active) prefilling.push_back(entry->sequence->prefilling());
  // With contain_failures_, what one sequence's part throws fails it alone (Sequence::Fail), and what the shared
  // work throws fails every sequence of the step; without, exceptions propagate.
  const auto guarded = [&](Sequence& sequence, const std::function<void()>& part) {
    if (!contain_failures_) return part();
    try {
      part();
    } catch (const std::exception& e) {
      sequence.Fail(failure_status(e));
    }
  };
  std::vector<Result<at::Tensor>> logits;
  try {
    logits = model_.ForwardBatch(steps, contain_failures_);
  } catch (const std::exception& e) {
    if (!contain_failures_) throw;
    logits.assign(steps.size(), Result<at::Tensor>(failure_status(e)));
  }
  // The memory updates due after this pass, every sequence's and layer's at once (a batch of NAMMs scores all
  // of its tokens in one pass, on the thread budget), then each sequence's next token or end. A leader
  // whose pass reached the end of the shared prefix hands it to its followers first, which then take part.
  std::vector<MemoryUpdate> updates;
  std::vector<std::ptrdiff_t> first_update(active.size(), -1);  // per entry of `active`, its first update
  // A sequence's updates, or none if adding them failed it (its caches are gone: no update may point at them).
  const auto add_updates = [&](Sequence& sequence, std::ptrdiff_t& first) {
    const std::size_t before = updates.size();
    guarded(sequence, [&] { sequence.AddUpdates(updates); });
    if (sequence.done()) {
      updates.resize(before);
    } else {
      first = static_cast<std::ptrdiff_t>(before);
    }
  };
  const std::size_t stepped = active.size();
  for (std::size_t i = 0; i < stepped; ++i) {
    Sequence& sequence = *active[i]->sequence;
    bool due = false;
    guarded(sequence, [&] { due = sequence.TakeLogits(std::move(logits[i])); });
    if (due && !sequence.done()) add_updates(sequence, first_update[i]);
    if (active[i]->followers.empty() || (!sequence.done() && sequence.tokens_seen() < sequence.fork_at())) continue;
    const std::vector<Entry*> followers = active[i]->followers;
    Unpark(*active[i]);
    if (sequence.done()) continue;  // failed: each follower runs its own prefix from the next step
    for (Entry* follower : followers) {
      Sequence& copy = *follower->sequence;
      guarded(copy, [&] {
        if (Status forked = copy.ForkFrom(sequence); !forked.ok()) copy.Fail(std::move(forked));
      });
      active.push_back(follower);
      prefilling.push_back(true);
      first_update.push_back(-1);
      if (due && !copy.done()) add_updates(copy, first_update.back());
    }
  }
  std::vector<Status> statuses;
  try {
    statuses = apply_memory_updates(updates);
  } catch (const std::exception& e) {
    if (!contain_failures_) throw;
    statuses.assign(updates.size(), failure_status(e));
  }
  // Microseconds each (the next token's choice, bookkeeping): on this thread.
  for (std::size_t i = 0; i < active.size(); ++i) {
    Sequence& sequence = *active[i]->sequence;
    guarded(sequence, [&] { sequence.FinishStep(first_update[i] < 0 ? nullptr : statuses.data() + first_update[i]); });
  }
  if (!model_.options().device().is_cpu()) {
    generation_internal::WaitForDevice(at::zeros({1}, model_.options()));  // after the step, memory updates included
  }
  const double seconds = generation_internal::Since(start);
  for (std::size_t i = 0; i < active.size(); ++i) active[i]->sequence->AddTime(prefilling[i], seconds);
  return true;
}

bool GenerationBatch::finished(int64_t id) const { return entries_.at(id)->sequence->done(); }

const std::vector<int64_t>& GenerationBatch::tokens(int64_t id) const {
  return entries_.at(id)->sequence->tokens();
}

int64_t GenerationBatch::kv_bytes(int64_t id) const { return entries_.at(id)->sequence->kv_bytes(); }

int64_t GenerationBatch::reserved_bytes(int64_t id) const { return entries_.at(id)->sequence->reserved_bytes(); }

int64_t GenerationBatch::growth_bytes(int64_t id) const {
  const Entry& entry = *entries_.at(id);
  if (entry.leader == nullptr) return entry.sequence->growth_bytes();
  // A follower takes a copy of its leader's caches when the shared prefix is done, in place of its own (a full
  // cache on the CPU holds its whole allowance from the start: then the copy adds nothing).
  const Sequence& leader = *entry.leader->sequence;
  return std::max<int64_t>(0, leader.reserved_bytes() + leader.growth_bytes() - entry.sequence->reserved_bytes());
}

void GenerationBatch::Hold(int64_t id, bool held) {
  Entry& entry = *entries_.at(id);
  entry.held = held;
  if (!held) return;
  Detach(entry);  // neither waited for (its followers run their own prefix) nor waiting
}

void GenerationBatch::Detach(Entry& entry) {
  Unpark(entry);
  if (entry.leader != nullptr) {
    std::vector<Entry*>& others = entry.leader->followers;
    others.erase(std::remove(others.begin(), others.end(), &entry), others.end());
    entry.leader = nullptr;
  }
}

Result<GenerationResult> GenerationBatch::Leave(int64_t id) {
  const c10::InferenceMode inference;  // the caches it frees were made in it
  const auto it = entries_.find(id);
  if (it == entries_.end()) return Status::NotFound("no sequence " + std::to_string(id) + " in the batch");
  std::unique_ptr<Entry> entry = std::move(it->second);
  entries_.erase(it);
  Detach(*entry);  // a leader's followers run their own prefix; a follower is no longer waited for
  if (!entry->sequence->done()) return Status::FailedPrecondition("the sequence left before it finished");
  return entry->sequence->TakeResult();
}

std::size_t GenerationBatch::size() const { return entries_.size(); }

}  // namespace namm::worker
