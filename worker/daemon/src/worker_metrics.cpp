#include "namm/worker/worker_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <unistd.h>

#include <fstream>

#include "namm/metrics_endpoint.h"
#include "namm/worker/coordinator_client.h"

namespace namm::worker {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

int64_t resident_memory_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

struct WorkerMetrics::Impl {
  explicit Impl(std::unique_ptr<MetricsEndpoint> e) : endpoint(std::move(e)), r(endpoint->registry()) {}

  prometheus::Gauge& Gauge(const std::string& name, const std::string& help) {
    return BuildGauge().Name(name).Help(help).Register(r).Add({});
  }
  prometheus::Counter& Counter(const std::string& name, const std::string& help) {
    return BuildCounter().Name(name).Help(help).Register(r).Add({});
  }

  std::unique_ptr<MetricsEndpoint> endpoint;
  prometheus::Registry& r;
  prometheus::Family<prometheus::Gauge>& info =
      BuildGauge().Name("namm_worker_info").Help("A worker of this process").Register(r);
  prometheus::Gauge& connected = Gauge("namm_worker_connected", "Workers of this process registered with a coordinator");
  prometheus::Gauge& in_flight = Gauge("namm_worker_leases_in_flight", "Leases held");
  prometheus::Counter& leases = Counter("namm_worker_leases_completed_total", "Leases whose prompts all ran");
  prometheus::Counter& prompts = Counter("namm_worker_prompts_completed_total", "Prompts run and reported");
  prometheus::Counter& prefill_tokens = Counter("namm_worker_prefill_tokens_total", "Tokens prefilled");
  prometheus::Counter& decode_tokens = Counter("namm_worker_decode_tokens_total", "Tokens generated one at a time");
  prometheus::Gauge& prefill_speed =
      Gauge("namm_worker_prefill_tokens_per_second", "Prefill speed of the last prompt");
  prometheus::Gauge& decode_speed =
      Gauge("namm_worker_decode_tokens_per_second", "Decode speed of the last prompt that decoded");
  prometheus::Histogram& prompt_seconds =
      BuildHistogram()
          .Name("namm_worker_prompt_duration_seconds")
          .Help("One prompt end to end")
          .Register(r)
          .Add({}, prometheus::Histogram::BucketBoundaries{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                                                            120, 300, 600});
  prometheus::Gauge& cache_size =
      Gauge("namm_worker_cache_size_tokens", "KV-cache size after the last eviction of the last prompt (per layer)");
  prometheus::Gauge& memory = Gauge("namm_worker_device_memory_bytes",
                                    "Device memory in use (CUDA allocator) or, on CPU, the process's resident memory");
  prometheus::Family<prometheus::Counter>& errors =
      BuildCounter().Name("namm_worker_errors_total").Help("Errors by kind: prompt, report, connection, refused").Register(r);
};

Result<std::unique_ptr<WorkerMetrics>> WorkerMetrics::Start(const std::string& listen) {
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<MetricsEndpoint> endpoint, MetricsEndpoint::Start(listen));
  auto impl = std::make_unique<Impl>(std::move(endpoint));
  for (const char* kind : {"prompt", "report", "connection", "refused"}) impl->errors.Add({{"kind", kind}});
  impl->memory.Set(static_cast<double>(resident_memory_bytes()));
  return std::unique_ptr<WorkerMetrics>(new WorkerMetrics(std::move(impl)));
}

WorkerMetrics::WorkerMetrics(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WorkerMetrics::~WorkerMetrics() = default;

const std::string& WorkerMetrics::url() const { return impl_->endpoint->url(); }

void WorkerMetrics::Describe(const std::string& worker, const std::string& device,
                             const std::string& model_fingerprint) {
  impl_->info
      .Add({{"worker", worker}, {"device", device}, {"model_fingerprint", model_fingerprint},
            {"version", namm_version()}})
      .Set(1);
}

void WorkerMetrics::Connected(int delta) { impl_->connected.Increment(delta); }

void WorkerMetrics::LeasesInFlight(int64_t delta) { impl_->in_flight.Increment(static_cast<double>(delta)); }

void WorkerMetrics::PromptDone(const PromptOutcome& o) {
  Impl& m = *impl_;
  m.prompts.Increment();
  m.prefill_tokens.Increment(static_cast<double>(o.prefill_tokens));
  m.decode_tokens.Increment(static_cast<double>(o.decode_tokens));
  if (o.prefill_seconds > 0) m.prefill_speed.Set(static_cast<double>(o.prefill_tokens) / o.prefill_seconds);
  if (o.decode_seconds > 0 && o.decode_tokens > 0) {
    m.decode_speed.Set(static_cast<double>(o.decode_tokens) / o.decode_seconds);
  }
  m.prompt_seconds.Observe(o.seconds);
  m.cache_size.Set(static_cast<double>(o.cache_size_final));
  m.memory.Set(static_cast<double>(o.device_memory_bytes > 0 ? o.device_memory_bytes : resident_memory_bytes()));
}

void WorkerMetrics::LeaseDone() { impl_->leases.Increment(); }

void WorkerMetrics::Error(WorkerError kind) {
  static const char* const kKinds[] = {"prompt", "report", "connection", "refused"};
  impl_->errors.Add({{"kind", kKinds[static_cast<int>(kind)]}}).Increment();
}

}  // namespace namm::worker
