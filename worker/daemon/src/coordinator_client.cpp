#include "namm/worker/coordinator_client.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "namm/file_util.h"
#include "namm/utf8.h"
#include "namm/v1/coordinator.grpc.pb.h"
#include "namm/v1/norm_stats_proto.h"
#include "namm/v1/protocol.h"
#include "namm/worker/worker_metrics.h"

namespace namm::worker {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kCallTimeout = std::chrono::seconds(10);
// A lease's results are sent as they come, at most this often, and when the lease is done; a report that failed
// goes again after this, doubling up to kReportBackoffMax.
constexpr auto kReportInterval = std::chrono::milliseconds(500);
constexpr auto kReportBackoffMax = std::chrono::milliseconds(8000);

Result<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const ClientTls& tls) {
  if (tls.ca.empty()) {
    if (!tls.cert.empty() || !tls.key.empty()) {
      return Status::InvalidArgument("a client certificate needs TLS: give the coordinator's CA (--tls-ca)");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (tls.cert.empty() != tls.key.empty()) {
    return Status::InvalidArgument("a client certificate needs both --tls-cert and --tls-key");
  }
  grpc::SslCredentialsOptions ssl;
  NAMM_ASSIGN_OR_RETURN(ssl.pem_root_certs, read_file(tls.ca));
  if (!tls.cert.empty()) {
    NAMM_ASSIGN_OR_RETURN(ssl.pem_cert_chain, read_file(tls.cert));
    NAMM_ASSIGN_OR_RETURN(ssl.pem_private_key, read_file(tls.key));
  }
  return grpc::SslCredentials(ssl);
}

bool Fatal(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::FAILED_PRECONDITION ||
         code == grpc::StatusCode::INVALID_ARGUMENT || code == grpc::StatusCode::PERMISSION_DENIED;
}

// Reports of one lease failing in a row with a status the protocol gives no reason for, before it is given up.
constexpr int kMaxUnexplainedReportFailures = 20;

bool Unexplained(grpc::StatusCode code) {
  return code == grpc::StatusCode::INTERNAL || code == grpc::StatusCode::UNKNOWN ||
         code == grpc::StatusCode::DATA_LOSS;
}

}  // namespace

ReportHandling report_handling(int code, const std::string& message, int sent) {
  switch (static_cast<grpc::StatusCode>(code)) {
    case grpc::StatusCode::OK:
      return ReportHandling::kTaken;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      // gRPC's size limit ("Received message larger than max (N vs. M)") or the coordinator's: an address locked
      // out after failed authentications, too many streams from one address, which pass within a minute.
      if (message.find("larger than max") == std::string::npos) return ReportHandling::kRetry;
      return sent > 1 ? ReportHandling::kSplit : ReportHandling::kDrop;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::UNIMPLEMENTED:
      return ReportHandling::kDrop;
    case grpc::StatusCode::NOT_FOUND:          // the session is gone (a restarted coordinator)
    case grpc::StatusCode::UNAUTHENTICATED:    // the secret changed
    case grpc::StatusCode::PERMISSION_DENIED:  // a client certificate refused
    case grpc::StatusCode::FAILED_PRECONDITION:  // the protocol or the model no longer match
      return ReportHandling::kReconnect;
    default:  // UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ABORTED, INTERNAL, UNKNOWN, DATA_LOSS, ...
      return ReportHandling::kRetry;
  }
}

struct WorkerClient::Impl {
  Impl(WorkerClientOptions o, LeaseExecutor& e) : options(std::move(o)), executor(e) {}

  WorkerClientOptions options;
  LeaseExecutor& executor;
  std::unique_ptr<v1::Coordinator::Stub> stub;

  // A lease this worker holds, across sessions: while the coordinator is away it keeps running it and keeps its
  // results, and names it when it registers again.
  struct Held {
    std::shared_ptr<LeaseWork> work;
    std::set<int64_t> open;   // prompts without an acknowledged result, run or not
    bool finished = false;    // an executor went through it
    bool cancelled = false;   // the coordinator no longer wants it: its executor stops, what finished is reported
  };

  mutable std::mutex mu;
  std::condition_variable wake;
  // The current session.
  std::string worker_id;
  bool connected = false;
  grpc::ClientContext* stream_context = nullptr;
  int heartbeat_ms = 2000;
  // Across sessions.
  std::deque<std::shared_ptr<LeaseWork>> queue;              // received, not started
  std::map<uint64_t, Held> held;
  std::map<uint64_t, v1::ReportRequest> outbox;               // results and failures not yet acknowledged
  std::map<uint64_t, Clock::time_point> last_report, retry_after;
  std::map<uint64_t, int> report_failures;  // reports of the lease that failed in a row (the retry's backoff)
  std::map<uint64_t, int> report_limit;     // results a report, once one was too large for the coordinator
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const std::vector<float>>> params;
  bool stopping = false;  // Run() is returning: executors and the sender stop
  bool draining = false, drain_now = false;
  WorkerClientStats stats;

  // Metrics, when the options carry them.
  template <typename F>
  void Metrics(F&& f) const {
    if (options.metrics != nullptr) f(*options.metrics);
  }
  // The lease, or null once forgotten (mu held). Every use after the lock was released (a call, a prompt) looks
  // again: a drain, a reconnection or another report may have forgotten it meanwhile.
  Held* Find(uint64_t id) {
    const auto h = held.find(id);
    return h == held.end() ? nullptr : &h->second;
  }
  // Drops a lease entirely: not run further, not reported, not named again (mu held).
  void Forget(uint64_t id) {
    if (held.erase(id) > 0) Metrics([](WorkerMetrics& w) { w.LeasesInFlight(-1); });
    outbox.erase(id);
    last_report.erase(id);
    retry_after.erase(id);
    report_failures.erase(id);
    report_limit.erase(id);
    queue.erase(std::remove_if(queue.begin(), queue.end(), [&](const auto& l) { return l->id == id; }), queue.end());
  }
  // The coordinator no longer wants the lease (a copy finished first, it expired, or its phase ended) (mu held):
  // a queued one is forgotten; a running one stops after its prompt, and what it finished is still reported
  // (late results count while their units have none).
  void Cancel(uint64_t id) {
    const auto h = held.find(id);
    if (h == held.end()) return;
    const bool queued = std::any_of(queue.begin(), queue.end(), [&](const auto& l) { return l->id == id; });
    if (queued) return Forget(id);
    h->second.cancelled = true;
  }
  void ForgetAll() {
    while (!held.empty()) Forget(held.begin()->first);
    queue.clear();
  }

  void Authorize(grpc::ClientContext& context, bool with_deadline) const {
    context.AddMetadata("x-namm-token", options.token);
    if (with_deadline) context.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
  }

  struct SessionEnd {
    Status fatal;  // not OK: stop serving
    bool registered = false;
    v1::WorkBatch::End end = v1::WorkBatch::END_UNSPECIFIED;
  };
  SessionEnd Session();
  void Take(const v1::WorkBatch& batch);
  void ExecutorLoop(int slot);
  // Reports results as they come (at most every kReportInterval per lease, and when a lease is done) and sends
  // heartbeats, while connected.
  void SenderLoop();
  // What is due for `lease` (mu held; released during a call): its results, or that it is done with.
  void Send(std::unique_lock<std::mutex>& lock, uint64_t lease);
  // Sends what the outbox holds for `lease` (mu held; released during the call). Unacknowledged entries stay.
  void Report(std::unique_lock<std::mutex>& lock, uint64_t lease);
  void Heartbeat(std::unique_lock<std::mutex>& lock);
  // Asks for a new session (mu held): the coordinator no longer knows this one.
  void Reconnect(const std::string& why) {
    if (stream_context != nullptr && connected) {
      spdlog::warn("the coordinator no longer knows this worker ({}); registering again", why);
      stream_context->TryCancel();
    }
  }
  // Tells the coordinator about a drain (mu not held).
  void SendDrain(bool immediately);
};

WorkerClient::WorkerClient(WorkerClientOptions options, LeaseExecutor& executor)
    : impl_(std::make_unique<Impl>(std::move(options), executor)) {}

WorkerClient::~WorkerClient() = default;

WorkerClientStats WorkerClient::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

Status WorkerClient::Run() {
  Impl& m = *impl_;
  if (m.options.concurrency < 1 || m.options.concurrency > 64) {
    return Status::InvalidArgument("units concurrency must be 1 to 64");
  }
  if (m.options.max_batch < 1 || m.options.max_batch > 256) {
    return Status::InvalidArgument("the batch size must be 1 to 256");
  }
  NAMM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, Credentials(m.options.tls));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(m.options.max_message_bytes);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // each worker its own connection, even in one process
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, static_cast<int>(m.options.backoff_initial.count()));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(m.options.backoff_max.count()));
  // Pings find a coordinator behind a dead connection (a crashed host, a partition) within ~20 s.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  if (!m.options.tls.server_name.empty()) args.SetSslTargetNameOverride(m.options.tls.server_name);
  m.Metrics([&](WorkerMetrics& w) { w.Describe(m.options.name, m.options.device, m.options.model_fingerprint); });
  m.stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(m.options.coordinator, credentials, args));

  // Executors and the sender outlive sessions: work goes on while the coordinator is away.
  std::vector<std::thread> threads;
  for (int slot = 0; slot < m.options.concurrency; ++slot) threads.emplace_back([&m, slot] { m.ExecutorLoop(slot); });
  threads.emplace_back([&m] { m.SenderLoop(); });
  const auto stop = [&](Status s) {
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.stopping = true;
      m.wake.notify_all();
    }
    for (std::thread& t : threads) t.join();
    return s;
  };
  auto backoff = m.options.backoff_initial;
  while (true) {
    Impl::SessionEnd end = m.Session();
    if (!end.fatal.ok()) return stop(end.fatal);
    bool drained = end.end == v1::WorkBatch::END_DRAINED;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      drained = drained || m.draining;
    }
    if (drained) return stop(Status::Ok());
    if (end.end == v1::WorkBatch::END_RUN_FINISHED && m.options.exit_when_done) return stop(Status::Ok());
    if (end.registered) backoff = m.options.backoff_initial;
    std::unique_lock<std::mutex> lock(m.mu);
    if (m.wake.wait_for(lock, backoff, [&] { return m.draining; })) {
      lock.unlock();
      return stop(Status::Ok());
    }
    backoff = std::min(backoff * 2, m.options.backoff_max);
  }
}

