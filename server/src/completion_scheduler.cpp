#include "namm/server/completion_scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <map>
#include <thread>

#include "api_metrics.h"
#include "namm/kv_cache.h"
#include "namm/tasks/normalized_score.h"
#include "namm/worker/generator.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/policy_spec.h"
#include "namm/worker/tokenizer.h"

namespace namm::server {

namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// SplitMix64: the sampling seed of the n-th unseeded request, below 2^53 so that a JavaScript client can send
// the reported seed back exactly.
uint64_t DrawSeed(uint64_t seed, uint64_t n) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (n + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (z ^ (z >> 31)) >> 11;
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD: what a character still arriving decodes as

// The longest clean-up rule's reach: " n't" is 4 bytes.
constexpr std::size_t kCleanUpReach = 4;

// How much of `text` (the answer so far) can be sent: not a trailing U+FFFD (the rest of its bytes may come with
// the next token), nor a tail that could begin a stop string (which would be cut from the answer), nor a space
// that a tokenizer's clean-up could still remove.

std::size_t StableLength(const std::string& text, const std::vector<std::string>& stop) {
  std::size_t end = text.size();
  while (end >= kReplacement.size() && std::string_view(text).substr(end - kReplacement.size()) == kReplacement) {
    end -= kReplacement.size();
  }
  std::size_t hold = 0;
  for (const std::string& s : stop) {
    for (std::size_t k = std::min(s.size() - 1, end); k > hold; --k) {
      if (text.compare(end - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  end -= hold;
  // A space among the last few bytes may still go: tokenizers that clean up spaces (transformers'
  // clean_up_tokenization_spaces: " ." -> ".", " n't" -> "n't", ...) rewrite it once the next token arrives, so
  // what was sent would no longer begin the answer. It waits for the text after it.
  const std::size_t space = text.find(' ', end >= kCleanUpReach ? end - kCleanUpReach : 0);  // the first near the end
  if (space < end) end = space;
  while (end > 0 && end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;  // whole characters
  return end;
}

ApiError ServerError(int status, std::string message) {
  return ApiError{status, std::move(message), "server_error", "", ""};
}

CacheReport MakeCacheReport(const worker::GenerationResult& r, const std::string& policy) {
  CacheReport c;
  c.policy = policy;
  const auto fed = static_cast<double>(r.prompt_tokens + r.decode_steps);
  c.mean_kv_tokens = r.mean_kv_tokens;
  c.relative_cache = tasks::relative_cache(r.mean_kv_tokens, r.prompt_tokens + r.decode_steps);
  c.peak_kv_tokens = r.peak_kv_tokens;
  double final_tokens = 0;
  for (int64_t size : r.final_cache_sizes) final_tokens += static_cast<double>(size);
  c.final_kv_tokens = r.final_cache_sizes.empty() ? 0 : final_tokens / static_cast<double>(r.final_cache_sizes.size());
  c.evicted_tokens = std::max(0.0, fed - c.final_kv_tokens);
  c.peak_kv_bytes = r.peak_kv_bytes;
  return c;
}

}  // namespace

// ---- CompletionHandle --------------------------------------------------------------------------------------------

CompletionUpdate CompletionHandle::Wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait_for(lock, timeout, [&] { return !text_.empty() || (finished_ && !delivered_); });
  CompletionUpdate update;
  update.text = std::move(text_);
  text_.clear();
  if (finished_ && !delivered_) {
    delivered_ = true;
    update.finished = true;
    update.error = error_;
    update.outcome = outcome_;
  }
  return update;
}

void CompletionHandle::Cancel() {
  std::lock_guard<std::mutex> lock(mutex_);
  cancelled_ = true;
}

bool CompletionHandle::cancelled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cancelled_;
}

void CompletionHandle::Publish(const std::string& text) {
  if (text.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    text_ += text;
  }
  changed_.notify_all();
}

void CompletionHandle::Finish(CompletionOutcome outcome) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return;
    finished_ = true;
    outcome_ = std::move(outcome);
  }
  changed_.notify_all();
}

void CompletionHandle::Fail(ApiError error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return;
    finished_ = true;
    error_ = std::move(error);
  }
  changed_.notify_all();
}

// ---- CompletionScheduler -----------------------------------------------------------------------------------------

struct CompletionScheduler::Impl {
  struct Waiting {
    CompletionJob job;
    std::shared_ptr<CompletionHandle> handle;
    Clock::time_point arrived;
    uint64_t seed = 0;
    // The answer's text sent so far. A preempted request starts again with the same seed, so it makes the same
    // tokens (a row's tokens do not depend on its batch): what it had sent is not sent again, and its first
    // `regenerate` tokens were counted.
    std::string sent;
    std::size_t regenerate = 0;
  };
  struct Row {
    Waiting request;
    std::unique_ptr<MemoryPolicy> policy;
    int64_t id = 0;
    std::size_t tokens_seen = 0;  // generated tokens already turned into text
    Clock::time_point last_token;
    int64_t admitted_bytes = 0;  // KvBytesAtStart when it joined: counted while it holds less
    int64_t peak_bytes = 0;      // the most it held and was about to add at a step
    bool held = false;           // waits this step for memory (GenerationBatch::Hold)
    std::vector<int64_t> text_context;  // the prompt tokens its text is decoded after (worker::answer_context)
  };

