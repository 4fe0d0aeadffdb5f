// namm-api's Prometheus metrics (docs/observability.md): requests by endpoint and status, the queue and the running
// batch, time to first token and per-token latency, tokens in and out, the KV cache held and the tokens evicted.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "namm/server/openai_protocol.h"

namespace namm::server {

class ApiMetrics {
 public:
  ApiMetrics(const std::string& model, const std::string& policy);
  ~ApiMetrics();
  ApiMetrics(const ApiMetrics&) = delete;
  ApiMetrics& operator=(const ApiMetrics&) = delete;

  // An answered request (any endpoint, any status).
  void Request(const std::string& endpoint, int status);
  // After a step. held: running requests that waited this step for memory; kv_bytes: the keys and values
  // held; reserved: their storage allocated (what admission by memory counts).
  void Load(int64_t queued, int64_t running, int64_t held, int64_t kv_bytes, int64_t reserved_bytes);
  // KV blocks of the pool held by the running requests, and free (-1: the pool has no limit).
  void Blocks(int64_t used, int64_t free);
  // A running request preempted for memory (it starts again from the queue's front).
  void Preempted();
  void FirstToken(double seconds);    // from arrival
  void TokenLatency(double seconds);  // between successive tokens of a request
  void Finished(const CompletionOutcome& outcome, double seconds);
  void Dropped(bool timed_out);  // cancelled by its client (a disconnect), or out of time
  // An idle connection closed for a new one: its address's limit was full, or the server's.
  void ConnectionClosedForRoom(bool per_address);
  // Open connections: waiting for a request, and busy with one.
  void Connections(int64_t idle, int64_t busy);
  // The text exposition of every metric.
  std::string Exposition() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace namm::server