WorkerClient::Impl::SessionEnd WorkerClient::Impl::Session() {
  SessionEnd out;
  v1::RegisterRequest request;
  request.set_worker_name(options.name);
  v1::Capabilities* caps = request.mutable_capabilities();
  caps->set_model_fingerprint(options.model_fingerprint);
  caps->set_device(options.device);
  caps->set_memory_bytes(options.memory_bytes);
  caps->set_max_concurrent_leases(std::min(64, options.concurrency * options.max_batch));
  request.set_protocol_version(v1::kProtocolVersion);
  {
    std::lock_guard<std::mutex> lock(mu);
    // At most what the coordinator takes in one registration (it refuses more, which would end this worker);
    // a lease left out is dropped below, its prompts run again wherever the coordinator leases them.
    std::size_t named_prompts = 0, left_out = 0;
    for (const auto& [id, h] : held) {
      if (static_cast<std::size_t>(request.held_leases_size()) == v1::kMaxIdsPerCall ||
          named_prompts + h.open.size() > v1::kMaxIdsPerCall) {
        ++left_out;
        continue;
      }
      named_prompts += h.open.size();
      v1::HeldLease* l = request.add_held_leases();
      l->set_lease_id(id);
      l->set_kind(h.work->reference ? v1::Lease::KIND_REFERENCE : v1::Lease::KIND_CANDIDATE);
      l->set_generation(h.work->generation);
      l->set_candidate(h.work->candidate);
      l->set_task(h.work->task);
      for (int64_t p : h.open) l->add_prompts(p);
    }
    if (left_out > 0) {
      spdlog::warn("{} of the {} leases it holds are not named again: a registration names at most {} prompts",
                   left_out, held.size(), v1::kMaxIdsPerCall);
    }
  }
  v1::RegisterResponse response;
  {
    grpc::ClientContext context;
    Authorize(context, true);
    // Wait for the connection (up to the call's deadline) rather than fail while the channel backs off.
    context.set_wait_for_ready(true);
    const grpc::Status s = stub->Register(&context, request, &response);
    if (!s.ok()) {
      if (Fatal(s.error_code())) {
        out.fatal = Status::FailedPrecondition("the coordinator refused this worker: " + s.error_message());
        Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kRefused); });
      } else {
        spdlog::warn("cannot reach the coordinator at {}: {}", options.coordinator, s.error_message());
        Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kConnection); });
      }
      return out;
    }
  }
  if (response.protocol_version() != v1::kProtocolVersion) {
    out.fatal = Status::FailedPrecondition("the coordinator speaks protocol version " +
                                           std::to_string(response.protocol_version()) + " and this worker " +
                                           std::to_string(v1::kProtocolVersion) +
                                           ": run the same namm release on both");
    return out;
  }
  RunInfo run{response.run_name(), response.architecture_json(), response.rope_scaling()};
  if (Status s = executor.Prepare(run); !s.ok()) {
    out.fatal = s.WithContext("run '" + run.run_name + "'");
    return out;
  }
  out.registered = true;
  spdlog::info("registered with run '{}' as {}", run.run_name, response.worker_id());

  grpc::ClientContext stream;
  Authorize(stream, false);
  {
    std::lock_guard<std::mutex> lock(mu);
    // Of what it held, it keeps what the coordinator keeps, and only the prompts it still wants.
    std::map<uint64_t, std::set<int64_t>> kept;
    for (const v1::HeldLease& k : response.kept_leases()) kept[k.lease_id()] = {k.prompts().begin(), k.prompts().end()};
    std::vector<uint64_t> gone;
    for (auto& [id, h] : held) {
      const auto k = kept.find(id);
      if (k == kept.end()) {
        gone.push_back(id);
        continue;
      }
      std::set<int64_t> open;
      std::set_intersection(h.open.begin(), h.open.end(), k->second.begin(), k->second.end(),
                            std::inserter(open, open.end()));
      h.open = std::move(open);
      if (auto o = outbox.find(id); o != outbox.end()) {
        auto& results = *o->second.mutable_results();
        results.erase(std::remove_if(results.begin(), results.end(),
                                     [&](const v1::PromptResult& r) { return h.open.count(r.prompt()) == 0; }),
                      results.end());
        auto& failures = *o->second.mutable_failures();
        failures.erase(std::remove_if(failures.begin(), failures.end(),
                                      [&](const v1::PromptFailure& f) { return h.open.count(f.prompt()) == 0; }),
                       failures.end());
      }
    }
    for (uint64_t id : gone) Forget(id);
    if (!held.empty() || !gone.empty()) {
      spdlog::info("re-attached {} of the leases it held ({} dropped)", held.size(), gone.size());
    }
    worker_id = response.worker_id();
    heartbeat_ms = std::max(50, response.heartbeat_interval_ms());
    connected = true;
    stream_context = &stream;
    ++stats.sessions;
    wake.notify_all();  // the sender reports what finished meanwhile
  }
  Metrics([](WorkerMetrics& w) { w.Connected(+1); });
  v1::LeasesRequest leases_request;
  leases_request.set_worker_id(response.worker_id());
  std::unique_ptr<grpc::ClientReader<v1::WorkBatch>> reader = stub->Leases(&stream, leases_request);
  bool drain_requested = false, drain_immediately = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    drain_requested = draining;
    drain_immediately = drain_now;
  }
  if (drain_requested) SendDrain(drain_immediately);  // a signal arrived while registering

  v1::WorkBatch batch;
  while (reader->Read(&batch)) {
    Take(batch);
    if (batch.end() != v1::WorkBatch::END_UNSPECIFIED) out.end = batch.end();
  }
  const grpc::Status finished = reader->Finish();
  {
    std::lock_guard<std::mutex> lock(mu);
    connected = false;
    stream_context = nullptr;
    // A session that ended for good takes its work with it. One that broke (the coordinator restarted or the
    // network failed) does not: leases keep running, and are named when registering again.
    const bool for_good = out.end == v1::WorkBatch::END_RUN_FINISHED || out.end == v1::WorkBatch::END_DRAINED ||
                          out.end == v1::WorkBatch::END_QUARANTINED || (!finished.ok() && Fatal(finished.error_code()));
    if (for_good) ForgetAll();
    wake.notify_all();
  }
  Metrics([](WorkerMetrics& w) { w.Connected(-1); });
  if (!finished.ok() && Fatal(finished.error_code())) {
    Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kRefused); });
    out.fatal = Status::FailedPrecondition("the coordinator refused the lease stream: " + finished.error_message());
  } else if (out.end == v1::WorkBatch::END_QUARANTINED) {
    out.fatal = Status::FailedPrecondition("the coordinator gives this worker no more work: its prompts failed "
                                           "several times in a row (the errors are logged above)");
  } else if (out.end == v1::WorkBatch::END_UNSPECIFIED) {
    spdlog::warn("lost the coordinator ({}); reconnecting", finished.error_message());
    Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kConnection); });
  }
  return out;
}