  Impl(const worker::LlamaModel& m, const worker::Tokenizer& t, SchedulerOptions o, ApiMetrics* mx)
      : model(m),
        tokenizer(t),
        options(std::move(o)),
        metrics(mx),
        kv_bytes_per_token(2 * m.config().n_layers * m.config().n_kv_heads * m.config().head_dim *
                           static_cast<int64_t>(c10::elementSize(m.options().dtype().toScalarType()))),
        factory(m.options().device(), &t),
        batch(m, t) {
    rows.reserve(options.max_running);
    batch.set_contain_failures(true);  // a request whose step throws fails alone (its error without internals)
  }

  const worker::LlamaModel& model;
  const worker::Tokenizer& tokenizer;
  const SchedulerOptions options;
  ApiMetrics* metrics;
  const int64_t kv_bytes_per_token;  // keys and values of one token, all layers, in the model's dtype

  // Storage for `tokens` tokens per KV head: whole blocks when the caches are in a pool's blocks.
  int64_t StoredTokens(int64_t tokens) const {
    const std::shared_ptr<KvBlockPool>& pool = model.kv_block_pool();
    if (pool == nullptr) return tokens;
    return (tokens + pool->block_tokens() - 1) / pool->block_tokens() * pool->block_tokens();
  }
  worker::PolicyFactory factory;  // the scheduler's thread only (after Start)
  worker::GenerationBatch batch;  // the scheduler's thread only
  std::vector<Row> rows;          // the scheduler's thread only
  // Per policy spec, the most KV storage a request held and was about to add at a step, running or finished
  // (the scheduler's thread only; at most kLearnedPolicies specs, as clients may name many).
  std::map<std::string, int64_t> learned_peak;
  // Set by a preemption, cleared when a row leaves: no request joins meanwhile, or the preempted one would join
  // again at once and be preempted again at the next growth (the thrash vLLM avoids the same way).
  bool admission_held = false;  // the scheduler's thread only
  static constexpr std::size_t kLearnedPolicies = 256;

  mutable std::mutex mutex;  // guards what follows
  std::condition_variable wake;
  std::deque<Waiting> queue;
  std::size_t running = 0;
  uint64_t arrivals = 0;
  double finished_seconds = 0;
  int64_t finished_count = 0;
  bool stopping = false;
  std::thread thread;

