// The gRPC face of a run (proto/namm/v1/coordinator.proto): registers workers, pushes leases over their
// streams, validates and collects results. It knows nothing of the optimizer or the store: the run loop
// (run_server.cpp) starts phases and harvests results; handlers run on gRPC's threads, the loop on its own, and
// everything shared sits behind one mutex. Lease streams use gRPC's callback API: whatever gives a worker work
// sends it from the thread that made it (no thread waits per stream; at 1,024 workers those threads' wake-ups
// were a third of the coordinator's CPU).
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_metadata_processor.h>

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "namm/auth_lockout.h"
#include "namm/coordinator/lease_scheduler.h"
#include "namm/coordinator/store.h"
#include "namm/v1/coordinator.grpc.pb.h"
#include "namm/coordinator/progress_log.h"

namespace namm::coordinator {

// What workers need to know about the run.
struct ServiceConfig {
  std::string token;  // the shared secret ("x-namm-token" metadata); never empty
  std::string run_name;
  std::string model_fingerprint;
  std::string architecture_json;
  int64_t param_count = 0;
  std::string rope_scaling;
  int heartbeat_interval_ms = 2000;
  // Per peer address: lease streams open at once (0: no limit), and authentication failures within a minute
  // before its calls without the right secret are refused for a minute (0: no limit; AuthLockout).
  int max_streams_per_peer = 256;
  int max_auth_failures_per_peer = 20;
};

// The work of one phase as workers see it.
struct PhaseData {
  int64_t generation = 0;
  bool collect_norm_stats = false;
  std::optional<NormStats> norm_stats;
  std::map<int64_t, std::vector<float>> params;  // candidate (or kMeanCandidate) -> flat parameters
};

struct ServiceCounters {
  SchedulerCounters scheduler;
  int64_t workers = 0;             // registered now
  int64_t workers_draining = 0, workers_quarantined = 0;  // among them
  int64_t refused = 0;             // calls refused (authentication, validation, fingerprint)
  int64_t results_refused = 0;     // results and failures of reports that the coordinator did not take
  int64_t journal_failures = 0;    // appends to the progress log that failed (retried: never a stop)
  bool journal_failing = false;    // the last append failed
  std::map<std::string, int64_t> refused_by_code;  // gRPC status code name -> calls
  int64_t units_total = 0, units_done = 0, units_queued = 0, leases_active = 0;
  std::vector<AbandonedUnit> abandoned;  // prompts that failed on too many workers: the run drops them
};

// What the service calls back into the run loop. Called on gRPC threads with the service's lock held: they must
// be quick (hand off, or append to the progress log).
struct ServiceHooks {
  // The result that completes the phase arrived.
  std::function<void()> phase_done;
  // Leases handed out (before they are sent) and ended, results accepted (before their report is answered): to
  // the progress log, so that a restarted coordinator loses nothing. Empty: nothing survives a restart.
  std::function<Status(const ProgressEntries&)> log;
};

class WorkerService final : public v1::Coordinator::WithCallbackMethod_Leases<v1::Coordinator::Service> {
 public:
  WorkerService(ServiceConfig config, SchedulerOptions scheduler, ServiceHooks hooks);

  // Run loop side.
  void StartPhase(std::shared_ptr<const PhaseData> phase, const std::vector<ScheduledUnit>& units);
  // Results accepted since the last call (already in the progress log), for the store.
  void TakeResults(std::vector<EvaluationRecord>* evaluations, std::vector<ReferenceResult>* references);
  bool PhaseDone() const;
  // When the phase's last result arrived (its start if it had no units).
  std::chrono::steady_clock::time_point PhaseDoneAt() const;
  // Keeps the leases a previous coordinator handed out in this phase for their holders (one lease timeout);
  // returns how many were still open.
  int64_t ReserveLeases(const std::vector<LeaseRecord>& leases);
  // Takes every unit of (task, prompt) out of the phase (LeaseScheduler::Drop) and tells their holders.
  void DropPrompt(const std::string& task, int64_t prompt);
  // Expires leases past their deadline and sessions that registered but never opened their stream, and
  // removes the leases that ended from the journal.
  void ExpireLeases();
  // Every stream ends with `end`; from now on registrations and reports are refused (UNAVAILABLE).
  void End(v1::WorkBatch::End end);
  ServiceCounters counters() const;
  // The secret (and the lockout) checked on each call's metadata before its body is read, for a TLS server's
  // credentials (SetAuthMetadataProcessor); holds this service, which must outlive the server.
  std::shared_ptr<grpc::AuthMetadataProcessor> SecretCheckBeforeBody();
  // The verdict on a presented secret (nullptr: none) from `peer` (an address without its port; "TLS peers"
  // before a TLS call's body, where gRPC gives no address): OK, or the
  // refusal, counted and logged; a peer with too many recent failures is refused at once without it. Thread-safe.
  grpc::Status CheckSecret(const grpc::string_ref* presented, const std::string& peer);