void WorkerClient::Impl::Take(const v1::WorkBatch& batch) {
  std::lock_guard<std::mutex> lock(mu);
  for (const v1::CandidateParameters& p : batch.parameters()) {
    // Only the newest generation's parameters are ever needed again.
    for (auto it = params.begin(); it != params.end();) {
      it = it->first.first < p.generation() ? params.erase(it) : std::next(it);
    }
    params[{p.generation(), p.candidate()}] =
        std::make_shared<const std::vector<float>>(p.values().begin(), p.values().end());
  }
  for (const v1::Lease& l : batch.leases()) {
    auto work = std::make_shared<LeaseWork>();
    work->id = l.lease_id();
    work->reference = l.kind() == v1::Lease::KIND_REFERENCE;
    work->generation = l.generation();
    work->candidate = l.candidate();
    work->task = l.task();
    work->prompts.assign(l.prompts().begin(), l.prompts().end());
    work->collect_norm_stats = l.collect_norm_stats();
    if (l.has_norm_stats()) work->norm_stats = v1::norm_stats_from_proto(l.norm_stats());
    if (!work->reference) {
      const auto it = params.find({l.generation(), l.candidate()});
      if (it == params.end()) {
        spdlog::error("lease {} arrived without the parameters of generation {} candidate {}; dropped (it will "
                      "expire and run elsewhere)", l.lease_id(), l.generation(), l.candidate());
        continue;
      }
      work->params = it->second;
    }
    if (held.count(work->id) > 0) continue;  // already held (never sent twice; defensive)
    held[work->id] = Held{work, {work->prompts.begin(), work->prompts.end()}};
    Metrics([](WorkerMetrics& w) { w.LeasesInFlight(+1); });
    queue.push_back(std::move(work));
    ++stats.leases;
  }
  for (uint64_t id : batch.cancelled_lease_ids()) {
    Cancel(id);
    ++stats.cancelled;
  }
  wake.notify_all();
}