  // The scheduler's thread: admit, drop the cancelled and the late, step, publish; never lets an exception out.
  void Loop() {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stopping || !queue.empty() || !rows.empty(); });
        if (stopping) break;
      }
      try {
        DropCancelledAndLate();  // before admitting, so that no late request gets a cache
        Admit();
        MakeRoom();
        batch.Step(options.step_tokens);
        Publish();  // also the rows that could not begin, which took no step
        Gauges();
      } catch (const std::exception& e) {
        SafeFailAll(ServerError(500, "the model failed: " + worker::failure_status(e).message()));
      } catch (...) {
        SafeFailAll(ServerError(500, "the model failed"));
      }
    }
    SafeFailAll(ServerError(503, "the server is shutting down"));
  }

  // FailAll, which must not throw out of the thread either.
  void SafeFailAll(const ApiError& error) {
    try {
      FailAll(error);
    } catch (const std::exception& e) {
      spdlog::error("namm-api: could not end the running requests: {}", e.what());
    }
  }

  // The most keys and values `job` may hold at once (SchedulerOptions::max_kv_bytes), all layers.
  int64_t KvBytesAtMost(const CompletionJob& job) const {
    const int64_t prompt = static_cast<int64_t>(job.prompt_ids.size());
    const Result<int64_t> peak = worker::policy_peak_tokens(job.policy, prompt, job.max_tokens,
                                                            std::max(options.chunk_size, options.update_interval));
    return StoredTokens(peak.ok() ? *peak : prompt + job.max_tokens) * kv_bytes_per_token;
  }

  // The KV storage a running row holds and may add at the next step (GenerationBatch::growth_bytes).
  int64_t RowBytes(const Row& row) const { return batch.reserved_bytes(row.id) + batch.growth_bytes(row.id); }

  // RowBytes of the running rows, each at least what it was admitted at.
  int64_t KvBytesInUse() const {
    int64_t bytes = 0;
    for (const Row& row : rows) bytes += std::max(row.admitted_bytes, RowBytes(row));
    return bytes;
  }

  // The KV storage `job` is counted at when it joins: what it surely reaches (SureBytes), or, once requests of
  // its policy have run, the most one of them has held so far (within its own allowance). Each was measured at
  // 64 clients on a budget of 8 full caches: full caches counted at their first chunk were admitted by the dozen
  // and preempted in turn as they grew (64 admitted where 8 fit, 0.66x the tokens/s), and a NAMM's requests
  // counted so were preempted 98 times per 64 requests.
  int64_t KvBytesAtStart(const CompletionJob& job) const {
    const int64_t sure = SureBytes(job);
    const auto learned = learned_peak.find(job.policy);
    if (learned == learned_peak.end()) return sure;
    return std::max(sure, std::min(KvBytesAtMost(job), learned->second));
  }

  // The storage `job`'s caches surely reach: the full cache's allowance, a cache that may evict what it holds
  // at its first memory update (or its end, if sooner; a NAMM with prompt=keep, at the prompt's end), within
  // KvBytesAtMost.
  int64_t SureBytes(const CompletionJob& job) const {
    const auto prompt = static_cast<int64_t>(job.prompt_ids.size());
    const int64_t total = prompt + job.max_tokens;
    const Result<std::string> family = worker::policy_family(job.policy);
    const bool full = family.ok() && *family == "full";
    if (full) return StoredTokens(total) * kv_bytes_per_token;
    const int64_t first_eviction = worker::policy_keeps_prompt(job.policy) ? prompt : options.update_interval;
    const int64_t before_update = std::min(total, first_eviction);
    if (model.kv_block_pool() != nullptr) {
      return std::min(KvBytesAtMost(job), StoredTokens(before_update) * kv_bytes_per_token);
    }
    // A rectangular cache's capacity as it grows, step by step (prompt chunks, then a token at a time) until the
    // first update; nothing is evicted before it, so its room is the whole sequence.
    int64_t capacity = 0;
    for (int64_t size = 0; size < before_update;) {
      const int64_t step = size < prompt ? std::min(options.chunk_size, prompt - size) : 1;
      size += std::min(step, before_update - size);
      if (size > capacity) capacity = LayerKVCache::GrowCapacity(capacity, size, total);
    }
    return std::min(KvBytesAtMost(job), capacity * kv_bytes_per_token);
  }

  // With max_kv_bytes, by memory as it is used: a request joins when what it is counted at (KvBytesAtStart)
  // fits beside what the running rows hold and may add at their next step (held rows' growth included, so
  // nobody joins while rows wait for memory); the oldest waits for room and the ones behind it wait for it.
  // After a preemption, nobody joins until a running request leaves.
  void Admit() {
    if (admission_held && !rows.empty()) return;
    admission_held = false;
    while (rows.size() < options.max_running) {
      Waiting next;
      const int64_t in_use = options.max_kv_bytes > 0 && !rows.empty() ? KvBytesInUse() : 0;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (queue.empty()) return;
        if (options.max_kv_bytes > 0 && !rows.empty() &&
            in_use + KvBytesAtStart(queue.front().job) > options.max_kv_bytes) {
          return;
        }
        next = std::move(queue.front());
        queue.pop_front();
        running = rows.size() + 1;
      }
      // A request that cannot be admitted (its policy, or its cache: out of memory) fails alone.
      try {
        AdmitOne(std::move(next));
      } catch (const std::exception& e) {
        if (next.handle) next.handle->Fail(ServerError(503, std::string("cannot admit the request: ") + e.what()));
      }
      std::lock_guard<std::mutex> lock(mutex);
      running = rows.size();
    }
  }

  // Joins `next` to the batch; `next` is left as it was when this throws, for the caller to fail it.
  void AdmitOne(Waiting&& next) {
    {
      Result<std::unique_ptr<MemoryPolicy>> policy = factory.Make(next.job.policy);
      if (!policy.ok()) {
        // Named as responses name it: the spec holds the server's own paths (its NAMM's folder).
        std::string message = policy.status().message();
        const std::string& spec = next.job.policy;
        if (!next.job.policy_label.empty()) {
          for (std::size_t at = 0; !spec.empty() && (at = message.find(spec, at)) != std::string::npos;) {
            message.replace(at, spec.size(), next.job.policy_label);
            at += next.job.policy_label.size();
          }
        }
        next.handle->Fail(ApiError{400, "namm_policy: " + message, "invalid_request_error", "namm_policy", ""});
        return;
      }
      Row row;
      row.policy = std::move(*policy);
      worker::Generator::Request request;
      request.prompt_ids = next.job.prompt_ids;
      request.policy = row.policy.get();
      worker::GenerationOptions& o = request.options;
      o.max_new_tokens = next.job.max_tokens;
      o.stop_strings = next.job.stop;
      o.text_continues_prompt = next.job.text_continues_prompt;
      row.text_context = worker::answer_context(next.job.prompt_ids, o);
      o.chunk_size = options.chunk_size;
      o.memory_update_interval = options.update_interval;
      o.max_context = options.max_context;
      if (!next.job.ignore_eos) {
        o.eos_ids = model.config().eos_token_ids;
        for (int64_t id : tokenizer.eos_ids()) {
          if (std::find(o.eos_ids.begin(), o.eos_ids.end(), id) == o.eos_ids.end()) o.eos_ids.push_back(id);
        }
      }
      o.temperature = next.job.temperature;
      o.seed = next.seed;
      row.admitted_bytes = KvBytesAtStart(next.job);
      row.id = batch.Join(std::move(request));
      row.last_token = Clock::now();
      row.request = std::move(next);
      rows.push_back(std::move(row));  // reserved for max_running rows: does not throw
    }
  }

  // When the running rows' next step would pass max_kv_bytes, the youngest rows whose caches would grow wait
  // (held: they keep their caches and skip the step) until the rest fits; the oldest row always runs. A cache
  // that evicts gives blocks back at its next memory update, so a held row soon goes on where it stopped.
  // Only when the caches held, with the oldest row's growth, pass the limit do the youngest rows leave (their
  // caches freed) and go back to the front of the queue, as vLLM preempts by recomputation: nobody fails for
  // memory while it could wait (alone the oldest fits: Submit refused what could not). Measured at 64 clients
  // on a budget of 8 full caches (docs/serving.md): preempting at once recomputed the prompts of 23-34 of 64
  // NAMM requests.
  void MakeRoom() {
    if (options.max_kv_bytes <= 0) return;
    for (Row& row : rows) {
      const int64_t bytes = RowBytes(row);
      if (bytes <= row.peak_bytes) continue;
      row.peak_bytes = bytes;
      Learn(row);
    }
    std::vector<bool> hold;  // decided first, applied once: holding a row ends its part in a shared prefix
    while (true) {
      int64_t in_use = KvBytesInUse();
      hold.assign(rows.size(), false);
      for (std::size_t i = rows.size(); i-- > 1 && in_use > options.max_kv_bytes;) {
        const Row& row = rows[i];
        const int64_t growing = std::max(row.admitted_bytes, RowBytes(row));
        const int64_t still = std::max(row.admitted_bytes, batch.reserved_bytes(row.id));
        hold[i] = growing > still;
        if (hold[i]) in_use -= growing - still;
      }
      if (in_use <= options.max_kv_bytes || rows.size() <= 1) break;
      Row row = std::move(rows.back());
      rows.pop_back();
      (void)batch.Leave(row.id);  // "left before it finished": it starts again
      Waiting again = std::move(row.request);
      again.regenerate = std::max(again.regenerate, row.tokens_seen);
      {
        std::lock_guard<std::mutex> lock(mutex);
        queue.push_front(std::move(again));
        running = rows.size();
      }
      admission_held = true;
      if (metrics != nullptr) metrics->Preempted();
    }
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (hold[i] != rows[i].held) batch.Hold(rows[i].id, hold[i]);
      rows[i].held = hold[i];
    }
  }

  // Notes the most `row` has held and been about to add at a step under its policy spec.
  void Learn(const Row& row) {
    const std::string& policy = row.request.job.policy;
    if (learned_peak.size() >= kLearnedPolicies && learned_peak.count(policy) == 0) {
      learned_peak.erase(learned_peak.begin());
    }
    int64_t& peak = learned_peak[policy];
    peak = std::max(peak, row.peak_bytes);
  }

  void DropCancelledAndLate() {
    const auto now = Clock::now();
    const auto late = [&](Clock::time_point arrived) {
      return SecondsBetween(arrived, now) > options.request_timeout_seconds;
    };
    const auto failure = [&](const CompletionHandle& handle) {
      return handle.cancelled() ? ServerError(499, "cancelled by the client")
                                : ApiError{408, "the request took longer than the server's limit of " +
                                                    fmt::format("{:g}", options.request_timeout_seconds) + " s",
                                           "timeout", "", "request_timeout"};
    };
    std::vector<Waiting> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (auto it = queue.begin(); it != queue.end();) {
        if (it->handle->cancelled() || late(it->arrived)) {
          dropped.push_back(std::move(*it));
          it = queue.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Waiting& w : dropped) {
      w.handle->Fail(failure(*w.handle));
      if (metrics != nullptr) metrics->Dropped(!w.handle->cancelled());
    }
    for (auto it = rows.begin(); it != rows.end();) {
      const bool cancelled = it->request.handle->cancelled();
      if (cancelled || late(it->request.arrived)) {
        (void)batch.Leave(it->id);  // its caches go now
        it->request.handle->Fail(failure(*it->request.handle));
        if (metrics != nullptr) metrics->Dropped(!cancelled);
        it = rows.erase(it);
        admission_held = false;
      } else {
        ++it;
      }
    }
  }

  // New text of every row, and the end of the rows that finished.
  void Publish() {
    const auto now = Clock::now();
    for (auto it = rows.begin(); it != rows.end();) {
      Row& row = *it;
      std::string& sent = row.request.sent;
      const std::vector<int64_t>& tokens = batch.tokens(row.id);
      const std::size_t made = tokens.size() - row.tokens_seen;
      if (made > 0) {
        if (metrics != nullptr && tokens.size() > row.request.regenerate) {  // (not the tokens made again)
          if (row.tokens_seen == 0 && row.request.regenerate == 0) {
            metrics->FirstToken(SecondsBetween(row.request.arrived, now));
          } else {
            metrics->TokenLatency(SecondsBetween(row.last_token, now) / static_cast<double>(made));
          }
        }
        row.tokens_seen = tokens.size();
        row.last_token = now;
      }
      // A streaming row's new text: its whole answer decoded again (a tokenizer may rewrite what it decoded before).
      if (made > 0 && row.request.job.stream) {
        std::string text = worker::decode_continuation(tokenizer, row.text_context, tokens);
        // A whole stop string ends the answer where it begins (the sequence finishes at this step): it and what
        // follows it are never sent.
        for (const std::string& stop : row.request.job.stop) {
          const std::size_t at = text.find(stop);
          if (at != std::string::npos) text.resize(at);
        }
        const std::size_t stable = StableLength(text, row.request.job.stop);
        if (stable > sent.size() && text.compare(0, sent.size(), sent) == 0) {
          row.request.handle->Publish(text.substr(sent.size(), stable - sent.size()));
          sent = text.substr(0, stable);
        }
      }
      if (!batch.finished(row.id)) {
        ++it;
        continue;
      }
      Result<worker::GenerationResult> result = batch.Leave(row.id);
      const double seconds = SecondsBetween(row.request.arrived, now);
      if (!result.ok()) {
        const bool invalid = result.status().code() == Status::Code::kInvalidArgument;
        row.request.handle->Fail(invalid ? ApiError{400, result.status().message(), "invalid_request_error", "", ""}
                                         : ServerError(500, result.status().message()));
      } else {
        // The rest of the answer, cut at its stop string (a decoding that rewrote what was sent cannot be taken back).
        if (row.request.job.stream && result->text.size() > sent.size() &&
            result->text.compare(0, sent.size(), sent) == 0) {
          row.request.handle->Publish(result->text.substr(sent.size()));
        }
        CompletionOutcome outcome;
        outcome.text = result->text;
        outcome.finish_reason = result->stop_reason == "max_new_tokens" ? "length" : "stop";
        outcome.prompt_tokens = result->prompt_tokens;
        outcome.completion_tokens = static_cast<int64_t>(result->token_ids.size());
        outcome.seed = row.request.seed;
        outcome.cache = MakeCacheReport(*result, row.request.job.policy_label);
        if (metrics != nullptr) metrics->Finished(outcome, seconds);
        row.request.handle->Finish(std::move(outcome));
      }
      {
        std::lock_guard<std::mutex> lock(mutex);
        finished_seconds += seconds;
        ++finished_count;
      }
      it = rows.erase(it);
      admission_held = false;
    }
  }

  void Gauges() {
    std::size_t queued_now = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      running = rows.size();
      queued_now = queue.size();
    }
    if (metrics == nullptr) return;
    int64_t kv = 0, reserved = 0, held = 0;
    for (const Row& row : rows) {
      kv += batch.kv_bytes(row.id);
      reserved += batch.reserved_bytes(row.id);
      held += row.held ? 1 : 0;
    }
    metrics->Load(static_cast<int64_t>(queued_now), static_cast<int64_t>(rows.size()), held, kv, reserved);
    if (const std::shared_ptr<KvBlockPool>& pool = model.kv_block_pool(); pool != nullptr) {
      metrics->Blocks(pool->blocks_in_use(), pool->blocks_free());
    }
  }

  void FailAll(const ApiError& error) {
    for (Row& row : rows) {
      (void)batch.Leave(row.id);
      row.request.handle->Fail(error);
    }
    rows.clear();
    std::deque<Waiting> waiting;
    {
      std::lock_guard<std::mutex> lock(mutex);
      waiting.swap(queue);
      running = 0;
    }
    for (Waiting& w : waiting) w.handle->Fail(error);
    if (metrics != nullptr) metrics->Load(0, 0, 0, 0, 0);
  }
};

