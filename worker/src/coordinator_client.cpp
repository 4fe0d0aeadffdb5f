#include "namm/worker/coordinator_client.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "namm/file_util.h"
#include "namm/v1/coordinator.grpc.pb.h"
#include "namm/v1/norm_stats_proto.h"
#include "namm/worker/worker_metrics.h"

namespace namm::worker {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kCallTimeout = std::chrono::seconds(10);
// A lease's results are sent as they come, at most this often, and when the lease is done.
constexpr auto kReportInterval = std::chrono::milliseconds(500);
constexpr int kReportAttempts = 3;

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

}  // namespace

struct WorkerClient::Impl {
  Impl(WorkerClientOptions o, LeaseExecutor& e) : options(std::move(o)), executor(e) {}

  WorkerClientOptions options;
  LeaseExecutor& executor;
  std::unique_ptr<v1::Coordinator::Stub> stub;

  mutable std::mutex mu;
  std::condition_variable wake;
  // The current session.
  std::string worker_id;
  bool session_over = true;
  std::deque<std::shared_ptr<LeaseWork>> queue;              // received, not started
  std::map<uint64_t, std::shared_ptr<LeaseWork>> in_flight;  // received, not finished
  std::set<uint64_t> cancelled;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const std::vector<float>>> params;
  grpc::ClientContext* stream_context = nullptr;
  int heartbeat_ms = 2000;
  // Across sessions.
  bool draining = false, drain_now = false;
  WorkerClientStats stats;

  // Metrics, when the options carry them.
  template <typename F>
  void Metrics(F&& f) const {
    if (options.metrics != nullptr) f(*options.metrics);
  }
  // Drops a lease from in_flight (mu held); true when it was there.
  bool Forget(uint64_t id) {
    if (in_flight.erase(id) == 0) return false;
    Metrics([](WorkerMetrics& w) { w.LeasesInFlight(-1); });
    return true;
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
  void HeartbeatLoop();
  // Sends the lease's results and failures (cleared on return); retries while the coordinator is unreachable.
  void Report(const std::string& session_worker_id, uint64_t lease, v1::ReportRequest* request);
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

  auto backoff = m.options.backoff_initial;
  while (true) {
    Impl::SessionEnd end = m.Session();
    if (!end.fatal.ok()) return end.fatal;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      if (m.draining || end.end == v1::WorkBatch::END_DRAINED) return Status::Ok();
    }
    if (end.end == v1::WorkBatch::END_RUN_FINISHED && m.options.exit_when_done) return Status::Ok();
    if (end.registered) backoff = m.options.backoff_initial;
    std::unique_lock<std::mutex> lock(m.mu);
    if (m.wake.wait_for(lock, backoff, [&] { return m.draining; })) return Status::Ok();
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
  caps->set_max_concurrent_leases(options.concurrency);
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
    worker_id = response.worker_id();
    heartbeat_ms = std::max(50, response.heartbeat_interval_ms());
    session_over = false;  // queue and in_flight were emptied when the last session ended
    cancelled.clear();
    params.clear();
    stream_context = &stream;
    ++stats.sessions;
  }
  Metrics([](WorkerMetrics& w) { w.Connected(+1); });
  v1::LeasesRequest leases_request;
  leases_request.set_worker_id(response.worker_id());
  std::unique_ptr<grpc::ClientReader<v1::WorkBatch>> reader = stub->Leases(&stream, leases_request);
  std::vector<std::thread> threads;
  for (int slot = 0; slot < options.concurrency; ++slot) threads.emplace_back([this, slot] { ExecutorLoop(slot); });
  threads.emplace_back([this] { HeartbeatLoop(); });
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
    session_over = true;
    stream_context = nullptr;
    wake.notify_all();
  }
  for (std::thread& t : threads) t.join();
  {
    // Leases never started die with the session: the coordinator hands them out again.
    std::lock_guard<std::mutex> lock(mu);
    queue.clear();
    for (auto it = in_flight.begin(); it != in_flight.end();) Forget((it++)->first);
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
    if (in_flight.emplace(work->id, work).second) Metrics([](WorkerMetrics& w) { w.LeasesInFlight(+1); });
    queue.push_back(std::move(work));
    ++stats.leases;
  }
  for (uint64_t id : batch.cancelled_lease_ids()) {
    cancelled.insert(id);
    ++stats.cancelled;
  }
  wake.notify_all();
}

