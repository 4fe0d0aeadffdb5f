#include "namm/worker/generator.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "aten.h"

namespace namm::worker {

namespace {

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
  const at::Tensor probs = (scores / options.temperature).softmax(0);
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

// Bookkeeping shared by prefill and decoding: memory updates at multiples of n_up, the end-of-prefill hook, and
// cache sizes.
class CacheTracker {
 public:
  CacheTracker(std::vector<LayerKVCache>& caches, MemoryPolicy& policy, int64_t n_up, GenerationResult& result)
      : caches_(caches), policy_(policy), state_specs_(policy.token_state()), n_up_(n_up), result_(result) {}

  // After a forward pass of `t` tokens: record sizes and the peak, then run a memory update if the length is a
  // multiple of n_up.
  Status AfterForward(int64_t t) {
    int64_t kv = 0, state = 0;
    double held = 0, attended = 0;
    for (const auto& cache : caches_) {
      kv += (cache.keys().numel() + cache.values().numel()) * cache.keys().element_size();
      for (const auto& spec : state_specs_) {
        const at::Tensor s = cache.state(spec.name);
        state += s.numel() * s.element_size();
      }
      state += cache.query_history().bytes();
      // The step's queries saw n - t + 1, ..., n cached tokens.
      const auto n = static_cast<double>(cache.size()), steps = static_cast<double>(t);
      held += n;
      attended += steps * n - steps * (steps - 1) / 2;
    }
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
    const int64_t length = caches_[0].tokens_seen();
    if (length % n_up_ != 0) return Status::Ok();
    MemoryUpdateRecord record{length, {}, false};
    for (std::size_t layer = 0; layer < caches_.size(); ++layer) {
      NAMM_RETURN_IF_ERROR(apply_memory_update(policy_, static_cast<int>(layer), caches_[layer]));
      record.cache_sizes.push_back(caches_[layer].size());
    }
    result_.updates.push_back(std::move(record));
    return Status::Ok();
  }

  // The policy's end-of-prefill hook on every layer; recorded when it compressed any.
  Status EndPrefill() {
    MemoryUpdateRecord record{caches_[0].tokens_seen(), {}, true};
    bool compressed = false;
    for (std::size_t layer = 0; layer < caches_.size(); ++layer) {
      NAMM_ASSIGN_OR_RETURN(bool gathered, apply_end_of_prefill(policy_, static_cast<int>(layer), caches_[layer]));
      compressed = compressed || gathered;
      record.cache_sizes.push_back(caches_[layer].size());
    }
    if (compressed) result_.updates.push_back(std::move(record));
    answering_ = true;
    return Status::Ok();
  }

