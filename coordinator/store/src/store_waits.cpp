#include "namm/coordinator/store_waits.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <spdlog/spdlog.h>

#include <algorithm>

namespace namm::coordinator {

namespace {

// When a wait still going on is warned of: 10 s, a minute, then every 5 minutes.
bool WarnNow(double seconds, double warned_at) {
  if (warned_at < 10) return seconds >= 10;
  if (warned_at < 60) return seconds >= 60;
  return seconds >= warned_at + 300;
}

}  // namespace

struct StoreWaits::Metrics {
  prometheus::Counter& waits;
  prometheus::Counter& retries;
  prometheus::Histogram& seconds;
  prometheus::Gauge& waiting;
  prometheus::Gauge& longest;
};

StoreWaits::StoreWaits() = default;
StoreWaits::~StoreWaits() = default;

std::function<void(const StoreWait&)> StoreWaits::Observer() {
  return [this](const StoreWait& w) { Record(w); };
}

void StoreWaits::Attach(prometheus::Registry& registry, const std::string& run) {
  const std::map<std::string, std::string> labels{{"run", run}};
  auto metrics = std::unique_ptr<Metrics>(new Metrics{
      prometheus::BuildCounter()
          .Name("namm_store_waits_total")
          .Help("Waits for the run's database that ended: calls that met a transient error (a lock held "
                "elsewhere) and were retried until they went through (or failed for good)")
          .Labels(labels)
          .Register(registry)
          .Add({}),
      prometheus::BuildCounter()
          .Name("namm_store_retries_total")
          .Help("Attempts at a database call that failed with a transient error and were retried")
          .Labels(labels)
          .Register(registry)
          .Add({}),
      prometheus::BuildHistogram()
          .Name("namm_store_wait_seconds")
          .Help("Duration of each wait for the database, first failed attempt to success")
          .Labels(labels)
          .Register(registry)
          .Add({}, prometheus::Histogram::BucketBoundaries{0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800}),
      prometheus::BuildGauge()
          .Name("namm_store_waiting_seconds")
          .Help("How long the longest wait for the database going on now has lasted (0: none)")
          .Labels(labels)
          .Register(registry)
          .Add({}),
      prometheus::BuildGauge()
          .Name("namm_store_wait_longest_seconds")
          .Help("The longest wait for the database this process has seen")
          .Labels(labels)
          .Register(registry)
          .Add({})});
  std::lock_guard<std::mutex> lock(mu_);
  metrics->longest.Set(totals_.longest_seconds);
  metrics_ = std::move(metrics);
}

void StoreWaits::Detach() {
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.reset();
}

StoreWaits::Totals StoreWaits::totals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return totals_;
}

void StoreWaits::Record(const StoreWait& w) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::thread::id self = std::this_thread::get_id();
  if (!w.ended) {
    ++totals_.retries;
    Ongoing& o = ongoing_[self];
    o.seconds = w.seconds;
    if (WarnNow(w.seconds, o.warned_at)) {
      o.warned_at = w.seconds;
      // A lock (BUSY, LOCKED, PROTOCOL) is another connection's or a slow disk's; an I/O error, a full disk or a
      // file that cannot be opened is the disk's or the process's (retried up to --io-error-patience).
      const bool lock_wait = w.error.find("SQLITE_BUSY") != std::string::npos ||
                             w.error.find("SQLITE_LOCKED") != std::string::npos ||
                             w.error.find("SQLITE_PROTOCOL") != std::string::npos;
      spdlog::warn("still waiting for the database after {:.0f} s ({}: {}; {} attempts): {}; retrying", w.seconds,
                   w.what, w.error, w.retries,
                   lock_wait ? "another connection or process holds its lock, or the disk is slow"
                             : "the disk fails (full, an I/O error) or the process cannot open more files");
    }
  } else {
    ongoing_.erase(self);
    ++totals_.waits;
    totals_.longest_seconds = std::max(totals_.longest_seconds, w.seconds);
    const char* outcome = w.succeeded ? "" : ", then the call failed";
    if (w.seconds >= 1 || !w.succeeded) {
      spdlog::warn("waited {:.1f} s for the database ({}: {}; {} retries{})", w.seconds, w.what, w.error, w.retries,
                   outcome);
    } else {
      spdlog::info("waited {:.3f} s for the database ({}: {}; {} retries)", w.seconds, w.what, w.error, w.retries);
    }
  }
  if (!metrics_) return;
  double waiting = 0;
  for (const auto& [thread, o] : ongoing_) waiting = std::max(waiting, o.seconds);
  metrics_->waiting.Set(waiting);
  if (w.ended) {
    metrics_->waits.Increment();
    metrics_->seconds.Observe(w.seconds);
    metrics_->longest.Set(totals_.longest_seconds);
  } else {
    metrics_->retries.Increment();
  }
}

}  // namespace namm::coordinator
