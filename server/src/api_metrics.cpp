#include "api_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "namm/metrics_endpoint.h"

namespace namm::server {

namespace {
// Seconds, from a tenth of a millisecond (a token of stories260K) to ten minutes (--request-timeout's default: a
// long prompt's prefill on a CPU).
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
          300, 600};
}
}  // namespace

struct ApiMetrics::Impl {
  prometheus::Registry registry;
  prometheus::Family<prometheus::Counter>& requests = prometheus::BuildCounter()
      .Name("namm_api_requests_total").Help("HTTP requests answered, by endpoint and status").Register(registry);
  prometheus::Gauge& queued = prometheus::BuildGauge()
      .Name("namm_api_requests_queued").Help("Completion requests waiting for a row of the batch").Register(registry).Add({});
  prometheus::Gauge& running = prometheus::BuildGauge()
      .Name("namm_api_requests_running").Help("Completion requests in the running batch").Register(registry).Add({});
  prometheus::Gauge& held = prometheus::BuildGauge()
      .Name("namm_api_requests_held")
      .Help("Running requests that wait this step for KV memory (their caches kept)")
      .Register(registry).Add({});
  prometheus::Counter& held_steps = prometheus::BuildCounter()
      .Name("namm_api_held_steps_total")
      .Help("Steps that running requests waited for KV memory, summed over requests")
      .Register(registry).Add({});
  prometheus::Gauge& kv_bytes = prometheus::BuildGauge()
      .Name("namm_api_kv_cache_bytes").Help("Keys and values held by the running requests, all layers").Register(registry).Add({});
  prometheus::Gauge& kv_reserved = prometheus::BuildGauge()
      .Name("namm_api_kv_cache_reserved_bytes").Help("Key and value storage allocated for the running requests, all layers")
      .Register(registry).Add({});
  prometheus::Family<prometheus::Gauge>& blocks = prometheus::BuildGauge()
      .Name("namm_api_kv_blocks").Help("KV blocks of the pool (--kv-block-tokens) in use by the running requests, and free")
      .Register(registry);
  prometheus::Gauge& blocks_used = blocks.Add({{"state", "used"}});
  prometheus::Gauge& blocks_free = blocks.Add({{"state", "free"}});
  prometheus::Counter& preempted = prometheus::BuildCounter()
      .Name("namm_api_preemptions_total").Help("Running requests preempted for memory, to start again from the queue's front")
      .Register(registry).Add({});
  prometheus::Histogram& first_token = prometheus::BuildHistogram()
      .Name("namm_api_time_to_first_token_seconds").Help("From a request's arrival to its first generated token")
      .Register(registry).Add({}, LatencyBuckets());
  prometheus::Histogram& token_latency = prometheus::BuildHistogram()
      .Name("namm_api_time_per_output_token_seconds").Help("Between successive generated tokens of a request")
      .Register(registry).Add({}, LatencyBuckets());
  prometheus::Histogram& request_seconds = prometheus::BuildHistogram()
      .Name("namm_api_request_duration_seconds").Help("From a completion request's arrival to its last token")
      .Register(registry).Add({}, LatencyBuckets());
  prometheus::Counter& prompt_tokens = prometheus::BuildCounter()
      .Name("namm_api_prompt_tokens_total").Help("Prompt tokens of finished requests").Register(registry).Add({});
  prometheus::Counter& generated_tokens = prometheus::BuildCounter()
      .Name("namm_api_generated_tokens_total").Help("Tokens generated for finished requests (rate: tokens/s)")
      .Register(registry).Add({});
  prometheus::Counter& evicted_tokens = prometheus::BuildCounter()
      .Name("namm_api_evicted_tokens_total")
      .Help("Tokens the memory policy dropped from finished requests' caches (per KV head, mean over layers)")
      .Register(registry).Add({});
  prometheus::Family<prometheus::Counter>& dropped = prometheus::BuildCounter()
      .Name("namm_api_requests_dropped_total").Help("Requests ended early: their client disconnected, or out of time")
      .Register(registry);
  prometheus::Family<prometheus::Counter>& closed = prometheus::BuildCounter()
      .Name("namm_api_connections_closed_total")
      .Help("Idle connections closed to make room for a new one, by which limit was full")
      .Register(registry);
  // Every series from the start: a series that appears at 1 loses its first increment to rate() and increase().
  prometheus::Counter& dropped_timeout = dropped.Add({{"reason", "timeout"}});
  prometheus::Counter& dropped_disconnected = dropped.Add({{"reason", "disconnected"}});
  prometheus::Counter& closed_per_address = closed.Add({{"limit", "per_address"}});
  prometheus::Counter& closed_total = closed.Add({{"limit", "total"}});
  prometheus::Family<prometheus::Gauge>& connections = prometheus::BuildGauge()
      .Name("namm_api_connections").Help("Open connections, waiting for a request (idle) or busy with one")
      .Register(registry);
  prometheus::Gauge& idle_connections = connections.Add({{"state", "idle"}});
  prometheus::Gauge& busy_connections = connections.Add({{"state", "busy"}});
  prometheus::Family<prometheus::Gauge>& info = prometheus::BuildGauge()
      .Name("namm_api_info").Help("The model and default memory policy served, and the namm version").Register(registry);
};

