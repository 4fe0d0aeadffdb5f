#include "worker_service.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

#include "message_checks.h"
#include "namm/file_util.h"
#include "namm/v1/norm_stats_proto.h"
#include "namm/v1/protocol.h"

namespace namm::coordinator {

namespace {

using grpc::StatusCode;
using Clock = LeaseScheduler::Clock;

std::string NewWorkerId() { return "w-" + random_hex(24); }

// "ipv4:10.0.0.7:53412" -> "ipv4:10.0.0.7": the peer's address without its port.
std::string PeerAddress(const grpc::ServerContextBase& context) {
  const std::string peer = context.peer();
  const std::size_t colon = peer.rfind(':');
  return colon == std::string::npos || colon < peer.find(':') + 1 ? peer : peer.substr(0, colon);
}

// The names Prometheus labels and gRPC's documentation use.
std::string StatusCodeName(StatusCode code) {
  static const char* const kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                       "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                                       "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const auto i = static_cast<std::size_t>(code);
  return i < std::size(kNames) ? kNames[i] : "UNKNOWN";
}

}  // namespace

namespace {
AuthLockout::Options LockoutOptions(const ServiceConfig& config) {
  AuthLockout::Options o;
  o.max_failures = config.max_auth_failures_per_peer;
  return o;
}
}  // namespace

WorkerService::WorkerService(ServiceConfig config, SchedulerOptions scheduler, ServiceHooks hooks)
    : config_(std::move(config)), hooks_(std::move(hooks)), scheduler_(scheduler), lockout_(LockoutOptions(config_)) {}

bool WorkerService::Log(const ProgressEntries& entries) {
  if (!hooks_.log || (entries.empty() && unjournaled_leases_.empty())) return true;
  // Leases first, in the order they were handed out and ended: a lease's end never precedes its issue.
  ProgressEntries all = unjournaled_leases_;
  all.leases_issued.insert(all.leases_issued.end(), entries.leases_issued.begin(), entries.leases_issued.end());
  all.leases_ended.insert(all.leases_ended.end(), entries.leases_ended.begin(), entries.leases_ended.end());
  all.evaluations = entries.evaluations;
  all.references = entries.references;
  if (const Status s = hooks_.log(all); !s.ok()) {
    ++journal_failures_;
    ++journal_failing_since_;
    // Lease records wait: without them a restarted coordinator only leases those prompts again (duplicate work),
    // while results must be refused, for their worker to keep them and send them again.
    unjournaled_leases_.leases_issued = std::move(all.leases_issued);
    unjournaled_leases_.leases_ended = std::move(all.leases_ended);
    const auto now = Clock::now();
    if (now - journal_warned_ >= std::chrono::seconds(10)) {  // a disk failing in bursts: a line per 10 s
      journal_warned_ = now;
      journal_failure_logged_ = true;
      spdlog::error("progress log: {} ({} failed appends in a row; reports are refused and sent again by their "
                    "workers, and {} lease records wait, until an append goes through)",
                    s.ToString(), journal_failing_since_,
                    unjournaled_leases_.leases_issued.size() + unjournaled_leases_.leases_ended.size());
    }
    return false;
  }
  if (journal_failing_since_ > 0 && journal_failure_logged_) {
    spdlog::info("progress log: appends go through again after {} failed", journal_failing_since_);
  }
  journal_failing_since_ = 0;
  journal_failure_logged_ = false;
  unjournaled_leases_ = ProgressEntries();
  return true;
}

int64_t WorkerService::ReserveLeases(const std::vector<LeaseRecord>& leases) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t reserved = 0;
  for (const LeaseRecord& l : leases) {
    const HeldLease held{l.id, l.reference ? UnitKind::kReference : UnitKind::kCandidate, l.candidate, l.task,
                         l.prompts};
    if (scheduler_.Reserve(l.worker, held, Clock::now())) ++reserved;
  }
  return reserved;
}

grpc::Status WorkerService::Refuse(StatusCode code, const std::string& message) {
  ++refused_;
  ++refused_by_code_[static_cast<std::size_t>(code) % refused_by_code_.size()];
  spdlog::warn("refused a worker call: {}", message);
  return {code, message};
}

