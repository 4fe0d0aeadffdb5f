// Serving a run to workers over gRPC (proto/namm/v1/coordinator.proto): the loop that turns the trainer's plans
// into leases and the workers' results into stored evaluations, generation after generation.
//
// The loop runs on Boost.Asio on the caller's thread: a timer expires leases, stores the results collected
// (they are in the progress log as they arrive; the store takes them every store_interval), and
// advances the trainer once every unit of the phase has a result; SIGTERM and SIGINT store what has arrived
// and stop cleanly. Missing base-model reference scores are computed by the workers as units of the same phase
// (full cache) and stored before the phase's tell(). Everything the run needs to continue is in the store,
// so a restart (even after SIGKILL) re-plans the interrupted generation and leases only its missing units.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "namm/coordinator/lease_scheduler.h"
#include "namm/coordinator/progress_log.h"
#include "namm/coordinator/prompt_costs.h"
#include "namm/coordinator/store.h"
#include "namm/coordinator/store_waits.h"
#include "namm/coordinator/trainer.h"
#include "namm/status.h"

namespace namm::coordinator {

// PEM files for TLS. cert + key: serve TLS; client_ca as well: require and verify client certificates.
struct ServerTls {
  std::string cert, key, client_ca;
};

// What the loop reports when a phase ends.
struct PhaseProgress {
  int64_t generation = 0;
  bool statistics = false;    // the phase collected normalization statistics (no tell)
  int64_t units = 0;          // leased in this phase by this process
  std::chrono::steady_clock::time_point started, finished;  // the phase's start and its last result
  double seconds = 0;         // finished - started
  std::optional<GenerationRecord> record;  // the committed generation (not for the statistics phase)
  std::string line;           // generation, best / mean +- std fitness, sigma, cache size, units/s, ETA
};

struct ServeOptions {
  std::string listen = "127.0.0.1:50051";  // HOST:PORT; port 0 picks a free one (see RunServer::port)
  std::string token;                       // the shared secret workers must present; required
  ServerTls tls;
  SchedulerOptions scheduler;
  int heartbeat_interval_ms = 2000;
  int max_message_bytes = 4 << 20;         // largest message accepted from a worker
  int max_streams_per_peer = 256;          // lease streams one address may hold open (0: no limit)
  int max_auth_failures_per_peer = 20;     // within a minute, then refused for a minute (0: no limit)
  // A prompt that fails on scheduler.max_attempts workers is dropped from its generation for every candidate;
  // when more than this share of the run's prompts so far were dropped, the run stops instead.
  double max_dropped_share = 0.05;
  std::string metrics_listen;              // HOST:PORT of the Prometheus /metrics endpoint; "" = none
  // After the run finished, keep serving (metrics with namm_run_finished 1; workers are told the run is over)
  // this long, or until SIGTERM / Stop(): Prometheus sees the end, and supervisors see a live process.
  std::chrono::duration<double> linger{0};
  std::chrono::milliseconds tick{50};
  // Accepted results go to the progress log at once (a restart loses none) and to the store in one transaction
  // this often (and when the phase ends): longer writes less, shorter shows them sooner in the database.
  std::chrono::milliseconds store_interval{2000};
  bool handle_signals = true;              // SIGTERM / SIGINT stop the loop cleanly
  // Where the store reports its waits (the caller opened it with store_waits->Observer()): counted on the
  // metrics endpoint while the server is up. Optional; outlives the server.
  StoreWaits* store_waits = nullptr;
  // Called on the loop's thread after every phase.
  std::function<void(const PhaseProgress&)> progress;
};

struct ServeOutcome {
  bool finished = false;     // the schedule is done
  bool interrupted = false;  // stopped by a signal or Stop()
  int64_t next_generation = 0;
};

// Whether a run of `spec` can be served: its model fingerprint must be what workers present (`namm-worker
// fingerprint`: sha256:<64 hex>). Checked before a run is created, so that a placeholder never reaches the store.
Status check_serveable(const RunSpec& spec);

class RunServer {
 public:
  // Binds the listening address and starts gRPC's threads; nothing is leased before Run(). `log`: the run's
  // progress log (ProgressLog::Open(progress_log_path(store.path(), trainer.run_id()))), opened before the trainer
  // and closed after it, so that its lock keeps a second coordinator of the run away from the store while this
  // one's trainer (background work included) uses it.
  static Result<std::unique_ptr<RunServer>> Start(Store& store, Trainer& trainer, ProgressLog& log,
                                                  PromptCosts costs, ServeOptions options);
  ~RunServer();
  RunServer(const RunServer&) = delete;
  RunServer& operator=(const RunServer&) = delete;

  int port() const;
  // http://HOST:PORT/metrics, or "" without a metrics endpoint.
  std::string metrics_url() const;
  // Serves until the run finishes or a signal / Stop() arrives.
  Result<ServeOutcome> Run();
  // Thread-safe: ends Run() as SIGTERM would.
  void Stop();

 private:
  struct Impl;
  explicit RunServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace namm::coordinator