  // gRPC handlers.
  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::ServerWriteReactor<v1::WorkBatch>* Leases(grpc::CallbackServerContext* context,
                                                  const v1::LeasesRequest* request) override;
  grpc::Status Report(grpc::ServerContext* context, const v1::ReportRequest* request,
                      v1::ReportResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                     v1::DrainResponse* response) override;

 private:
  class LeaseStream;
  struct Session {
    std::string name;
    std::chrono::steady_clock::time_point registered;
    std::set<std::pair<int64_t, int64_t>> params_sent;  // (generation, candidate)
    bool streaming = false;
    LeaseStream* stream = nullptr;  // while streaming
  };

  // CheckSecret on the call's "x-namm-token" metadata and address.
  grpc::Status Authenticate(const grpc::ServerContextBase& context);
  // What a report holds, prompt by prompt (mu_ held): accepted results (new ones, for the progress log), results
  // to record (new or duplicate: prompt and seconds), failures to record, results of a lease of an ended phase,
  // and what is refused with the reason. Changes nothing.
  struct Triage {
    ProgressEntries accepted;
    std::vector<std::pair<int64_t, double>> complete;
    std::vector<const v1::PromptFailure*> failures;
    int64_t stale = 0;
    std::vector<std::pair<int64_t, std::string>> refused;
    std::string task;  // of the lease
  };
  Triage TriageReport(const v1::ReportRequest& request, const std::string& worker_name) const;
  // Counts and logs a refused call; needs no lock.
  grpc::Status Refuse(grpc::StatusCode code, const std::string& message);
  // The session of `worker_id` (mu_ held), or NOT_FOUND. With `departed`, also a session whose stream ended
  // in this phase (its worker may still report the leases it held).
  grpc::Status FindSession(const std::string& worker_id, std::shared_ptr<Session>* session, bool departed = false);
  // Why the worker's stream ends now, if it does (mu_ held).
  std::optional<v1::WorkBatch::End> StreamEnd(const std::string& worker_id) const;
  // Fills `batch` with cancellations and as many leases as the worker has free slots (mu_ held).
  void FillBatch(const std::string& worker_id, Session& session, v1::WorkBatch* batch);
  // Appends to the progress log, after what earlier failures left behind (mu_ held); false when it cannot. A
  // failure is counted and logged (at most every 10 s), never a stop: the disk may come back. Lease records that
  // could not be written wait for the next append that can; results are the caller's to refuse.
  bool Log(const ProgressEntries& entries);
  // Lease records (issued, ended) of the appends that failed, oldest first.
  ProgressEntries unjournaled_leases_;
  // Every lease stream looks for work again (mu_ held).
  void WakeAll();
  // One worker's lease stream looks again (mu_ held).
  void Wake(const std::string& worker_id);
  // A lease stream ended: its worker is gone or done, and what it holds goes back to the queue (mu_ held).
  void StreamEnded(const std::string& worker_id, const std::shared_ptr<Session>& session);

  const ServiceConfig config_;
  const ServiceHooks hooks_;
  mutable std::mutex mu_;
  std::chrono::steady_clock::time_point phase_done_at_;
  LeaseScheduler scheduler_;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  std::map<std::string, std::shared_ptr<Session>> departed_;  // streams ended in this phase
  std::shared_ptr<const PhaseData> phase_;
  std::optional<v1::WorkBatch::End> end_;
  std::chrono::steady_clock::time_point last_wake_all_;  // ExpireLeases' once-a-second look at every stream
  int64_t journal_failures_ = 0;  // failed appends to the progress log
  int64_t journal_failing_since_ = 0;  // failures since the last append that went through (0: it works)
  std::chrono::steady_clock::time_point journal_warned_;  // the last failure logged
  bool journal_failure_logged_ = false;  // this run of failures was logged: so is its end
  std::vector<EvaluationRecord> evaluations_;  // accepted, not yet taken for the store
  std::vector<ReferenceResult> references_;
  AuthLockout lockout_;
  std::mutex peers_mu_;
  std::map<std::string, int> streams_by_peer_;  // open lease streams by address (without the port); none: absent
  // Releases one of `peer`'s streams (peers_mu_ held).
  void ReleaseStream(const std::string& peer);
  std::atomic<int64_t> refused_{0};
  int64_t results_refused_ = 0;  // prompts of reports not taken (mu_)
  std::array<std::atomic<int64_t>, 17> refused_by_code_{};  // by grpc::StatusCode (0..16)
};

}  // namespace namm::coordinator