grpc::Status WorkerService::Authenticate(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("x-namm-token");
  return CheckSecret(it == metadata.end() ? nullptr : &it->second, PeerAddress(context));
}

grpc::Status WorkerService::CheckSecret(const grpc::string_ref* presented, const std::string& peer) {
  std::string failure;
  if (presented == nullptr) {
    failure = "no x-namm-token metadata: workers must present the run's shared secret";
  } else if (!SameSecret(std::string(presented->data(), presented->size()), config_.token)) {
    failure = "wrong shared secret (x-namm-token)";
  }
  if (failure.empty()) return grpc::Status::OK;  // whatever others at its address did
  const AuthLockout::Verdict v = lockout_.Failed(peer, failure, Clock::now());
  if (!v.warning.empty()) spdlog::warn("{}", v.warning);
  const StatusCode code = v.locked_out ? StatusCode::RESOURCE_EXHAUSTED : StatusCode::UNAUTHENTICATED;
  ++refused_;
  ++refused_by_code_[static_cast<std::size_t>(code) % refused_by_code_.size()];
  if (v.locked_out) {
    return {code, "too many authentication failures from " + peer + ": calls without the right secret are refused "
                  "for a minute (" + failure + ")"};
  }
  return {code, failure};
}

namespace {

// Objects handed to gRPC (a processor, reactors returned from a handler or with a write) are called back on its
// threads. Debian's libgrpc is not built with ThreadSanitizer, so the hand-over it makes is invisible to a
// `make tsan` build, which would report the callback's first read of the object as a race with its construction
// (or its destruction, after gRPC let go of it, with the last callback's reads); these declare it (no-ops in
// other builds).
#if defined(__SANITIZE_THREAD__)
void HandedToGrpc(void* object) { __tsan_release(object); }
void CalledBackByGrpc(void* object) { __tsan_acquire(object); }
#else
void HandedToGrpc(void*) {}
void CalledBackByGrpc(void*) {}
#endif

// The secret checked on a call's metadata, before gRPC reads its body: a peer without it then costs the
// coordinator no message (up to --max-message-bytes) buffered and parsed. gRPC runs such processors on secure
// connections only; in plaintext the handlers' check (the same verdict) is all there is.
class SecretBeforeBody final : public grpc::AuthMetadataProcessor {
 public:
  explicit SecretBeforeBody(WorkerService& service) : service_(service) { HandedToGrpc(this); }
  ~SecretBeforeBody() override { CalledBackByGrpc(this); }
  bool IsBlocking() const override { return false; }  // a comparison and a lock: no thread hop needed
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext*, OutputMetadata*,
                       OutputMetadata*) override {
    CalledBackByGrpc(this);
    const auto it = metadata.find("x-namm-token");
    // gRPC tells a processor the peer's certificate, not its address: one lockout for all TLS peers, which only
    // ever refuses calls without the right secret (a worker that has it is never locked out).
    grpc::Status verdict = service_.CheckSecret(it == metadata.end() ? nullptr : &it->second, "TLS peers");
    HandedToGrpc(this);
    return verdict;
  }

 private:
  WorkerService& service_;
};

}  // namespace

std::shared_ptr<grpc::AuthMetadataProcessor> WorkerService::SecretCheckBeforeBody() {
  return std::make_shared<SecretBeforeBody>(*this);
}

void WorkerService::ReleaseStream(const std::string& peer) {
  const auto it = streams_by_peer_.find(peer);
  if (it != streams_by_peer_.end() && --it->second <= 0) streams_by_peer_.erase(it);
}

grpc::Status WorkerService::FindSession(const std::string& worker_id, std::shared_ptr<Session>* session,
                                        bool departed) {
  if (const auto it = sessions_.find(worker_id); it != sessions_.end()) {
    *session = it->second;
    return grpc::Status::OK;
  }
  if (const auto it = departed_.find(worker_id); departed && it != departed_.end()) {
    *session = it->second;
    return grpc::Status::OK;
  }
  return Refuse(StatusCode::NOT_FOUND, "unknown worker id '" + worker_id + "' (coordinator restarted or the "
                                       "session ended): register again");
}