 private:
  std::vector<LayerKVCache>& caches_;
  MemoryPolicy& policy_;
  const std::vector<TokenStateSpec> state_specs_;
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

}  // namespace

double GenerationResult::prefill_tokens_per_second() const {
  return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
}

double GenerationResult::decode_tokens_per_second() const {
  return decode_seconds > 0 ? static_cast<double>(decode_steps) / decode_seconds : 0.0;
}

Result<GenerationResult> Generator::Generate(const std::vector<int64_t>& prompt_ids, MemoryPolicy& policy,
                                             const GenerationOptions& options) const {
  const auto length = static_cast<int64_t>(prompt_ids.size());
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
  const int64_t context = options.max_context > 0 ? options.max_context : model_.config().context_length();
  if (length + forced + options.max_new_tokens > context) {
    return Status::InvalidArgument("the prompt (" + std::to_string(length) + " tokens) plus " +
                                   std::to_string(options.max_new_tokens + forced) + " new tokens exceeds the context of " +
                                   std::to_string(context) + " tokens (" + model_.config().rope_scaling.ToString() +
                                   "); shorten or truncate the prompt");
  }

  GenerationResult result;
  result.prompt_tokens = length;
  NAMM_RETURN_IF_ERROR(policy.BeginSequence(SequenceInfo{prompt_ids}));
  std::vector<LayerKVCache> caches = model_.NewCaches(policy);
  // The sequence's length is known: a cache that keeps everything is allocated once, one that evicts never
  // grows past what the rest of the sequence can fill.
  for (LayerKVCache& cache : caches) cache.ExpectTokens(length + forced + options.max_new_tokens, !policy.may_evict());
  CacheTracker tracker(caches, policy, options.memory_update_interval, result);

  // Runs `ids` through the model, cut at absolute multiples of the chunk size; keeps every position's logits
  // when `all_logits`, else the last one's.
  const auto run_chunked = [&](const std::vector<int64_t>& ids, bool all_logits) -> Result<at::Tensor> {
    const at::Tensor tokens = IdTensor(ids);
    const auto n = static_cast<int64_t>(ids.size());
    const int64_t start = caches[0].tokens_seen();
    std::vector<at::Tensor> pieces;
    at::Tensor logits;
    for (int64_t begin = 0; begin < n;) {
      const int64_t end = std::min(n, ((start + begin) / options.chunk_size + 1) * options.chunk_size - start);
      NAMM_ASSIGN_OR_RETURN(logits, model_.Forward(tokens.narrow(0, begin, end - begin), caches, policy, all_logits));
      if (all_logits) pieces.push_back(logits);
      NAMM_RETURN_IF_ERROR(tracker.AfterForward(end - begin));
      begin = end;
    }
    return all_logits ? at::cat(pieces, 0) : logits;
  };

  // Prefill, then the policy's end-of-prefill hook.
  const auto prefill_start = Clock::now();
  at::Tensor logits;
  NAMM_ASSIGN_OR_RETURN(logits, run_chunked(prompt_ids, options.record_logits));
  if (options.record_logits) {
    result.prompt_logits = logits;
    logits = logits.narrow(0, length - 1, 1);
  }
  NAMM_RETURN_IF_ERROR(tracker.EndPrefill());
  WaitForDevice(logits);
  result.prefill_seconds = Since(prefill_start);

  // Teacher-forced tokens (counted as decoding work).
  if (options.teacher_forcing) {
    const auto forced_start = Clock::now();
    result.forced_logits = logits;
    if (forced > 0) {
      NAMM_ASSIGN_OR_RETURN(at::Tensor forced_logits, run_chunked(options.forced_tokens, true));
      result.forced_logits = at::cat({logits, forced_logits}, 0);
    }
    result.decode_steps = forced;
    result.decode_seconds = Since(forced_start);
    result.stop_reason = "forced";
    for (const auto& cache : caches) result.final_cache_sizes.push_back(cache.size());
    return result;
  }

  // Greedy decoding.
  const auto decode_start = Clock::now();
  std::vector<at::Tensor> generated_logits;
  result.stop_reason = "max_new_tokens";
  while (static_cast<int64_t>(result.token_ids.size()) < options.max_new_tokens) {
    if (options.record_logits) generated_logits.push_back(logits);
    const int64_t next = ChooseToken(logits[0], options, static_cast<uint64_t>(result.token_ids.size()));
    if (std::find(options.eos_ids.begin(), options.eos_ids.end(), next) != options.eos_ids.end()) {
      result.stop_reason = "eos";
      break;
    }
    result.token_ids.push_back(next);
    if (!options.stop_strings.empty()) {
      const std::string text = tokenizer_.Decode(result.token_ids);
      if (std::any_of(options.stop_strings.begin(), options.stop_strings.end(),
                      [&](const std::string& stop) { return text.find(stop) != std::string::npos; })) {
        result.stop_reason = "stop_string";
        break;
      }
    }
    if (static_cast<int64_t>(result.token_ids.size()) == options.max_new_tokens) break;
    const at::Tensor token = at::full({1}, next, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
    NAMM_ASSIGN_OR_RETURN(logits, model_.Forward(token, caches, policy, false));
    ++result.decode_steps;
    NAMM_RETURN_IF_ERROR(tracker.AfterForward(1));
  }
  result.decode_seconds = Since(decode_start);
  if (options.record_logits && !generated_logits.empty()) result.generated_logits = at::cat(generated_logits, 0);

  result.text = tokenizer_.Decode(result.token_ids);
  for (const auto& stop : options.stop_strings) {
    const auto pos = result.text.find(stop);
    if (pos != std::string::npos) result.text.resize(pos);
  }
  for (const auto& cache : caches) result.final_cache_sizes.push_back(cache.size());
  return result;
}

}  // namespace namm::worker