void WorkerClient::Impl::ExecutorLoop(int slot) {
  const auto batch_size = static_cast<std::size_t>(options.max_batch);
  while (true) {
    // Up to max_batch leases of one task (a generation's candidates usually share its prompts).
    std::vector<std::shared_ptr<LeaseWork>> leases;
    {
      std::unique_lock<std::mutex> lock(mu);
      wake.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) return;
      leases.push_back(std::move(queue.front()));
      queue.pop_front();
      for (auto it = queue.begin(); it != queue.end() && leases.size() < batch_size;) {
        if ((*it)->task != leases.front()->task) {
          ++it;
          continue;
        }
        leases.push_back(std::move(*it));
        it = queue.erase(it);
      }
    }
    // Their prompts interleaved (the first of each lease, then the second, ...), so that a batch holds the same
    // prompt for several candidates, then run max_batch at a time.
    std::vector<PromptJob> jobs;
    for (std::size_t position = 0;; ++position) {
      bool any = false;
      for (const auto& lease : leases) {
        if (position >= lease->prompts.size()) continue;
        jobs.push_back({lease.get(), lease->prompts[position]});
        any = true;
      }
      if (!any) break;
    }
    std::set<uint64_t> stopped;  // leases dropped, cancelled or drained meanwhile: not run further
    for (std::size_t first = 0; first < jobs.size(); first += batch_size) {
      std::vector<PromptJob> batch;
      {
        std::lock_guard<std::mutex> lock(mu);
        for (std::size_t j = first; j < std::min(jobs.size(), first + batch_size); ++j) {
          const uint64_t id = jobs[j].lease->id;
          const auto h = held.find(id);
          if (stopping || drain_now || h == held.end() || h->second.cancelled) stopped.insert(id);
          if (stopped.count(id) > 0) continue;
          if (h->second.open.count(jobs[j].prompt) == 0) continue;  // the coordinator no longer wants it
          batch.push_back(jobs[j]);
        }
      }
      if (batch.empty()) continue;
      std::vector<Result<PromptOutcome>> outcomes = executor.RunPrompts(batch, slot);
      if (outcomes.size() != batch.size()) {
        outcomes.assign(batch.size(), Status::Internal("the executor returned " + std::to_string(outcomes.size()) +
                                                       " outcomes for " + std::to_string(batch.size()) + " prompts"));
      }
      std::lock_guard<std::mutex> lock(mu);
      for (std::size_t j = 0; j < batch.size(); ++j) {
        const LeaseWork& lease = *batch[j].lease;
        const int64_t prompt = batch[j].prompt;
        if (held.count(lease.id) == 0) {  // dropped meanwhile: not kept after a restart, or a drain
          stopped.insert(lease.id);
          continue;
        }
        // A score the coordinator would refuse (NaN from a model's overflowing logits) is this worker's failure:
        // refused, its prompt would be forgotten here and leased again for ever, never using an attempt.
        Result<PromptOutcome> r = outcomes[j];
        if (r.ok() && !(r->score >= 0 && r->score <= 1)) {
          std::ostringstream what;
          what << lease.task << " prompt " << prompt << " scored " << r->score << ", not a number in [0, 1]";
          r = Status::Internal(what.str());
        }
        v1::ReportRequest& unsent = outbox[lease.id];
        if (!r.ok()) {
          // Reported as failed: the prompt runs elsewhere, and one that fails everywhere is dropped.
          spdlog::error("lease {} ({} prompt {}): {}", lease.id, lease.task, prompt, r.status().ToString());
          v1::PromptFailure* failure = unsent.add_failures();
          failure->set_prompt(prompt);
          failure->set_error(utf8_prefix(r.status().ToString(), 2048));  // protobuf strings must be valid UTF-8
          Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kPrompt); });
          ++stats.failed;
        } else {
          Metrics([&](WorkerMetrics& w) { w.PromptDone(*r); });
          v1::PromptResult* result = unsent.add_results();
          result->set_prompt(prompt);
          result->set_score(r->score);
          result->set_cache_size_mean(r->cache_size_mean);
          result->set_cache_size_final(r->cache_size_final);
          result->set_prompt_tokens(r->prompt_tokens);
          result->set_generated_tokens(r->generated_tokens);
          result->set_seconds(r->seconds);
          if (r->norm_stats) v1::norm_stats_to_proto(*r->norm_stats, result->mutable_norm_stats());
        }
      }
      wake.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& lease : leases) {
      if (stopped.count(lease->id) == 0) Metrics([](WorkerMetrics& w) { w.LeaseDone(); });
      if (const auto h = held.find(lease->id); h != held.end()) h->second.finished = true;
    }
    wake.notify_all();
  }
}