void WorkerClient::Impl::ExecutorLoop(int slot) {
  while (true) {
    std::shared_ptr<LeaseWork> lease;
    std::string session_worker_id;  // the lease belongs to this session, even if a new one starts meanwhile
    {
      std::unique_lock<std::mutex> lock(mu);
      wake.wait(lock, [&] { return session_over || !queue.empty(); });
      if (session_over) return;
      lease = std::move(queue.front());
      queue.pop_front();
      session_worker_id = worker_id;
    }
    v1::ReportRequest unsent;
    Clock::time_point last_report = Clock::now();
    bool complete = true;
    for (int64_t prompt : lease->prompts) {
      {
        std::lock_guard<std::mutex> lock(mu);
        complete = !(session_over || drain_now || cancelled.count(lease->id) > 0);
        if (!complete) break;
      }
      Result<PromptOutcome> r = executor.RunPrompt(*lease, prompt, slot);
      if (!r.ok()) {
        // Reported as failed: the prompt runs elsewhere, and one that fails everywhere stops the run.
        spdlog::error("lease {} ({} prompt {}): {}", lease->id, lease->task, prompt, r.status().ToString());
        v1::PromptFailure* failure = unsent.add_failures();
        failure->set_prompt(prompt);
        failure->set_error(r.status().ToString().substr(0, 2048));
        Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kPrompt); });
        std::lock_guard<std::mutex> lock(mu);
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
      if (Clock::now() - last_report >= kReportInterval) {
        Report(session_worker_id, lease->id, &unsent);
        last_report = Clock::now();
      }
    }
    Report(session_worker_id, lease->id, &unsent);
    if (complete) Metrics([](WorkerMetrics& w) { w.LeaseDone(); });
    std::lock_guard<std::mutex> lock(mu);
    Forget(lease->id);
    cancelled.erase(lease->id);
  }
}

void WorkerClient::Impl::Report(const std::string& session_worker_id, uint64_t lease, v1::ReportRequest* request) {
  if (request->results_size() + request->failures_size() == 0) return;
  request->set_worker_id(session_worker_id);
  request->set_lease_id(lease);
  v1::ReportResponse response;
  grpc::Status s;
  for (int attempt = 1; attempt <= kReportAttempts; ++attempt) {
    grpc::ClientContext context;
    Authorize(context, true);
    s = stub->Report(&context, *request, &response);
    // Results are idempotent, so resending after a lost answer is harmless.
    const bool transient = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!transient || attempt == kReportAttempts) break;
    std::this_thread::sleep_for(kReportInterval * attempt);
  }
  std::lock_guard<std::mutex> lock(mu);
  stats.prompts += request->results_size();
  if (s.ok()) {
    stats.accepted += response.accepted();
    stats.duplicates += response.duplicates();
  } else {
    spdlog::warn("report for lease {} not taken: {}", lease, s.error_message());
    Metrics([](WorkerMetrics& w) { w.Error(WorkerError::kReport); });
  }
  request->Clear();
}

void WorkerClient::Impl::HeartbeatLoop() {
  std::unique_lock<std::mutex> lock(mu);
  while (!wake.wait_for(lock, std::chrono::milliseconds(heartbeat_ms), [&] { return session_over; })) {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker_id);
    for (const auto& [id, lease] : in_flight) request.add_lease_ids(id);
    lock.unlock();
    grpc::ClientContext context;
    Authorize(context, true);
    v1::HeartbeatResponse response;
    const grpc::Status s = stub->Heartbeat(&context, request, &response);
    lock.lock();
    if (s.error_code() == grpc::StatusCode::NOT_FOUND && stream_context != nullptr) {
      spdlog::warn("the coordinator no longer knows this worker ({}); registering again", s.error_message());
      stream_context->TryCancel();
      continue;
    }
    if (!s.ok()) {
      spdlog::warn("heartbeat failed: {}", s.error_message());
      continue;
    }
    for (uint64_t id : response.cancelled_lease_ids()) {
      cancelled.insert(id);
      const auto queued = std::find_if(queue.begin(), queue.end(), [&](const auto& l) { return l->id == id; });
      if (queued != queue.end()) {  // never started: forget it entirely
        queue.erase(queued);
        Forget(id);
      }
    }
  }
}

void WorkerClient::Drain(bool immediately) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.draining && !immediately) return;
    m.draining = true;
    m.drain_now = immediately;
    m.wake.notify_all();
    if (m.session_over) return;  // Session() sends the drain once registered
  }
  m.SendDrain(immediately);
}

void WorkerClient::Impl::SendDrain(bool immediately) {
  v1::DrainRequest request;
  {
    std::lock_guard<std::mutex> lock(mu);
    request.set_worker_id(worker_id);
    // Leases not started go back; running ones too when leaving at once.
    for (const auto& l : queue) {
      request.add_returned_lease_ids(l->id);
      Forget(l->id);
    }
    queue.clear();
    if (immediately) {
      for (const auto& [id, l] : in_flight) request.add_returned_lease_ids(id);
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