ApiMetrics::ApiMetrics(const std::string& model, const std::string& policy) : impl_(std::make_unique<Impl>()) {
  impl_->info.Add({{"model", model}, {"policy", policy}, {"version", namm_version()}}).Set(1);
}

ApiMetrics::~ApiMetrics() = default;

void ApiMetrics::Request(const std::string& endpoint, int status) {
  impl_->requests.Add({{"endpoint", endpoint}, {"status", std::to_string(status)}}).Increment();
}

void ApiMetrics::Load(int64_t queued, int64_t running, int64_t held, int64_t kv_bytes,
                      int64_t reserved_bytes) {
  impl_->queued.Set(static_cast<double>(queued));
  impl_->running.Set(static_cast<double>(running));
  impl_->held.Set(static_cast<double>(held));
  impl_->held_steps.Increment(static_cast<double>(held));
  impl_->kv_bytes.Set(static_cast<double>(kv_bytes));
  impl_->kv_reserved.Set(static_cast<double>(reserved_bytes));
}

void ApiMetrics::Blocks(int64_t used, int64_t free) {
  impl_->blocks_used.Set(static_cast<double>(used));
  impl_->blocks_free.Set(static_cast<double>(free));
}

void ApiMetrics::Preempted() { impl_->preempted.Increment(); }

void ApiMetrics::FirstToken(double seconds) { impl_->first_token.Observe(seconds); }

void ApiMetrics::TokenLatency(double seconds) { impl_->token_latency.Observe(seconds); }

void ApiMetrics::Finished(const CompletionOutcome& outcome, double seconds) {
  impl_->request_seconds.Observe(seconds);
  impl_->prompt_tokens.Increment(static_cast<double>(outcome.prompt_tokens));
  impl_->generated_tokens.Increment(static_cast<double>(outcome.completion_tokens));
  impl_->evicted_tokens.Increment(outcome.cache.evicted_tokens);
}

void ApiMetrics::Dropped(bool timed_out) {
  (timed_out ? impl_->dropped_timeout : impl_->dropped_disconnected).Increment();
}

void ApiMetrics::ConnectionClosedForRoom(bool per_address) {
  (per_address ? impl_->closed_per_address : impl_->closed_total).Increment();
}

void ApiMetrics::Connections(int64_t idle, int64_t busy) {
  impl_->idle_connections.Set(static_cast<double>(idle));
  impl_->busy_connections.Set(static_cast<double>(busy));
}

std::string ApiMetrics::Exposition() const {
  return prometheus::TextSerializer().Serialize(impl_->registry.Collect());
}

}  // namespace namm::server