void WorkerClient::Impl::SenderLoop() {
  std::unique_lock<std::mutex> lock(mu);
  Clock::time_point next_heartbeat = Clock::now() + std::chrono::milliseconds(heartbeat_ms);
  // One call per pass, and every pass looks at the leases afresh: a call releases the lock, and a drain, a
  // reconnection or the run's end may forget any lease meanwhile, so nothing decided before a call is used after.
  while (!stopping) {
    if (connected && Clock::now() >= next_heartbeat) {
      Heartbeat(lock);
      next_heartbeat = Clock::now() + std::chrono::milliseconds(heartbeat_ms);
      continue;
    }
    // A lease's results go when it is done, else at most every kReportInterval; after a failed attempt, when its
    // backoff says.
    const Clock::time_point now = Clock::now();
    std::optional<uint64_t> due;
    std::optional<Clock::time_point> next_report;
    for (const auto& [id, h] : held) {
      const auto o = outbox.find(id);
      const bool pending = o != outbox.end() && o->second.results_size() + o->second.failures_size() > 0;
      if (!pending && !h.finished) continue;
      const auto last = last_report.find(id);
      Clock::time_point at = h.finished || last == last_report.end() ? Clock::time_point() : last->second + kReportInterval;
      if (const auto r = retry_after.find(id); r != retry_after.end()) at = std::max(at, r->second);
      if (at <= now) {
        due = id;
        break;
      }
      if (!next_report || at < *next_report) next_report = at;
    }
    if (connected && due) {
      Send(lock, *due);
      continue;
    }
    wake.wait_until(lock, connected && next_report ? std::min(*next_report, next_heartbeat) : next_heartbeat);
    if (!connected) next_heartbeat = Clock::now() + std::chrono::milliseconds(heartbeat_ms);
  }
}

