// A worker's Prometheus metrics (docs/observability.md): prompts and leases processed, tokens prefilled and
// decoded and their speed, prompt latency, KV-cache size after eviction, device memory, errors by kind. The
// coordinator client records them; one instance may serve several clients of one process (simulated workers).
#pragma once

#include <memory>
#include <string>

#include "namm/status.h"

namespace namm::worker {

struct PromptOutcome;

enum class WorkerError { kPrompt, kReport, kConnection, kRefused };

class WorkerMetrics {
 public:
  // Serves /metrics on `listen` (HOST:PORT; port 0 picks a free one).
  static Result<std::unique_ptr<WorkerMetrics>> Start(const std::string& listen);
  ~WorkerMetrics();
  WorkerMetrics(const WorkerMetrics&) = delete;
  WorkerMetrics& operator=(const WorkerMetrics&) = delete;

  // http://HOST:PORT/metrics
  const std::string& url() const;

  // namm_worker_info for one worker of this process.
  void Describe(const std::string& worker, const std::string& device, const std::string& model_fingerprint);
  // +1 when a client registers, -1 when its session ends.
  void Connected(int delta);
  void LeasesInFlight(int64_t delta);
  void PromptDone(const PromptOutcome& outcome);
  void LeaseDone();
  void Error(WorkerError kind);

 private:
  struct Impl;
  explicit WorkerMetrics(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The process's resident memory in bytes (0 when unknown): a CPU worker's "device memory".
int64_t resident_memory_bytes();

}  // namespace namm::worker
