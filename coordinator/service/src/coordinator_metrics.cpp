#include "coordinator_metrics.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "namm/metrics_endpoint.h"

namespace namm::coordinator {

namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

const prometheus::Histogram::BucketBoundaries kTellBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                               0.5,   1,      2.5,   5,    10,    30,   60};
const prometheus::Histogram::BucketBoundaries kDbBuckets = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                             0.05,   0.1,   0.25,   0.5,   1,    2.5};
const prometheus::Histogram::BucketBoundaries kGenerationBuckets = {1,   2.5, 5,    10,   30,   60,  120,
                                                                     300, 600, 1200, 1800, 3600, 7200};

double Or(const std::map<std::string, double>& m, const std::string& key) {
  const auto it = m.find(key);
  return it == m.end() ? std::nan("") : it->second;
}

}  // namespace

prometheus::Gauge& CoordinatorMetrics::Gauge(const std::string& name, const std::string& help) {
  return BuildGauge().Name(name).Help(help).Labels(run_label_).Register(registry_).Add({});
}

prometheus::Family<prometheus::Gauge>& CoordinatorMetrics::LazyGauge(const std::string& name,
                                                                   const std::string& help) {
  return BuildGauge().Name(name).Help(help).Labels(run_label_).Register(registry_);
}

prometheus::Counter& CoordinatorMetrics::Counter(const std::string& name, const std::string& help) {
  return BuildCounter().Name(name).Help(help).Labels(run_label_).Register(registry_).Add({});
}