// One worker's lease stream. Every method but the reactions runs with the service's mutex held; the reactions
// (OnWriteDone, OnCancel, OnDone) take it. gRPC never runs a write's reaction inside StartWrite (its callback is
// not inlineable), so writing under the mutex cannot deadlock.
class WorkerService::LeaseStream final : public grpc::ServerWriteReactor<v1::WorkBatch> {
 public:
  LeaseStream(WorkerService& service, std::string worker_id, std::string peer, std::shared_ptr<Session> session)
      : service_(service), id_(std::move(worker_id)), peer_(std::move(peer)), session_(std::move(session)) {
    HandedToGrpc(this);
  }

  // Sends what the worker should have now (cancellations, leases for its free slots), or ends the stream.
  void Pump() {
    if (finished_ || writing_) return;
    if (cancelled_) return Close(grpc::Status::OK);
    batch_.Clear();
    if (const std::optional<v1::WorkBatch::End> end = service_.StreamEnd(id_)) {
      batch_.set_end(*end);
      for (uint64_t lease : service_.scheduler_.TakeCancelled(id_)) batch_.add_cancelled_lease_ids(lease);
      finished_ = true;
      HandedToGrpc(this);
      StartWriteAndFinish(&batch_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    if (!service_.scheduler_.HasCancelled(id_) && !service_.scheduler_.HasWorkFor(id_)) return;
    service_.FillBatch(id_, *session_, &batch_);
    if (batch_.leases_size() == 0 && batch_.cancelled_lease_ids_size() == 0) return;
    writing_ = true;
    HandedToGrpc(this);
    StartWrite(&batch_);
  }

  void OnWriteDone(bool ok) override {
    CalledBackByGrpc(this);
    std::lock_guard<std::mutex> lock(service_.mu_);
    writing_ = false;
    if (!ok) return Close(grpc::Status::OK);  // the worker is gone
    Pump();
  }
  void OnCancel() override {
    CalledBackByGrpc(this);
    std::lock_guard<std::mutex> lock(service_.mu_);
    cancelled_ = true;
    if (!writing_) Close(grpc::Status::OK);
  }
  void OnDone() override {
    CalledBackByGrpc(this);
    {
      std::lock_guard<std::mutex> lock(service_.mu_);
      session_->stream = nullptr;
      service_.StreamEnded(id_, session_);
    }
    {
      std::lock_guard<std::mutex> lock(service_.peers_mu_);
      service_.ReleaseStream(peer_);
    }
    delete this;
  }

 private:
  void Close(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    HandedToGrpc(this);
    Finish(status);
  }

  WorkerService& service_;
  const std::string id_, peer_;
  const std::shared_ptr<Session> session_;
  v1::WorkBatch batch_;  // the message being written
  bool writing_ = false, finished_ = false, cancelled_ = false;
};

// A lease stream refused before it started.
class RefusedStream final : public grpc::ServerWriteReactor<v1::WorkBatch> {
 public:
  explicit RefusedStream(const grpc::Status& status) {
    HandedToGrpc(this);
    Finish(status);
  }
  void OnDone() override {
    CalledBackByGrpc(this);
    delete this;
  }
};

void WorkerService::WakeAll() {
  (void)scheduler_.TakeCancelNotices();  // everyone looks
  for (auto& [id, s] : sessions_) {
    if (s->stream != nullptr) s->stream->Pump();
  }
}

void WorkerService::Wake(const std::string& worker_id) {
  if (const auto it = sessions_.find(worker_id); it != sessions_.end() && it->second->stream != nullptr) {
    it->second->stream->Pump();
  }
}

void WorkerService::StartPhase(std::shared_ptr<const PhaseData> phase, const std::vector<ScheduledUnit>& units) {
  std::lock_guard<std::mutex> lock(mu_);
  phase_ = std::move(phase);
  scheduler_.StartPhase(units);
  departed_.clear();  // their leases belonged to the phase that ended
  phase_done_at_ = Clock::now();
  WakeAll();
}

void WorkerService::TakeResults(std::vector<EvaluationRecord>* evaluations, std::vector<ReferenceResult>* references) {
  std::lock_guard<std::mutex> lock(mu_);
  evaluations->swap(evaluations_);
  references->swap(references_);
  evaluations_.clear();
  references_.clear();
}

bool WorkerService::PhaseDone() const {
  std::lock_guard<std::mutex> lock(mu_);
  return scheduler_.Done();
}

Clock::time_point WorkerService::PhaseDoneAt() const {
  std::lock_guard<std::mutex> lock(mu_);
  return phase_done_at_;
}

void WorkerService::DropPrompt(const std::string& task, int64_t prompt) {
  std::lock_guard<std::mutex> lock(mu_);
  scheduler_.Drop(task, prompt);
  if (scheduler_.Done()) phase_done_at_ = Clock::now();
  WakeAll();  // holders learn of their cancelled leases
}

void WorkerService::ExpireLeases() {
  std::lock_guard<std::mutex> lock(mu_);
  ProgressEntries ended;
  ended.leases_ended = scheduler_.TakeEnded();
  Log(ended);
  const Clock::time_point now = Clock::now();
  // Everything that gives a worker work wakes its stream; once a second every stream looks anyway.
  if (now - last_wake_all_ >= std::chrono::seconds(1)) {
    last_wake_all_ = now;
    WakeAll();
  }
  if (const int64_t n = scheduler_.ExpireLeases(now); n > 0) {
    spdlog::warn("{} lease(s) expired without a heartbeat; their prompts go back to the queue", n);
    WakeAll();
  }
  // A registration whose stream never came (the worker died in between) must not hold slots.
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (!it->second->streaming && now - it->second->registered > scheduler_.options().lease_timeout) {
      spdlog::warn("worker '{}' ({}) registered but never opened its lease stream: forgotten", it->second->name,
                   it->first);
      scheduler_.RemoveWorker(it->first);
      it = sessions_.erase(it);
    } else {
      ++it;
    }
  }
}

void WorkerService::End(v1::WorkBatch::End end) {
  std::lock_guard<std::mutex> lock(mu_);
  end_ = end;
  WakeAll();
}

ServiceCounters WorkerService::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  ServiceCounters c;
  c.scheduler = scheduler_.counters();
  c.workers = static_cast<int64_t>(sessions_.size());
  for (const auto& [id, session] : sessions_) {
    // A quarantined worker is also draining (no more leases): count it once, as quarantined.
    const bool quarantined = scheduler_.IsQuarantined(id);
    c.workers_quarantined += quarantined ? 1 : 0;
    c.workers_draining += !quarantined && scheduler_.IsDraining(id) ? 1 : 0;
  }
  c.refused = refused_;
  c.results_refused = results_refused_;
  c.journal_failures = journal_failures_;
  c.journal_failing = journal_failing_since_ > 0;
  for (std::size_t code = 0; code < refused_by_code_.size(); ++code) {
    if (const int64_t n = refused_by_code_[code]; n > 0) {
      c.refused_by_code[StatusCodeName(static_cast<StatusCode>(code))] = n;
    }
  }
  c.units_total = scheduler_.units_total();
  c.units_done = scheduler_.units_done();
  c.units_queued = scheduler_.units_queued();
  c.leases_active = scheduler_.leases_active();
  c.abandoned = scheduler_.abandoned();
  return c;
}