void WorkerClient::Impl::Send(std::unique_lock<std::mutex>& lock, uint64_t lease) {
  Held* h = Find(lease);
  const auto o = outbox.find(lease);
  if (h == nullptr) return;
  if (o != outbox.end() && o->second.results_size() + o->second.failures_size() > 0) return Report(lock, lease);
  // A finished lease that skipped prompts tells the coordinator, so that they run elsewhere at once; then it is
  // done with.
  if (h->open.empty() || h->cancelled) return Forget(lease);
  outbox[lease].set_lease_done(true);
  Report(lock, lease);
}

void WorkerClient::Impl::Report(std::unique_lock<std::mutex>& lock, uint64_t lease) {
  v1::ReportRequest request = std::move(outbox[lease]);
  outbox.erase(lease);
  // After a report too large for the coordinator, fewer results a report (what is left waits for the next).
  if (const auto limit = report_limit.find(lease); limit != report_limit.end()) {
    v1::ReportRequest& rest = outbox[lease];
    while (request.results_size() > limit->second) {
      *rest.add_results() = request.results(request.results_size() - 1);
      request.mutable_results()->RemoveLast();
    }
    if (rest.results_size() > 0) {
      std::reverse(rest.mutable_results()->begin(), rest.mutable_results()->end());
      rest.set_lease_done(request.lease_done());
      request.set_lease_done(false);
    } else {
      outbox.erase(lease);
    }
  }
  request.set_worker_id(worker_id);
  request.set_lease_id(lease);
  last_report[lease] = Clock::now();
  lock.unlock();
  v1::ReportResponse response;
  grpc::ClientContext context;
  Authorize(context, true);
  const grpc::Status s = stub->Report(&context, request, &response);
  lock.lock();
  Held* h = Find(lease);
  // A report the coordinator did not answer with OK took nothing: results are idempotent, so they are kept and
  // sent again until it has them, or the lease is known gone (forgotten: not kept at a registration, a drain, the
  // run's end). What can never be taken is dropped: a report refused as malformed or not understood, or one
  // result alone larger than the coordinator accepts.
  const int sent = request.results_size();
  const grpc::StatusCode code = s.error_code();
  const ReportHandling handling = report_handling(static_cast<int>(code), s.error_message(), sent);
  if (handling != ReportHandling::kTaken && handling != ReportHandling::kDrop) {
    // The session may be gone or no longer good (a restarted coordinator, a changed secret): registering again
    // tells which leases it still wants.
    if (handling == ReportHandling::kReconnect) Reconnect(s.error_message());
    if (h == nullptr) return;
    v1::ReportRequest& unsent = outbox[lease];  // keep them, before whatever finished meanwhile
    v1::ReportRequest again = std::move(request);
    again.clear_worker_id();
    again.clear_lease_id();
    for (const v1::PromptResult& r : unsent.results()) *again.add_results() = r;
    for (const v1::PromptFailure& f : unsent.failures()) *again.add_failures() = f;
    again.set_lease_done(again.lease_done() || unsent.lease_done());
    unsent = std::move(again);
    if (handling == ReportHandling::kSplit) {
      report_limit[lease] = std::max(1, sent / 2);
      spdlog::warn("report for lease {} too large for the coordinator ({}): sent again {} results at a time", lease,
                   s.error_message(), report_limit[lease]);
      return;
    }
    const int failures = ++report_failures[lease];
    if (Unexplained(code) && failures >= kMaxUnexplainedReportFailures) {
      spdlog::error("report for lease {} failed {} times in a row ({}): the lease is given up, its {} results "
                    "dropped; the coordinator runs its prompts elsewhere once it expires",
                    lease, failures, s.error_message(), unsent.results_size());
      Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kReport); });
      return Forget(lease);
    }
    retry_after[lease] = Clock::now() + std::min(kReportInterval * (1 << std::min(failures - 1, 4)), kReportBackoffMax);
    if (failures == 1 || failures % 10 == 0) {
      spdlog::warn("report for lease {} not taken ({}); its {} results are kept and sent again", lease,
                   s.error_message(), unsent.results_size());
    }
    return;
  }
  retry_after.erase(lease);
  report_failures.erase(lease);
  stats.prompts += request.results_size();
  if (s.ok()) {
    stats.accepted += response.accepted();
    stats.duplicates += response.duplicates();
    for (const v1::RefusedPrompt& r : response.refused()) {
      spdlog::warn("lease {} prompt {}: the coordinator did not take it ({})", lease, r.prompt(), r.reason());
      ++stats.refused;
    }
  } else {
    spdlog::error("the coordinator cannot take the report for lease {} ({}): its {} results are dropped", lease,
                  s.error_message(), request.results_size());
    Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kReport); });
  }
  if (h == nullptr) return;
  for (const v1::PromptResult& r : request.results()) h->open.erase(r.prompt());
  for (const v1::PromptFailure& f : request.failures()) h->open.erase(f.prompt());
  if (request.lease_done()) h->open.clear();  // the coordinator has what it did not run back in its queue
}