CompletionScheduler::CompletionScheduler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CompletionScheduler::~CompletionScheduler() { Stop(); }

Result<std::unique_ptr<CompletionScheduler>> CompletionScheduler::Start(const worker::LlamaModel& model,
                                                                        const worker::Tokenizer& tokenizer,
                                                                        const std::string& default_policy,
                                                                        SchedulerOptions options, ApiMetrics* metrics) {
  if (options.max_running == 0) return Status::InvalidArgument("--max-running must be at least 1");
  if (options.step_tokens < 0) return Status::InvalidArgument("--step-tokens must be 0 or more");
  if (options.chunk_size <= 0 || options.update_interval % options.chunk_size != 0) {
    return Status::InvalidArgument("--chunk-size (" + std::to_string(options.chunk_size) +
                                   ") must be positive and divide --update-interval (" +
                                   std::to_string(options.update_interval) + ")");
  }
  if (const std::shared_ptr<KvBlockPool>& pool = model.kv_block_pool(); pool != nullptr && pool->max_blocks() > 0) {
    // Admission keeps the running rows' blocks within max_kv_bytes: the pool must hold that many, or a row could
    // fail for memory that admission counted as there.
    if (options.max_kv_bytes <= 0 || pool->max_blocks() < options.max_kv_bytes / pool->block_bytes()) {
      return Status::InvalidArgument("the KV block pool holds " + std::to_string(pool->max_blocks()) +
                                     " blocks, fewer than --max-kv-bytes (" + std::to_string(options.max_kv_bytes) +
                                     ") admits");
    }
  }
  auto impl = std::make_unique<Impl>(model, tokenizer, std::move(options), metrics);
  // Made once now: a default policy that cannot be made (a missing NAMM file) stops the server at start, and the
  // factory keeps the NAMM file for every request after.
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<MemoryPolicy> probe, impl->factory.Make(default_policy));
  (void)probe;
  std::unique_ptr<CompletionScheduler> scheduler(new CompletionScheduler(std::move(impl)));
  Impl* raw = scheduler->impl_.get();
  raw->thread = std::thread([raw] { raw->Loop(); });
  return scheduler;
}

