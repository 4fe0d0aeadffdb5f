// A worker's side of the coordinator protocol (proto/namm/v1/coordinator.proto), independent of how prompts
// are run: register, receive leases on the stream, run their prompts on `concurrency` threads through a
// LeaseExecutor, report each prompt's result as it finishes, heartbeat the leases in flight, drop cancelled
// ones, and reconnect with exponential backoff when the coordinator goes away. Torch-free: namm-worker plugs
// in the model, the benchmark plugs in a simulated worker.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "namm/norm_stats.h"
#include "namm/status.h"

namespace namm::worker {

class WorkerMetrics;

// PEM files: `ca` verifies the coordinator (enables TLS); cert + key present a client certificate (mutual
// TLS). `server_name` overrides the name checked against the coordinator's certificate.
struct ClientTls {
  std::string ca, cert, key, server_name;
};

struct WorkerClientOptions {
  std::string coordinator;  // HOST:PORT
  std::string token;        // the run's shared secret
  std::string name;         // shown in the coordinator's logs and evaluation records
  std::string model_fingerprint;
  std::string device = "cpu";
  int64_t memory_bytes = 0;
  int concurrency = 1;      // executor threads
  // Prompts an executor thread runs together (LeaseExecutor::RunPrompts): it takes up to this many leases of
  // one task at once and runs their prompts side by side. The coordinator is offered concurrency x max_batch
  // leases at once (at most 64).
  int max_batch = 1;
  ClientTls tls;
  std::chrono::milliseconds backoff_initial{250}, backoff_max{15000};
  bool exit_when_done = false;  // return once the run has finished (else wait for the next coordinator)
  int max_message_bytes = 64 << 20;
  WorkerMetrics* metrics = nullptr;  // optional; outlives the client
};

// What the coordinator says about the run at registration.
struct RunInfo {
  std::string run_name;
  std::string architecture_json;
  std::string rope_scaling;  // "" = each task's own
};

struct LeaseWork {
  uint64_t id = 0;
  bool reference = false;   // base model with the full cache (no parameters)
  int64_t generation = 0;
  int64_t candidate = 0;
  std::string task;
  std::vector<int64_t> prompts;
  std::shared_ptr<const std::vector<float>> params;  // candidate leases
  std::optional<NormStats> norm_stats;               // frozen statistics to normalize with
  bool collect_norm_stats = false;                   // start from empty statistics and return them
};

struct PromptOutcome {
  double score = 0;
  double cache_size_mean = 0;
  int64_t cache_size_final = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double seconds = 0;
  // Where the time went: tokens run through the model in chunks (the prompt, or prompt and continuation when
  // teacher-forced) and one at a time (generated), and the seconds of each.
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  int64_t device_memory_bytes = 0;      // in use after the prompt (0: unknown; metrics use resident memory)
  std::optional<NormStats> norm_stats;  // when the lease collects statistics
};

// One prompt of one lease.
struct PromptJob {
  const LeaseWork* lease;
  int64_t prompt;
};

class LeaseExecutor {
 public:
  virtual ~LeaseExecutor() = default;
  // Called after each registration, before any lease of it: the run's architecture may have changed.
  virtual Status Prepare(const RunInfo& run) = 0;
  // Runs prompts of one task (of one lease or several: a generation's candidates on the same prompts) together
  // on thread `slot` (0..concurrency-1; an executor may keep per-slot state); at most max_batch of them. One
  // result per job, in order; a prompt's outcome must not depend on what it ran beside.
  virtual std::vector<Result<PromptOutcome>> RunPrompts(const std::vector<PromptJob>& jobs, int slot) = 0;
};

struct WorkerClientStats {
  int64_t sessions = 0, leases = 0, prompts = 0, accepted = 0, duplicates = 0, cancelled = 0, failed = 0;
  int64_t refused = 0;  // results and failures the coordinator did not take (ReportResponse.refused)
};

// What the worker does with a report the coordinator answered with gRPC status `code` (its `message`), `sent`
// results in it: one deliberate handling per status (docs/distribution.md, "A report is never lost by the
// worker"). Results are idempotent, so whatever is not known taken or never takeable is kept.
enum class ReportHandling {
  kTaken,      // OK: the results leave the outbox (the answer names those it refused, with their reasons)
  kRetry,      // kept, sent again with backoff; a lease whose reports fail this way without a reason the protocol
               // names (INTERNAL, UNKNOWN, DATA_LOSS) 20 times in a row is given up (logged): it expires and runs
               // elsewhere instead of being retried forever
  kSplit,      // more than gRPC lets the coordinator receive: sent again in halves
  kReconnect,  // kept; the worker registers again first (its session is gone, or its secret or model refused)
  kDrop,       // can never be taken (malformed, not understood, one result over the size limit): logged, dropped
};
ReportHandling report_handling(int code, const std::string& message, int sent);

class WorkerClient {
 public:
  WorkerClient(WorkerClientOptions options, LeaseExecutor& executor);
  ~WorkerClient();
  WorkerClient(const WorkerClient&) = delete;
  WorkerClient& operator=(const WorkerClient&) = delete;

  // Serves until drained, the run is finished (with exit_when_done) or Shutdown(). A refusal that retrying
  // cannot fix (wrong secret or fingerprint, malformed registration) is returned as an error.
  Status Run();
  // Thread-safe. Gracefully: no new leases, queued ones go back to the coordinator, running ones finish and
  // are reported, then Run() returns. Immediately: every lease goes back and Run() returns at once.
  void Drain(bool immediately);
  WorkerClientStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace namm::worker