void WorkerClient::Impl::Heartbeat(std::unique_lock<std::mutex>& lock) {
  v1::HeartbeatRequest request;
  request.set_worker_id(worker_id);
  for (const auto& [id, h] : held) request.add_lease_ids(id);
  lock.unlock();
  grpc::ClientContext context;
  Authorize(context, true);
  v1::HeartbeatResponse response;
  const grpc::Status s = stub->Heartbeat(&context, request, &response);
  lock.lock();
  if (s.error_code() == grpc::StatusCode::NOT_FOUND) return Reconnect(s.error_message());
  if (!s.ok()) {
    // A heartbeat cut off because this worker is leaving, or cancelled by a coordinator that is shutting down
    // (its stream then says why, or breaks and the worker reconnects), is no failure.
    if (stopping || s.error_code() == grpc::StatusCode::CANCELLED) {
      spdlog::info("heartbeat not answered: {}", s.error_message());
    } else {
      spdlog::warn("heartbeat failed: {}", s.error_message());
    }
    return;
  }
  for (uint64_t id : response.cancelled_lease_ids()) Cancel(id);
}

void WorkerClient::Drain(bool immediately) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.draining && !immediately) return;
    m.draining = true;
    m.drain_now = immediately;
    m.wake.notify_all();
    if (!m.connected) return;  // Session() sends the drain once registered
  }
  m.SendDrain(immediately);
}

void WorkerClient::Impl::SendDrain(bool immediately) {
  v1::DrainRequest request;
  {
    std::lock_guard<std::mutex> lock(mu);
    request.set_worker_id(worker_id);
    // Leases not started go back; running ones too when leaving at once.
    std::vector<uint64_t> returned;
    for (const auto& l : queue) returned.push_back(l->id);
    if (immediately) {
      for (const auto& [id, h] : held) {
        if (std::find(returned.begin(), returned.end(), id) == returned.end()) returned.push_back(id);
      }
    }
    for (uint64_t id : returned) {
      request.add_returned_lease_ids(id);
      Forget(id);
    }
  }
  grpc::ClientContext context;
  Authorize(context, true);
  v1::DrainResponse response;
  const grpc::Status s = stub->Drain(&context, request, &response);
  if (!s.ok()) spdlog::warn("drain: {}", s.error_message());
  std::lock_guard<std::mutex> lock(mu);
  if ((immediately || !s.ok()) && stream_context != nullptr) stream_context->TryCancel();
  wake.notify_all();
}

}  // namespace namm::worker