prometheus::Histogram& CoordinatorMetrics::Histogram(const std::string& name, const std::string& help,
                                                     const prometheus::Histogram::BucketBoundaries& buckets) {
  return BuildHistogram().Name(name).Help(help).Labels(run_label_).Register(registry_).Add({}, buckets);
}

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& registry, const RunSpec& spec)
    : registry_(registry),
      run_label_{{"run", spec.name}},
      stage_(Gauge("namm_run_stage", "Stage of the generation in progress (0-based)")),
      generation_(Gauge("namm_run_generation", "Generation in progress (run-global, 0-based)")),
      generations_(Gauge("namm_run_generations", "Generations in the whole schedule")),
      finished_(Gauge("namm_run_finished", "1 once the schedule is done")),
      last_result_(Gauge("namm_run_last_result_timestamp_seconds",
                         "Unix time of the last accepted result (or of start-up)")),
      eta_(LazyGauge("namm_run_eta_seconds", "Time left at this process's pace so far")),
      generations_completed_(Counter("namm_generations_completed_total", "Generations committed by this process")),
      generation_seconds_(Histogram("namm_generation_duration_seconds",
                                    "Wall time of a generation's phase, first lease to last result",
                                    kGenerationBuckets)),
      fitness_best_(LazyGauge("namm_population_fitness_best", "Best normalized fitness of the last generation")),
      fitness_mean_(LazyGauge("namm_population_fitness_mean", "Mean normalized fitness of the last generation")),
      fitness_std_(LazyGauge("namm_population_fitness_std", "Standard deviation of the last generation's fitness")),
      population_cache_(LazyGauge("namm_population_cache_size_tokens",
                              "Mean KV-cache size (tokens per layer) over the last generation's prompts")),
      eval_fitness_(LazyGauge("namm_eval_fitness", "Normalized fitness of the mean at its last evaluation")),
      eval_cache_mean_(LazyGauge("namm_eval_cache_size_mean_tokens",
                             "Mean KV-cache size over the evaluated mean's prompts")),
      eval_cache_final_(LazyGauge("namm_eval_cache_size_final_tokens",
                              "Final KV-cache size (after the last eviction) over the evaluated mean's prompts")),
      eval_task_score_(BuildGauge()
                           .Name("namm_eval_task_score")
                           .Help("Raw task score of the mean at its last evaluation, in [0, 1]")
                           .Labels(run_label_)
                           .Register(registry_)),
      eval_task_normalized_(BuildGauge()
                                .Name("namm_eval_task_normalized_score")
                                .Help("Task score of the mean divided by the base model's on the same prompts")
                                .Labels(run_label_)
                                .Register(registry_)),
      sigma_(LazyGauge("namm_cmaes_sigma", "CMA-ES step size the last generation's population was sampled with")),
      eigen_min_(LazyGauge("namm_cmaes_eigenvalue_min", "Smallest eigenvalue of the covariance matrix")),
      eigen_max_(LazyGauge("namm_cmaes_eigenvalue_max", "Largest eigenvalue of the covariance matrix")),
      units_leased_(Counter("namm_units_leased_total", "Prompts handed out in leases, straggler copies included")),
      units_completed_(Counter("namm_units_completed_total", "Units that got their first result")),
      units_late_(Counter("namm_units_late_total", "First results that came on expired or returned leases")),
      units_duplicate_(Counter("namm_units_duplicate_results_total",
                               "Results for units that already had one (ignored)")),
      units_failed_(Counter("namm_units_failed_total", "Prompts workers reported as failed")),
      units_lost_(Counter("namm_units_lost_total",
                          "Prompts back in the queue from expired leases and vanished workers (no attempt used)")),
      units_dropped_(Counter("namm_units_dropped_total",
                             "Units taken out of their generation with a prompt that failed on too many workers")),
      leases_issued_(Counter("namm_leases_issued_total", "Leases handed out")),
      leases_duplicated_(Counter("namm_leases_duplicated_total", "Straggler copies among the leases handed out")),
      leases_expired_(Counter("namm_leases_expired_total", "Leases whose deadline passed without a heartbeat")),
      leases_returned_(Counter("namm_leases_returned_total",
                               "Leases given back by draining or disconnected workers")),
      leases_reattached_(Counter("namm_leases_reattached_total",
                                 "Leases kept for a worker that registered again after its connection broke")),
      leases_reserved_(Counter("namm_leases_reserved_total",
                               "Leases of a previous coordinator kept for their workers after a restart")),
      results_refused_(Counter("namm_results_refused_total",
                               "Results and failures in worker reports that the coordinator did not take (a prompt "
                               "the lease does not hold, a lease the worker does not hold); the rest was taken")),
      progress_log_errors_(Counter("namm_progress_log_errors_total",
                                   "Appends to the run's progress log that failed (retried with the next one; the "
                                   "reports they held were refused and are sent again)")),
      progress_log_failing_(Gauge("namm_progress_log_failing",
                                  "1 while the progress log's last append failed: no report is acknowledged")),
      rejected_(BuildCounter()
                    .Name("namm_requests_rejected_total")
                    .Help("Worker calls refused, by gRPC status code")
                    .Labels(run_label_)
                    .Register(registry_)),
      phase_units_(Gauge("namm_phase_units", "Units of the phase in progress")),
      phase_units_done_(Gauge("namm_phase_units_done", "Units of the phase in progress with a result")),
      queue_units_(Gauge("namm_queue_units", "Units waiting for a lease")),
      leases_active_(Gauge("namm_leases_active", "Leases being worked on")),
      workers_(BuildGauge()
                   .Name("namm_workers")
                   .Help("Registered workers by state: connected, draining, quarantined")
                   .Labels(run_label_)
                   .Register(registry_)),
      references_outstanding_(Gauge("namm_reference_units_outstanding",
                                    "Base-model reference-score units of the phase without a result")),
      tell_seconds_(Histogram("namm_tell_duration_seconds", "CMA-ES tell()", kTellBuckets)),
      db_write_seconds_(BuildHistogram()
                            .Name("namm_db_write_duration_seconds")
                            .Help("SQLite transactions: results (a tick's results), generation (a generation's "
                                  "commit with its checkpoint, and the next plan)")
                            .Labels(run_label_)
                            .Register(registry_)) {
  BuildGauge()
      .Name("namm_run_info")
      .Help("The run this coordinator serves")
      .Register(registry_)
      .Add({{"run", spec.name}, {"model_fingerprint", spec.model.fingerprint}, {"version", namm_version()}})
      .Set(1);
  generations_.Set(static_cast<double>(spec.total_generations()));
  for (const char* state : {"connected", "draining", "quarantined"}) workers_.Add({{"state", state}});
  // The codes the service refuses with, at zero, so that rate() has a series from the start.
  for (const char* code : {"UNAUTHENTICATED", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND"}) {
    rejected_.Add({{"code", code}});
  }
  SetNow(last_result_);
}

void CoordinatorMetrics::SetNow(prometheus::Gauge& gauge) {
  gauge.Set(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
}

void CoordinatorMetrics::Advance(prometheus::Counter& counter, int64_t total, int64_t& last) {
  if (total > last) counter.Increment(static_cast<double>(total - last));
  last = total;
}

void CoordinatorMetrics::SetPosition(int64_t stage, int64_t generation, bool finished) {
  stage_.Set(static_cast<double>(stage));
  generation_.Set(static_cast<double>(generation));
  finished_.Set(finished ? 1 : 0);
  if (finished) eta_.Add({}).Set(0);
}

void CoordinatorMetrics::PhaseStarted(int64_t units) {
  phase_units_.Set(static_cast<double>(units));
  phase_units_done_.Set(0);
}

void CoordinatorMetrics::Observe(const ServiceCounters& c, int64_t references_outstanding) {
  const SchedulerCounters& s = c.scheduler;
  Advance(units_leased_, s.units_leased, last_.units_leased);
  Advance(units_completed_, s.results_accepted, last_.results_accepted);
  Advance(units_late_, s.results_late, last_.results_late);
  Advance(units_duplicate_, s.results_duplicate, last_.results_duplicate);
  Advance(units_failed_, s.prompts_failed, last_.prompts_failed);
  Advance(units_lost_, s.units_lost, last_.units_lost);
  Advance(units_dropped_, s.units_dropped, last_.units_dropped);
  Advance(leases_issued_, s.leases_issued, last_.leases_issued);
  Advance(leases_duplicated_, s.leases_duplicated, last_.leases_duplicated);
  Advance(leases_expired_, s.leases_expired, last_.leases_expired);
  Advance(leases_returned_, s.leases_returned, last_.leases_returned);
  Advance(leases_reattached_, s.leases_reattached, last_.leases_reattached);
  Advance(leases_reserved_, s.leases_reserved, last_.leases_reserved);
  Advance(results_refused_, c.results_refused, last_results_refused_);
  Advance(progress_log_errors_, c.journal_failures, last_progress_log_errors_);
  progress_log_failing_.Set(c.journal_failing ? 1 : 0);
  for (const auto& [code, n] : c.refused_by_code) Advance(rejected_.Add({{"code", code}}), n, last_rejected_[code]);
  phase_units_.Set(static_cast<double>(c.units_total));
  phase_units_done_.Set(static_cast<double>(c.units_done));
  queue_units_.Set(static_cast<double>(c.units_queued));
  leases_active_.Set(static_cast<double>(c.leases_active));
  workers_.Add({{"state", "connected"}}).Set(static_cast<double>(c.workers - c.workers_draining - c.workers_quarantined));
  workers_.Add({{"state", "draining"}}).Set(static_cast<double>(c.workers_draining));
  workers_.Add({{"state", "quarantined"}}).Set(static_cast<double>(c.workers_quarantined));
  references_outstanding_.Set(static_cast<double>(references_outstanding));
}

void CoordinatorMetrics::ResultsStored(int64_t results, double seconds) {
  db_write_seconds_.Add({{"operation", "results"}}, kDbBuckets).Observe(seconds);
  if (results > 0) SetNow(last_result_);
}

void CoordinatorMetrics::GenerationCommitted(const AdvanceSummary& summary, double phase_seconds,
                                             double eta_seconds) {
  ShowGeneration(summary.record, summary.metrics);
  generations_completed_.Increment();
  generation_seconds_.Observe(std::max(0.0, phase_seconds));  // a resumed phase may be done before it starts
  tell_seconds_.Observe(summary.record.tell_seconds);
  db_write_seconds_.Add({{"operation", "generation"}}, kDbBuckets).Observe(summary.commit_seconds);
  eta_.Add({}).Set(eta_seconds);
}

void CoordinatorMetrics::ShowGeneration(const GenerationRecord& r, const std::map<std::string, double>& metrics) {
  fitness_best_.Add({}).Set(r.fitness_best);
  fitness_mean_.Add({}).Set(r.fitness_mean);
  fitness_std_.Add({}).Set(r.fitness_std);
  population_cache_.Add({}).Set(Or(metrics, "cache_size_mean"));
  if (r.eval_fitness) {
    eval_fitness_.Add({}).Set(*r.eval_fitness);
    eval_cache_mean_.Add({}).Set(Or(metrics, "eval_cache_size_mean"));
    eval_cache_final_.Add({}).Set(Or(metrics, "eval_cache_size_final"));
    for (const auto& [task, score] : r.eval_tasks) {
      eval_task_score_.Add({{"task", task}}).Set(score.raw);
      eval_task_normalized_.Add({{"task", task}}).Set(score.normalized);
    }
  }
  sigma_.Add({}).Set(Or(metrics, "sigma"));
  eigen_min_.Add({}).Set(r.eigen_min);
  eigen_max_.Add({}).Set(r.eigen_max);
}

}  // namespace namm::coordinator