grpc::Status WorkerService::Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) {
  if (grpc::Status s = Authenticate(*context); !s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (end_) return {StatusCode::UNAVAILABLE, "the coordinator is shutting down"};
  }
  if (const std::string bad = CheckRegister(*request); !bad.empty()) {
    return Refuse(request->protocol_version() != v1::kProtocolVersion ? StatusCode::FAILED_PRECONDITION
                                                                      : StatusCode::INVALID_ARGUMENT,
                  bad);
  }
  const std::string& name = request->worker_name();
  const v1::Capabilities& caps = request->capabilities();
  if (caps.model_fingerprint() != config_.model_fingerprint) {
    return Refuse(StatusCode::FAILED_PRECONDITION,
                  "worker '" + name + "' has model fingerprint '" + caps.model_fingerprint() + "' but run '" +
                      config_.run_name + "' needs '" + config_.model_fingerprint + "'");
  }
  std::lock_guard<std::mutex> lock(mu_);
  {
    // A lease it cannot hold (forged, another worker's, another database's) is not kept: adopted, its id would
    // collide with a lease issued later. The worker drops what is not kept.
    std::vector<HeldLease> named;
    for (const v1::HeldLease& h : request->held_leases()) named.push_back({h.lease_id(), UnitKind::kCandidate, 0, "", {}});
    for (const auto& [lease, why] : scheduler_.CheckHeld(name, named)) {
      spdlog::warn("worker '{}' registered holding lease {}, which it cannot hold ({}): not kept", name, lease, why);
    }
  }
  const std::string id = NewWorkerId();
  auto session = std::make_shared<Session>();
  session->name = name;
  session->registered = Clock::now();
  sessions_[id] = session;
  scheduler_.AddWorker(id, caps.max_concurrent_leases(), name);
  if (phase_ && request->held_leases_size() > 0) {
    std::vector<HeldLease> held;
    for (const v1::HeldLease& h : request->held_leases()) {
      if (h.generation() != phase_->generation) continue;  // an earlier generation's: every unit has its result
      held.push_back({h.lease_id(), h.kind() == v1::Lease::KIND_REFERENCE ? UnitKind::kReference : UnitKind::kCandidate,
                      h.candidate(), h.task(), {h.prompts().begin(), h.prompts().end()}});
    }
    ProgressEntries kept_leases;
    for (const HeldLease& k : scheduler_.Reattach(id, held, Clock::now())) {
      v1::HeldLease* kept = response->add_kept_leases();
      kept->set_lease_id(k.id);
      kept->set_kind(k.kind == UnitKind::kReference ? v1::Lease::KIND_REFERENCE : v1::Lease::KIND_CANDIDATE);
      kept->set_generation(phase_->generation);
      kept->set_candidate(k.candidate);
      kept->set_task(k.task);
      for (int64_t p : k.prompts) kept->add_prompts(p);
      kept_leases.leases_issued.push_back(
          {k.id, phase_->generation, name, k.kind == UnitKind::kReference, k.candidate, k.task, k.prompts});
    }
    Log(kept_leases);  // before the worker goes on with them
    spdlog::info("worker '{}' re-attached with {} of the {} leases it held", name, response->kept_leases_size(),
                 request->held_leases_size());
  }
  response->set_worker_id(id);
  response->set_run_name(config_.run_name);
  response->set_architecture_json(config_.architecture_json);
  response->set_rope_scaling(config_.rope_scaling);
  response->set_heartbeat_interval_ms(config_.heartbeat_interval_ms);
  response->set_lease_timeout_ms(static_cast<int32_t>(scheduler_.options().lease_timeout.count()));
  response->set_protocol_version(v1::kProtocolVersion);
  spdlog::info("worker '{}' registered as {} ({}, {} leases at once)", name, id, caps.device(),
               caps.max_concurrent_leases());
  return grpc::Status::OK;
}

