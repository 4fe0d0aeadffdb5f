// The coordinator's Prometheus metrics (docs/observability.md): where the run stands, the last committed
// generation's fitness, optimizer and cache statistics, the lease scheduler's counters, workers, and the
// durations of tell() and of the store's transactions. Every family carries the run's name as label `run`.
// The run loop feeds it; scrapes read it from the endpoint's thread (prometheus-cpp metrics are atomic).
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <map>
#include <string>

#include "namm/coordinator/run_spec.h"
#include "namm/coordinator/trainer.h"
#include "worker_service.h"

namespace namm::coordinator {

class CoordinatorMetrics {
 public:
  CoordinatorMetrics(prometheus::Registry& registry, const RunSpec& spec);

  // The phase in progress (or, finished, the end of the schedule).
  void SetPosition(int64_t stage, int64_t generation, bool finished);
  void PhaseStarted(int64_t units);
  // The service's counters since the last call become counter increments; its gauges are copied.
  void Observe(const ServiceCounters& counters, int64_t references_outstanding);
  // One transaction storing `results` results (reference scores included).
  void ResultsStored(int64_t results, double seconds);
  void GenerationCommitted(const AdvanceSummary& summary, double phase_seconds, double eta_seconds);
  // The gauges of a committed generation (also, at start-up, of the last one a resumed run committed):
  // they are absent until then. `metrics`: what the store keeps with the generation.
  void ShowGeneration(const GenerationRecord& record, const std::map<std::string, double>& metrics);

 private:
  // Adds to `counter` what `total` grew by since `last`.
  static void Advance(prometheus::Counter& counter, int64_t total, int64_t& last);
  prometheus::Gauge& Gauge(const std::string& name, const std::string& help);
  // A family whose only gauge appears when first set.
  prometheus::Family<prometheus::Gauge>& LazyGauge(const std::string& name, const std::string& help);
  prometheus::Counter& Counter(const std::string& name, const std::string& help);
  prometheus::Histogram& Histogram(const std::string& name, const std::string& help,
                                   const prometheus::Histogram::BucketBoundaries& buckets);
  static void SetNow(prometheus::Gauge& gauge);

  prometheus::Registry& registry_;
  const std::map<std::string, std::string> run_label_;

  prometheus::Gauge &stage_, &generation_, &generations_, &finished_, &last_result_;
  prometheus::Family<prometheus::Gauge>& eta_;  // absent until a generation of this process gives a pace
  prometheus::Counter& generations_completed_;
  prometheus::Histogram& generation_seconds_;
  prometheus::Family<prometheus::Gauge>&fitness_best_, &fitness_mean_, &fitness_std_, &population_cache_;
  prometheus::Family<prometheus::Gauge>&eval_fitness_, &eval_cache_mean_, &eval_cache_final_;
  prometheus::Family<prometheus::Gauge>&eval_task_score_, &eval_task_normalized_;
  prometheus::Family<prometheus::Gauge>&sigma_, &eigen_min_, &eigen_max_;
  prometheus::Counter &units_leased_, &units_completed_, &units_late_, &units_duplicate_, &units_failed_;
  prometheus::Counter &units_lost_, &units_dropped_;
  prometheus::Counter &leases_issued_, &leases_duplicated_, &leases_expired_, &leases_returned_;
  prometheus::Counter &leases_reattached_, &leases_reserved_;
  prometheus::Counter& results_refused_;
  prometheus::Counter& progress_log_errors_;
  prometheus::Gauge& progress_log_failing_;
  prometheus::Family<prometheus::Counter>& rejected_;
  prometheus::Gauge &phase_units_, &phase_units_done_, &queue_units_, &leases_active_;
  prometheus::Family<prometheus::Gauge>& workers_;
  prometheus::Gauge& references_outstanding_;
  prometheus::Histogram& tell_seconds_;
  prometheus::Family<prometheus::Histogram>& db_write_seconds_;

  SchedulerCounters last_;  // what Observe() saw last
  std::map<std::string, int64_t> last_rejected_;
  int64_t last_results_refused_ = 0;
  int64_t last_progress_log_errors_ = 0;
};

}  // namespace namm::coordinator
