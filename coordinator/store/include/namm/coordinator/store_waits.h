// What a coordinator does with its waits for the database (StoreOptions::on_wait, from any thread): each wait
// is logged once, when it ends, with its duration and its cause (a warning from a second on; a wait still going
// on is also warned of after 10 s, a minute, then every 5 minutes), and counted for Prometheus
// (docs/observability.md, "Store"): namm_store_waits_total, namm_store_retries_total, namm_store_wait_seconds
// (a histogram of their durations), namm_store_waiting_seconds (the longest wait going on now, 0 when none) and
// namm_store_wait_longest_seconds.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "namm/coordinator/store.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace namm::coordinator {

class StoreWaits {
 public:
  StoreWaits();
  ~StoreWaits();
  StoreWaits(const StoreWaits&) = delete;
  StoreWaits& operator=(const StoreWaits&) = delete;

  // For StoreOptions::on_wait: this object must outlive every store opened with it.
  std::function<void(const StoreWait&)> Observer();
  void Record(const StoreWait& wait);

  // Counts into metric families of `registry` (label run = `run`) until Detach() (the registry may go first).
  void Attach(prometheus::Registry& registry, const std::string& run);
  void Detach();

  struct Totals {
    int64_t waits = 0, retries = 0;
    double longest_seconds = 0;
  };
  Totals totals() const;

 private:
  struct Metrics;
  mutable std::mutex mu_;
  Totals totals_;
  // Per waiting thread: the wait's seconds so far, and when it was last warned of (one wait per thread at once).
  struct Ongoing {
    double seconds = 0, warned_at = 0;
  };
  std::map<std::thread::id, Ongoing> ongoing_;
  std::unique_ptr<Metrics> metrics_;
};

}  // namespace namm::coordinator
