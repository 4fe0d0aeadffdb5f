#include "namm/coordinator/run_server.h"

#include <spdlog/spdlog.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "coordinator_metrics.h"
#include "namm/file_util.h"
#include "namm/metrics_endpoint.h"
#include "namm/coordinator/progress_log.h"
#include "worker_service.h"

namespace namm::coordinator {

namespace {

using Clock = std::chrono::steady_clock;

Result<std::shared_ptr<grpc::ServerCredentials>> Credentials(const ServerTls& tls) {
  if (tls.cert.empty() && tls.key.empty() && tls.client_ca.empty()) return grpc::InsecureServerCredentials();
  if (tls.cert.empty() || tls.key.empty()) {
    return Status::InvalidArgument("TLS needs both a certificate and a private key (PEM)");
  }
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  NAMM_ASSIGN_OR_RETURN(pair.cert_chain, read_file(tls.cert));
  NAMM_ASSIGN_OR_RETURN(pair.private_key, read_file(tls.key));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls.client_ca.empty()) {
    NAMM_ASSIGN_OR_RETURN(ssl.pem_root_certs, read_file(tls.client_ca));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

std::string Duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return buffer;
}

}  // namespace

struct RunServer::Impl {
  Impl(Store& s, Trainer& t, ProgressLog& l, PromptCosts c, ServeOptions o)
      : store(s), trainer(t), progress_log(l), costs(std::move(c)), options(std::move(o)) {}
  // The store's waits stop counting into the endpoint's registry, which goes with this (also when Start() fails
  // after attaching them).
  ~Impl() {
    if (options.store_waits != nullptr) options.store_waits->Detach();
  }

  Store& store;
  Trainer& trainer;
  ProgressLog& progress_log;
  PromptCosts costs;
  ServeOptions options;
  std::vector<LeaseRecord> recovered_leases;  // of the current generation, for the first phase to keep
  Clock::time_point last_stored;
  std::unique_ptr<WorkerService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<MetricsEndpoint> endpoint;
  std::unique_ptr<CoordinatorMetrics> metrics;  // with an endpoint only

  boost::asio::io_context io;
  boost::asio::steady_timer timer{io};
  std::set<std::pair<std::string, int64_t>> references_stored;  // by this process
  Status error;
  ServeOutcome outcome;
  bool stopping = false;
  bool lingering = false;  // the run finished; serving until options.linger passes or a stop request

  // Progress of the current phase and of the run in this process.
  Clock::time_point run_started, phase_started;
  int64_t phase_units = 0;
  double phase_cost = 0, cost_done = 0;  // of the units this process handed out (the ETA's pace)
  int64_t phase_references = 0, phase_references_stored = 0;
  double cache_sum = 0;
  int64_t cache_count = 0;