std::shared_ptr<CompletionHandle> CompletionScheduler::Submit(CompletionJob job, bool* stopping) {
  auto handle = std::make_shared<CompletionHandle>();
  const int64_t need = impl_->KvBytesAtMost(job);
  if (impl_->options.max_kv_bytes > 0 && need > impl_->options.max_kv_bytes) {
    const auto mib = [](int64_t bytes) {
      char text[32];
      std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
      return std::string(text);
    };
    handle->Fail(ApiError{400,
                          "the request may need " + mib(need) + " of KV cache (" +
                              std::to_string(job.prompt_ids.size()) + " prompt tokens + " + job.max_tokens_field + " " +
                              std::to_string(job.max_tokens) + " with " + job.policy_label +
                              "), more than the server holds for all requests together (--max-kv-bytes, " +
                              mib(impl_->options.max_kv_bytes) + "): ask for fewer tokens or a policy with a "
                              "budget",
                          "invalid_request_error", job.max_tokens_field, "context_length_exceeded"});
    return handle;
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (stopping != nullptr) *stopping = impl_->stopping;
    if (impl_->stopping || impl_->queue.size() >= impl_->options.max_queue) return nullptr;
    const uint64_t n = impl_->arrivals++;
    const uint64_t seed = job.seed ? *job.seed : DrawSeed(impl_->options.seed, n);
    impl_->queue.push_back(Impl::Waiting{std::move(job), handle, Clock::now(), seed, "", 0});
  }
  impl_->wake.notify_all();
  return handle;
}

std::size_t CompletionScheduler::queued() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->queue.size();
}

std::size_t CompletionScheduler::running() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->running;
}

int64_t CompletionScheduler::retry_after_seconds() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (impl_->finished_count == 0) return 1;
  return std::max<int64_t>(1, static_cast<int64_t>(impl_->finished_seconds / static_cast<double>(impl_->finished_count) + 0.5));
}

void CompletionScheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace namm::server