void WorkerService::FillBatch(const std::string& worker_id, Session& session, v1::WorkBatch* batch) {
  for (uint64_t id : scheduler_.TakeCancelled(worker_id)) batch->add_cancelled_lease_ids(id);
  const Clock::time_point now = Clock::now();
  ProgressEntries issued;
  while (phase_) {
    std::optional<LeaseGrant> grant = scheduler_.Acquire(worker_id, now);
    if (!grant) break;
    issued.leases_issued.push_back({grant->id, phase_->generation, session.name,
                                    grant->kind == UnitKind::kReference, grant->candidate, grant->task,
                                    grant->prompts});
    v1::Lease* lease = batch->add_leases();
    lease->set_lease_id(grant->id);
    lease->set_generation(phase_->generation);
    lease->set_task(grant->task);
    for (int64_t p : grant->prompts) lease->add_prompts(p);
    if (grant->kind == UnitKind::kReference) {
      lease->set_kind(v1::Lease::KIND_REFERENCE);
      continue;
    }
    lease->set_kind(v1::Lease::KIND_CANDIDATE);
    lease->set_candidate(grant->candidate);
    lease->set_collect_norm_stats(phase_->collect_norm_stats);
    if (phase_->norm_stats) v1::norm_stats_to_proto(*phase_->norm_stats, lease->mutable_norm_stats());
    if (session.params_sent.insert({phase_->generation, grant->candidate}).second) {
      v1::CandidateParameters* p = batch->add_parameters();
      p->set_generation(phase_->generation);
      p->set_candidate(grant->candidate);
      const std::vector<float>& values = phase_->params.at(grant->candidate);
      p->mutable_values()->Add(values.begin(), values.end());
    }
  }
  // Before the worker can see them: a restarted coordinator keeps them for it. Sent even when the log cannot
  // take them now (they wait in unjournaled_leases_): a restart meanwhile costs duplicate work, not results.
  Log(issued);
}