  Status StartPhase();
  // Stores the results accepted since the last call (they are in the progress log already). `durability`:
  // kWithNextCommit for the phase's last results, which the generation's commit takes to disk right after.
  Status Flush(Durability durability = Durability::kSynced);
  // A prompt's cost becomes the tokens a worker reported running for it (the data file's length is an estimate:
  // UTF-8 bytes / 4 undercounts Chinese about twice), for the leases of later phases.
  void LearnCost(const std::string& task, int64_t prompt, int64_t tokens) {
    const auto it = costs.find(task);
    if (tokens > 0 && it != costs.end() && prompt >= 0 && prompt < static_cast<int64_t>(it->second.size())) {
      it->second[static_cast<std::size_t>(prompt)] = static_cast<double>(tokens);
    }
  }
  // What a previous coordinator's progress log holds: its results of the current generation to the store, its
  // open leases kept for the first phase; the log then holds only those leases.
  Status Recover();
  void Tick();
  void Schedule();
  void Interrupt(const std::string& why);
  // A signal or Stop(): interrupts the run, or ends the linger.
  void StopRequested(const std::string& why);
  void Linger();
  void Fail(const Status& status);
  void ReportProgress(const AdvanceSummary& summary);
  // Drops prompts that failed on too many workers from the generation; an error once too many were dropped.
  Status DropAbandoned(const std::vector<AbandonedUnit>& abandoned);
  // Metrics of where the run stands, and (resumed) of the last generation it committed.
  Status StartMetrics();
};

Status check_serveable(const RunSpec& spec) {
  // Workers present what `namm-worker fingerprint` prints; a label could never match one.
  const std::string& f = spec.model.fingerprint;
  const bool worker_fingerprint = f.size() == 7 + 64 && f.rfind("sha256:", 0) == 0 &&
                                  std::all_of(f.begin() + 7, f.end(), [](char c) {
                                    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                                  });
  if (!worker_fingerprint) {
    return Status::InvalidArgument("model.fingerprint '" + spec.model.fingerprint +
                                   "' is not a worker fingerprint: put what `namm-worker fingerprint --model PATH` "
                                   "prints (sha256:<64 hex digits>) in the run spec");
  }
  return Status::Ok();
}

Result<std::unique_ptr<RunServer>> RunServer::Start(Store& store, Trainer& trainer, ProgressLog& log,
                                                    PromptCosts costs, ServeOptions options) {
  if (options.token.empty()) return Status::InvalidArgument("serving a run needs a shared secret for its workers");
  if (options.scheduler.lease_timeout < 3 * std::chrono::milliseconds(options.heartbeat_interval_ms)) {
    return Status::InvalidArgument("the lease timeout (" + std::to_string(options.scheduler.lease_timeout.count()) +
                                   " ms) must be at least 3 heartbeat intervals (" +
                                   std::to_string(options.heartbeat_interval_ms) + " ms each)");
  }
  NAMM_RETURN_IF_ERROR(check_serveable(trainer.spec()));
  auto impl = std::make_unique<Impl>(store, trainer, log, std::move(costs), std::move(options));
  const RunSpec& spec = trainer.spec();
  ServiceConfig config;
  config.token = impl->options.token;
  config.run_name = spec.name;
  config.model_fingerprint = spec.model.fingerprint;
  config.architecture_json = spec.architecture.ToJson();
  config.param_count = spec.architecture.param_count();
  config.rope_scaling = spec.model.rope_scaling;
  config.heartbeat_interval_ms = impl->options.heartbeat_interval_ms;
  config.max_streams_per_peer = impl->options.max_streams_per_peer;
  config.max_auth_failures_per_peer = impl->options.max_auth_failures_per_peer;
  Impl* m = impl.get();
  NAMM_ASSIGN_OR_RETURN(const int64_t epoch, store.NextLeaseEpoch(trainer.run_id()));
  impl->options.scheduler.first_lease_id = (static_cast<uint64_t>(epoch) << 32) + 1;
  ServiceHooks hooks;
  // The last result of a phase advances the run at once rather than at the next tick.
  hooks.phase_done = [m] {
    boost::asio::post(m->io, [m] {
      if (!m->stopping) m->Tick();
    });
  };
  hooks.log = [m](const ProgressEntries& entries) { return m->progress_log.Append(entries); };
  impl->service = std::make_unique<WorkerService>(config, impl->options.scheduler, std::move(hooks));

  NAMM_RETURN_IF_ERROR(impl->StartMetrics());
  NAMM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, Credentials(impl->options.tls));
  // Over TLS the secret is checked before a call's body is read (the server goes before the service: ~Impl).
  if (!impl->options.tls.cert.empty()) credentials->SetAuthMetadataProcessor(impl->service->SecretCheckBeforeBody());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(impl->options.listen, credentials, &impl->port);
  builder.SetMaxReceiveMessageSize(impl->options.max_message_bytes);
  // Pings find workers behind a dead connection (their streams then end and their leases go back), and workers
  // may ping to find a dead coordinator.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 20000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.RegisterService(impl->service.get());
  impl->server = builder.BuildAndStart();
  if (!impl->server || impl->port == 0) {
    return Status::FailedPrecondition("cannot listen on " + impl->options.listen +
                                      " (address in use, malformed, or not this host's)");
  }
  return std::unique_ptr<RunServer>(new RunServer(std::move(impl)));
}

