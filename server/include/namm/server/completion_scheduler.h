// Continuous batching for namm-api. Requests wait in a bounded queue and join the running batch
// (worker::GenerationBatch) between forward passes, at most max_running at once; each has its own memory policy
// and options. Every pass advances each decoding row by one generated token and then, within a per-pass token
// budget (step_tokens), prompt chunks in arrival order: a long prompt's prefill holds the others' decoding for
// one chunk at a time, and first tokens come in arrival order rather than all prompts finishing together. Rows leave when they finish, when their client
// cancels (a disconnect) or when their time runs out, and their caches are freed at that step boundary.
//
// One thread (the scheduler's) runs the model; HTTP threads Submit() and then Wait() on their handle for the
// text as it is generated. A row's tokens do not depend on what it is batched with (the batched engine's rule),
// so a seeded request gives the same text alone or under load.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "namm/server/openai_protocol.h"
#include "namm/status.h"

namespace namm::worker {
class LlamaModel;
class Tokenizer;
}  // namespace namm::worker

namespace namm::server {

class ApiMetrics;

struct SchedulerOptions {
  std::size_t max_running = 8;  // rows in the batch at once
  std::size_t max_queue = 64;   // requests waiting for a row; more are refused
  int64_t chunk_size = 128, update_interval = 512;
  // Tokens a forward pass takes at most (GenerationBatch::Step): each decoding row's next token first, then prompt
  // chunks in arrival order, at least one a pass; 0: every row's chunk each pass (all prompts advance together).
  int64_t step_tokens = 512;
  int64_t max_context = 0;  // longest sequence (prompt + new tokens); 0: the model's context
  double request_timeout_seconds = 600;  // from arrival to the last token
  uint64_t seed = 0;  // requests without a seed sample with one drawn from (seed, their arrival number)
  // Admission: the keys and values the running rows may hold together at most (0: no limit). A request's worst
  // case is worker::policy_peak_tokens (prompt + max_tokens, or a budget= or ratio= plus the memory-update
  // interval, at least the prompt for policies that keep it); it joins the batch only when what it is counted
  // at fits beside the running rows' (in arrival order: a large request is not passed by smaller ones), and one
  // whose worst case could never fit is refused with 400.
  int64_t max_kv_bytes = 0;
};

struct CompletionJob {
  std::vector<int64_t> prompt_ids;  // templated (BOS, chat turns)
  std::string policy;               // a policy spec (worker/policy_spec.h)
  std::string policy_label;         // what responses report (the spec without server paths)
  int64_t max_tokens = 16;
  std::string max_tokens_field = "max_tokens";  // the request's field, named in errors
  double temperature = 0;  // 0: greedy
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  // The answer's text continues the prompt's (a completion: it keeps the leading space its first token carries;
  // GenerationOptions::text_continues_prompt); false: decoded alone (a chat reply).
  bool text_continues_prompt = false;
  bool ignore_eos = false;  // max_tokens tokens, end-of-sequence tokens or not (benchmarks' fixed lengths)
  // Text sent as it is generated (CompletionHandle::Wait); false: only the whole answer when it finishes, and the
  // answer is decoded once instead of at every step.
  bool stream = true;
};

// What a waiting HTTP thread learns at a time.
struct CompletionUpdate {
  std::string text;  // generated since the previous update: whole UTF-8 characters, never the start of a stop string
  bool finished = false;
  std::optional<ApiError> error;  // when it finished with an error (the HTTP status it is answered with)
  CompletionOutcome outcome;  // when it finished without one (outcome.text: the whole answer)
};

// One request's link between the scheduler and the HTTP thread waiting for it.
class CompletionHandle {
 public:
  // News (new text, or the end) when there is some, else waits for it up to `timeout` and returns an empty update.
  CompletionUpdate Wait(std::chrono::milliseconds timeout);
  // Frees the request's row (or queue place) at the next step boundary; it then finishes with an error.
  void Cancel();

  // The scheduler's side.
  bool cancelled() const;
  void Publish(const std::string& text);
  void Finish(CompletionOutcome outcome);
  void Fail(ApiError error);

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::string text_;
  bool finished_ = false, cancelled_ = false, delivered_ = false;
  std::optional<ApiError> error_;
  CompletionOutcome outcome_;
};

class CompletionScheduler {
 public:
  // Starts the scheduler's thread. The model and tokenizer (and `metrics`, if any) must outlive it. `default_policy`
  // is made once here, so that a bad default (a missing NAMM file) fails at start.
  static Result<std::unique_ptr<CompletionScheduler>> Start(const worker::LlamaModel& model,
                                                            const worker::Tokenizer& tokenizer,
                                                            const std::string& default_policy,
                                                            SchedulerOptions options, ApiMetrics* metrics);
  ~CompletionScheduler();  // Stop()
  CompletionScheduler(const CompletionScheduler&) = delete;
  CompletionScheduler& operator=(const CompletionScheduler&) = delete;

  // Queues a request; null when the queue is full, or when the scheduler is stopping (then *stopping is set).
  std::shared_ptr<CompletionHandle> Submit(CompletionJob job, bool* stopping = nullptr);
  // Requests queued and running now.
  std::size_t queued() const;
  std::size_t running() const;
  // Seconds a newcomer may expect to wait for a row (for Retry-After): the mean request time so far, at least 1.
  int64_t retry_after_seconds() const;
  // Fails every queued and running request (503, "the server is shutting down") and joins the thread. Idempotent.
  void Stop();

 private:
  struct Impl;
  explicit CompletionScheduler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace namm::server