grpc::ServerWriteReactor<v1::WorkBatch>* WorkerService::Leases(grpc::CallbackServerContext* context,
                                                                const v1::LeasesRequest* request) {
  if (grpc::Status s = Authenticate(*context); !s.ok()) return new RefusedStream(s);
  const std::string& id = request->worker_id();
  const std::string peer = PeerAddress(*context);
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    int& streams = streams_by_peer_[peer];
    if (config_.max_streams_per_peer > 0 && streams >= config_.max_streams_per_peer) {
      return new RefusedStream(Refuse(StatusCode::RESOURCE_EXHAUSTED, peer + " has " + std::to_string(streams) +
                                                                          " lease streams open already (--max-streams-per-peer)"));
    }
    ++streams;  // released by the stream's OnDone
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Session> session;
  grpc::Status refused = FindSession(id, &session);
  if (refused.ok() && session->streaming) {
    refused = Refuse(StatusCode::FAILED_PRECONDITION, "worker " + id + " already has a lease stream open");
  }
  if (!refused.ok()) {
    std::lock_guard<std::mutex> peers(peers_mu_);
    ReleaseStream(peer);
    return new RefusedStream(refused);
  }
  session->streaming = true;
  session->stream = new LeaseStream(*this, id, peer, session);
  session->stream->Pump();  // its first leases (gRPC sends them once the stream is bound)
  return session->stream;
}

void WorkerService::StreamEnded(const std::string& id, const std::shared_ptr<Session>& session) {
  // The worker is gone (or done): whatever it still holds goes back to the queue. It may still report those
  // leases until the phase ends.
  const std::size_t held = scheduler_.LeasesOf(id).size();
  if (scheduler_.IsQuarantined(id)) {
    spdlog::error("worker '{}' ({}) failed {} prompts in a row and gets no more work from this run", session->name, id,
                  scheduler_.options().quarantine_after);
  }
  const bool quarantined = scheduler_.IsQuarantined(id);
  scheduler_.RemoveWorker(id);
  sessions_.erase(id);
  departed_[id] = session;
  if (quarantined && std::all_of(sessions_.begin(), sessions_.end(),
                                 [&](const auto& s) { return scheduler_.IsQuarantined(s.first); })) {
    spdlog::error("every worker of this run is quarantined: it waits for a new worker to connect "
                  "(see the prompt errors above; --quarantine-after sets the limit)");
  }
  if (held > 0) spdlog::warn("worker '{}' ({}) left holding {} leases: returned to the queue", session->name, id, held);
  spdlog::info("worker '{}' ({}) disconnected", session->name, id);
  WakeAll();
}