RunServer::RunServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RunServer::~RunServer() {
  if (impl_->server) {
    impl_->service->End(v1::WorkBatch::END_SHUTDOWN);
    impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
}

int RunServer::port() const { return impl_->port; }

std::string RunServer::metrics_url() const { return impl_->endpoint ? impl_->endpoint->url() : ""; }

Status RunServer::Impl::StartMetrics() {
  if (options.metrics_listen.empty()) return Status::Ok();
  NAMM_ASSIGN_OR_RETURN(endpoint, MetricsEndpoint::Start(options.metrics_listen));
  metrics = std::make_unique<CoordinatorMetrics>(endpoint->registry(), trainer.spec());
  if (options.store_waits != nullptr) options.store_waits->Attach(endpoint->registry(), trainer.spec().name);
  NAMM_ASSIGN_OR_RETURN(std::vector<GenerationRecord> generations, store.GetGenerations(trainer.run_id()));
  // A finished run has no plan (the trainer resumes it without one): its position is its last generation's.
  if (trainer.finished() && !generations.empty()) {
    metrics->SetPosition(generations.back().stage, generations.back().generation, true);
  } else {
    metrics->SetPosition(trainer.plan().schedule.stage, trainer.plan().generation, trainer.finished());
  }
  const auto show = [&](const GenerationRecord& g) -> Status {
    NAMM_ASSIGN_OR_RETURN(auto stored, store.GetMetrics(trainer.run_id(), g.generation));
    metrics->ShowGeneration(g, stored);
    return Status::Ok();
  };
  // The last evaluation of the mean first: the last generation may not have one.
  const auto evaluated = std::find_if(generations.rbegin(), generations.rend(),
                                      [](const GenerationRecord& g) { return g.eval_fitness.has_value(); });
  if (evaluated != generations.rend()) NAMM_RETURN_IF_ERROR(show(*evaluated));
  if (!generations.empty()) NAMM_RETURN_IF_ERROR(show(generations.back()));
  return Status::Ok();
}

void RunServer::Stop() {
  boost::asio::post(impl_->io, [this] { impl_->StopRequested("stop requested"); });
}

void RunServer::Impl::StopRequested(const std::string& why) {
  if (!lingering) return Interrupt(why);
  spdlog::info("{}: stopping", why);
  io.stop();
}

void RunServer::Impl::Linger() {
  lingering = true;
  io.restart();  // a signal that arrived since the run finished is delivered now
  spdlog::info("run '{}' is finished; {} for {:.0f} s more (SIGTERM stops)", trainer.spec().name,
               endpoint ? "serving " + endpoint->url() : std::string("staying up"), options.linger.count());
  timer.expires_after(std::chrono::duration_cast<Clock::duration>(options.linger));
  timer.async_wait([this](const boost::system::error_code& ec) {
    if (!ec) io.stop();
  });
  io.run();
}

Result<ServeOutcome> RunServer::Run() {
  Impl& m = *impl_;
  m.run_started = Clock::now();
  // Registered before anything runs and kept through the linger: no signal falls between two handlers.
  boost::asio::signal_set signals(m.io);
  if (m.options.handle_signals) {
    signals.add(SIGTERM);
    signals.add(SIGINT);
    signals.async_wait([&m](const boost::system::error_code& ec, int signal) {
      if (!ec) m.StopRequested(signal == SIGTERM ? "SIGTERM" : "SIGINT");
    });
  }
  if (m.trainer.finished()) {
    m.service->End(v1::WorkBatch::END_RUN_FINISHED);
    m.outcome.finished = true;
  } else {
    NAMM_RETURN_IF_ERROR(m.Recover());
    NAMM_RETURN_IF_ERROR(m.StartPhase());
    m.Schedule();
    m.io.run();
  }
  if (m.outcome.finished && m.options.linger.count() > 0) m.Linger();
  signals.cancel();
  // Streams deliver their last message (run finished / shutting down) before the server goes.
  m.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  m.server.reset();
  if (!m.error.ok()) return m.error;
  m.outcome.next_generation = m.trainer.plan().generation;
  return m.outcome;
}

void RunServer::Impl::Schedule() {
  timer.expires_after(options.tick);
  timer.async_wait([this](const boost::system::error_code& ec) {
    if (!ec && !stopping) Tick();
  });
}

void RunServer::Impl::Fail(const Status& status) {
  error = status;
  spdlog::error("run '{}' stopped: {}", trainer.spec().name, status.ToString());
  service->End(v1::WorkBatch::END_SHUTDOWN);
  stopping = true;
  io.stop();
}

void RunServer::Impl::Interrupt(const std::string& why) {
  if (stopping) return;
  stopping = true;
  timer.cancel();
  // Every result accepted is stored (and its report answered), then no more are accepted: a restart leases only
  // what is missing, and workers keep what arrives after this for the next coordinator.
  const Status flushed = Flush();
  service->End(v1::WorkBatch::END_SHUTDOWN);
  if (!flushed.ok()) error = flushed;
  outcome.interrupted = true;
  const ServiceCounters c = service->counters();
  spdlog::info("{}: stopping at generation {} with {} of its {} units stored; the same command resumes the run", why,
               trainer.plan().generation, c.units_done, c.units_total);
  io.stop();
}

Status RunServer::Impl::StartPhase() {
  const GenerationPlan& plan = trainer.plan();
  NAMM_ASSIGN_OR_RETURN(std::vector<WorkUnit> missing, trainer.Missing());
  auto cost = [&](const std::string& task, int64_t prompt) {
    const auto it = costs.find(task);
    return it != costs.end() && prompt >= 0 && prompt < static_cast<int64_t>(it->second.size())
               ? it->second[static_cast<std::size_t>(prompt)]
               : 1.0;
  };
  std::vector<ScheduledUnit> units;
  auto phase = std::make_shared<PhaseData>();
  phase->generation = plan.generation;
  phase->collect_norm_stats = plan.collect_norm_stats;
  phase->norm_stats = plan.norm_stats;
  for (const WorkUnit& u : missing) {
    units.push_back({UnitKey{UnitKind::kCandidate, u.candidate, u.task, u.prompt}, cost(u.task, u.prompt)});
    if (phase->params.count(u.candidate) == 0) {
      const std::vector<double> x = plan.params_of(u.candidate);
      phase->params[u.candidate] = std::vector<float>(x.begin(), x.end());
    }
  }
  int64_t references = 0;
  for (const auto& [task, prompt] : plan.missing_references) {
    if (references_stored.count({task, prompt}) > 0) continue;
    units.push_back({UnitKey{UnitKind::kReference, 0, task, prompt}, cost(task, prompt)});
    ++references;
  }
  service->StartPhase(phase, units);
  // A decomposition and its snapshot, while the workers run the phase.
  if (const std::optional<int64_t> decomposing = trainer.BeginBackgroundWork()) {
    spdlog::info("generation {}: decomposing generation {}'s covariance and writing its snapshot in the background",
                 plan.generation, *decomposing);
  }
  if (!recovered_leases.empty()) {
    // A restart: what the previous coordinator had handed out stays with its holders for one lease timeout, so
    // that results they finish meanwhile are taken, not computed again.
    if (const int64_t kept = service->ReserveLeases(recovered_leases); kept > 0) {
      spdlog::info("generation {}: {} leases of the previous coordinator kept for their workers", plan.generation, kept);
    }
    recovered_leases.clear();
  }
  phase_started = Clock::now();
  phase_units = static_cast<int64_t>(units.size());
  phase_cost = 0;
  for (const ScheduledUnit& u : units) phase_cost += u.cost;
  phase_references = references;
  phase_references_stored = 0;
  cache_sum = 0;
  cache_count = 0;
  if (metrics) {
    metrics->SetPosition(plan.schedule.stage, plan.generation, false);
    metrics->PhaseStarted(phase_units);
  }
  spdlog::info("generation {}{}: {} units to run ({} base-model reference scores)", plan.generation,
               plan.collect_norm_stats ? " (normalization statistics)" : "", units.size(), references);
  return Status::Ok();
}

Status RunServer::Impl::Flush(Durability durability) {
  std::vector<EvaluationRecord> evaluations;
  std::vector<ReferenceResult> references;
  service->TakeResults(&evaluations, &references);
  last_stored = Clock::now();
  if (evaluations.empty() && references.empty()) return Status::Ok();
  const auto start = Clock::now();
  if (!references.empty()) {
    tasks::ReferenceScores scores;
    for (const ReferenceResult& r : references) NAMM_RETURN_IF_ERROR(scores.Set(r.task, r.prompt, r.score));
    NAMM_RETURN_IF_ERROR(store.ImportReferenceScores(trainer.spec().model.fingerprint, scores,
                                                     "computed by namm workers (full cache)", false)
                             .status());
    for (const ReferenceResult& r : references) references_stored.insert({r.task, r.prompt});
    phase_references_stored += static_cast<int64_t>(references.size());
  }
  if (!evaluations.empty()) {
    for (const EvaluationRecord& e : evaluations) {
      cache_sum += e.cache_size_mean;
      ++cache_count;
      LearnCost(e.task, e.prompt, e.prompt_tokens + e.generated_tokens);
    }
    NAMM_RETURN_IF_ERROR(trainer.Record(evaluations, durability).status());
  }
  if (metrics) {
    metrics->ResultsStored(static_cast<int64_t>(evaluations.size() + references.size()),
                           std::chrono::duration<double>(Clock::now() - start).count());
  }
  return Status::Ok();
}

Status RunServer::Impl::Recover() {
  NAMM_ASSIGN_OR_RETURN(const auto tokens, store.GetPromptTokens(trainer.run_id()));
  for (const auto& [key, n] : tokens) LearnCost(key.first, key.second, n);
  const ProgressEntries& log = progress_log.recovered();
  if (progress_log.ignored_bytes() > 0) {
    spdlog::warn("{}: ignored a torn tail of {} bytes (a crash in the middle of an append)", progress_log.path(),
                 progress_log.ignored_bytes());
  }
  const GenerationPlan& plan = trainer.plan();
  std::vector<EvaluationRecord> evaluations;
  for (const EvaluationRecord& e : log.evaluations) {
    const bool planned = std::binary_search(plan.units.begin(), plan.units.end(), WorkUnit{e.candidate, e.task, e.prompt});
    // Another generation's or phase's results are stored already (a generation is committed after its results).
    if (e.generation == plan.generation && planned && e.norm_stats.has_value() == plan.collect_norm_stats) {
      evaluations.push_back(e);
    }
  }
  NAMM_ASSIGN_OR_RETURN(const int64_t stored, trainer.Record(evaluations));
  if (!log.references.empty()) {
    tasks::ReferenceScores scores;
    for (const ReferenceResult& r : log.references) NAMM_RETURN_IF_ERROR(scores.Set(r.task, r.prompt, r.score));
    NAMM_RETURN_IF_ERROR(store.ImportReferenceScores(trainer.spec().model.fingerprint, scores,
                                                     "computed by namm workers (full cache)", false)
                             .status());
  }
  for (const LeaseRecord& l : log.leases_issued) {
    if (l.generation == plan.generation) recovered_leases.push_back(l);
  }
  if (stored > 0 || !recovered_leases.empty()) {
    spdlog::info("{}: {} results stored, {} leases still open", progress_log.path(), stored, recovered_leases.size());
  }
  // Its results are stored: a log that cannot start over now is no stop, as after a generation (Tick). Either
  // its records stay (a restart stores them again, which keeps what is stored) or it is empty and the next append
  // writes its header; only the open leases' records are then lost, and a restart would lease those prompts again.
  if (Status s = progress_log.Reset(recovered_leases); !s.ok()) {
    spdlog::warn("progress log: {} (the run goes on; appends retry it)", s.ToString());
  }
  return Status::Ok();
}

void RunServer::Impl::Tick() {
  service->ExpireLeases();
  const ServiceCounters counters = service->counters();  // one snapshot a tick, for the checks and the metrics
  // A progress log that cannot be written is no stop (WorkerService::Log): reports wait for it.
  if (const Status stop = DropAbandoned(counters.abandoned); !stop.ok()) {
    const Status flushed = Flush();  // keep what did finish
    return Fail(flushed.ok() ? stop : flushed);
  }
  const bool done = service->PhaseDone();  // before Flush: results are queued before their units count as done
  // Results are in the progress log as they come; the store takes them in batches, and all before the phase ends.
  if (done || Clock::now() - last_stored >= options.store_interval) {
    if (Status s = Flush(done ? Durability::kWithNextCommit : Durability::kSynced); !s.ok()) return Fail(s);
  }
  if (metrics) metrics->Observe(counters, phase_references - phase_references_stored);
  if (done) {
    Result<AdvanceSummary> summary = trainer.Advance();
    if (!summary.ok()) return Fail(summary.status());
    // The committed generation's progress is in the store: the log starts over for the next one. If it cannot,
    // its records stay (a restart ignores another generation's) and the next generation's follow them.
    if (Status s = progress_log.Reset(); !s.ok()) spdlog::warn("progress log: {}", s.ToString());
    ReportProgress(*summary);
    if (summary->finished) {
      service->End(v1::WorkBatch::END_RUN_FINISHED);
      outcome.finished = true;
      stopping = true;
      if (metrics) metrics->SetPosition(summary->stage, trainer.plan().generation, true);
      spdlog::info("run '{}' finished", trainer.spec().name);
      io.stop();
      return;
    }
    if (Status s = StartPhase(); !s.ok()) return Fail(s);
  }
  Schedule();
}

Status RunServer::Impl::DropAbandoned(const std::vector<AbandonedUnit>& abandoned) {
  for (const AbandonedUnit& a : abandoned) {
    NAMM_ASSIGN_OR_RETURN(DropCounts drops, trainer.Drop(a.key.task, a.key.prompt, a.last_error));
    service->DropPrompt(a.key.task, a.key.prompt);
    const std::string counts = std::to_string(drops.dropped) + " of the run's " + std::to_string(drops.planned) +
                               " prompts so far";
    if (drops.share() > options.max_dropped_share) {
      return Status::FailedPrecondition(
          a.key.task + " prompt " + std::to_string(a.key.prompt) + " failed on " + std::to_string(a.attempts) +
          " different workers (last error: " + a.last_error + "), and " + counts + " were dropped, more than " +
          fmt::format("{:g}", options.max_dropped_share * 100) + "% (--max-dropped-share): fix the cause and run the same command to resume");
    }
    spdlog::error("{} prompt {} failed on {} different workers (last error: {}): dropped from generation {} for "
                  "every candidate ({} dropped)",
                  a.key.task, a.key.prompt, a.attempts, a.last_error, trainer.plan().generation, counts);
  }
  return Status::Ok();
}

void RunServer::Impl::ReportProgress(const AdvanceSummary& summary) {
  PhaseProgress p;
  p.generation = summary.generation;
  p.statistics = summary.froze_norm_stats;
  p.units = phase_units;
  p.started = phase_started;
  p.finished = service->PhaseDoneAt();
  p.seconds = std::chrono::duration<double>(p.finished - p.started).count();
  const double rate = p.seconds > 0 ? static_cast<double>(phase_units) / p.seconds : 0;
  cost_done += phase_cost;
  char line[512];
  if (summary.froze_norm_stats) {
    std::snprintf(line, sizeof line, "generation %lld: normalization statistics frozen | %.1f units/s",
                  static_cast<long long>(summary.generation), rate);
  } else {
    p.record = summary.record;
    const GenerationRecord& r = summary.record;
    // The work left (each remaining generation at its stage's cost) at this process's pace so far.
    const double elapsed = std::chrono::duration<double>(Clock::now() - run_started).count();
    const double eta =
        cost_done > 0 ? remaining_cost(trainer.spec(), costs, summary.generation + 1) * elapsed / cost_done : 0;
    std::snprintf(line, sizeof line,
                  "generation %lld (stage %lld) | best %.4f | mean %.4f +- %.4f | sigma %.5f | cache %.0f | "
                  "%.1f units/s | ETA %s",
                  static_cast<long long>(r.generation), static_cast<long long>(r.stage), r.fitness_best, r.fitness_mean,
                  r.fitness_std, r.sigma, cache_count > 0 ? cache_sum / static_cast<double>(cache_count) : 0.0,
                  rate, Duration(eta).c_str());
    if (metrics) metrics->GenerationCommitted(summary, p.seconds, eta);
  }
  p.line = line;
  if (options.progress) options.progress(p);
  spdlog::info("{}", p.line);
}

}  // namespace namm::coordinator