std::optional<v1::WorkBatch::End> WorkerService::StreamEnd(const std::string& worker_id) const {
  if (end_) return end_;
  if (scheduler_.IsQuarantined(worker_id)) return v1::WorkBatch::END_QUARANTINED;
  if (scheduler_.IsDraining(worker_id) && scheduler_.LeasesOf(worker_id).empty()) return v1::WorkBatch::END_DRAINED;
  return std::nullopt;
}

grpc::Status WorkerService::Report(grpc::ServerContext* context, const v1::ReportRequest* request,
                                   v1::ReportResponse* response) {
  if (grpc::Status s = Authenticate(*context); !s.ok()) return s;
  std::set<int64_t> prompts;
  if (const std::string bad = CheckReport(*request, &prompts); !bad.empty()) {
    return Refuse(StatusCode::INVALID_ARGUMENT, bad);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (end_) return {StatusCode::UNAVAILABLE, "the coordinator is shutting down: send the results again"};
  std::shared_ptr<Session> session;
  if (grpc::Status s = FindSession(request->worker_id(), &session, /*departed=*/true); !s.ok()) return s;
  const Triage t = TriageReport(*request, session->name);
  // Acknowledged only once the accepted results are in the progress log (the worker forgets them then): if they
  // cannot be, nothing of the report is taken and the worker sends it again.
  if (!Log(t.accepted)) {
    return {StatusCode::UNAVAILABLE, "the coordinator could not write the results to its progress log (its error "
                                     "is logged there): nothing of this report was taken; send it again"};
  }
  const uint64_t lease = request->lease_id();
  for (const auto& [prompt, seconds] : t.complete) (void)scheduler_.Complete(lease, prompt, seconds);
  for (const v1::PromptFailure* f : t.failures) {
    spdlog::warn("worker '{}' could not run {} prompt {} (lease {}): {}", session->name, t.task, f->prompt(), lease,
                 f->error());
    scheduler_.Fail(lease, f->prompt(), session->name + ": " + f->error());
  }
  for (int64_t i = 0; i < t.stale; ++i) scheduler_.CountStale();
  // What it did not run goes back now, not at the lease's deadline, and any idle worker may take it.
  const bool requeued = request->lease_done() && scheduler_.Release(request->worker_id(), lease);
  const int accepted = static_cast<int>(t.accepted.evaluations.size() + t.accepted.references.size());
  const int duplicates = static_cast<int>(t.complete.size()) - accepted + static_cast<int>(t.stale);
  if (duplicates > 0) {
    spdlog::info("worker '{}': {} duplicate result(s) on lease {} ignored", session->name, duplicates, lease);
  }
  if (!t.refused.empty()) {
    results_refused_ += static_cast<int64_t>(t.refused.size());
    spdlog::warn("worker '{}': {} result(s) or failure(s) on lease {} refused, the rest taken (first: prompt {}: {})",
                 session->name, t.refused.size(), lease, t.refused.front().first, t.refused.front().second);
  }
  response->set_accepted(accepted);
  response->set_duplicates(duplicates);
  for (const auto& [prompt, reason] : t.refused) {
    v1::RefusedPrompt* r = response->add_refused();
    r->set_prompt(prompt);
    r->set_reason(reason);
  }
  evaluations_.insert(evaluations_.end(), t.accepted.evaluations.begin(), t.accepted.evaluations.end());
  references_.insert(references_.end(), t.accepted.references.begin(), t.accepted.references.end());
  if (accepted > 0 && scheduler_.Done()) {
    phase_done_at_ = Clock::now();
    if (hooks_.phase_done) hooks_.phase_done();
  }
  if (!t.failures.empty() || requeued) {
    WakeAll();  // prompts are back in the queue
  } else {
    // The reporter may have a free slot; copies elsewhere may have been cancelled. Waking only those keeps a
    // report O(1) in the number of workers.
    Wake(request->worker_id());
    for (const std::string& id : scheduler_.TakeCancelNotices()) Wake(id);
  }
  return grpc::Status::OK;
}

WorkerService::Triage WorkerService::TriageReport(const v1::ReportRequest& request, const std::string& name) const {
  Triage t;
  const std::string& worker = request.worker_id();
  const uint64_t lease = request.lease_id();
  // The unit a prompt of this lease is, or why the coordinator does not expect it from this worker.
  const auto unit = [&](int64_t prompt, bool result) -> std::optional<UnitKey> {
    bool stale = false;
    Result<UnitKey> key = scheduler_.Check(worker, lease, prompt, &stale, name);
    if (stale) {
      t.stale += result ? 1 : 0;  // a lease of an earlier phase: every unit of it has its result already
      return std::nullopt;
    }
    if (!key.ok()) {
      t.refused.emplace_back(prompt, key.status().message());
      return std::nullopt;
    }
    t.task = key->task;
    return *key;
  };
  for (const v1::PromptResult& r : request.results()) {
    if (const std::string bad = CheckResult(r); !bad.empty()) {
      t.refused.emplace_back(r.prompt(), bad);
      continue;
    }
    const std::optional<UnitKey> key = unit(r.prompt(), /*result=*/true);
    if (!key) continue;
    const bool collecting = key->kind == UnitKind::kCandidate && phase_->collect_norm_stats;
    if (collecting != r.has_norm_stats()) {
      t.refused.emplace_back(r.prompt(), collecting ? "norm_stats are required (this lease collects statistics)"
                                                    : "norm_stats must be absent (statistics are frozen)");
      continue;
    }
    t.complete.emplace_back(r.prompt(), r.seconds());
    if (scheduler_.HasResult(lease, r.prompt())) continue;  // a duplicate
    if (key->kind == UnitKind::kReference) {
      t.accepted.references.push_back({key->task, key->prompt, r.score()});
      continue;
    }
    EvaluationRecord e;
    e.generation = phase_->generation;
    e.candidate = key->candidate;
    e.task = key->task;
    e.prompt = key->prompt;
    e.score = r.score();
    e.cache_size_mean = r.cache_size_mean();
    e.cache_size_final = r.cache_size_final();
    e.prompt_tokens = r.prompt_tokens();
    e.generated_tokens = r.generated_tokens();
    e.worker = name;
    e.duration_seconds = r.seconds();
    if (r.has_norm_stats()) e.norm_stats = v1::norm_stats_from_proto(r.norm_stats());
    t.accepted.evaluations.push_back(std::move(e));
  }
  for (const v1::PromptFailure& f : request.failures()) {
    if (const std::string bad = CheckFailure(f); !bad.empty()) {
      t.refused.emplace_back(f.prompt(), bad);
      continue;
    }
    if (unit(f.prompt(), /*result=*/false)) t.failures.push_back(&f);
  }
  return t;
}

grpc::Status WorkerService::Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) {
  if (grpc::Status s = Authenticate(*context); !s.ok()) return s;
  if (const std::string bad = CheckIdCount(request->lease_ids_size(), "a heartbeat"); !bad.empty()) {
    return Refuse(StatusCode::INVALID_ARGUMENT, bad);
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Session> session;
  if (grpc::Status s = FindSession(request->worker_id(), &session); !s.ok()) return s;
  const std::vector<uint64_t> gone = scheduler_.Heartbeat(
      request->worker_id(), {request->lease_ids().begin(), request->lease_ids().end()}, Clock::now());
  for (uint64_t id : gone) response->add_cancelled_lease_ids(id);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                                  v1::DrainResponse* /*response*/) {
  if (grpc::Status s = Authenticate(*context); !s.ok()) return s;
  if (const std::string bad = CheckIdCount(request->returned_lease_ids_size(), "a drain"); !bad.empty()) {
    return Refuse(StatusCode::INVALID_ARGUMENT, bad);
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Session> session;
  if (grpc::Status s = FindSession(request->worker_id(), &session); !s.ok()) return s;
  scheduler_.Drain(request->worker_id(), {request->returned_lease_ids().begin(), request->returned_lease_ids().end()});
  spdlog::info("worker '{}' is draining ({} leases returned)", session->name, request->returned_lease_ids_size());
  WakeAll();
  return grpc::Status::OK;
}

}  // namespace namm::coordinator
