// serve: a run's coordinator service for remote workers (namm-worker serve), until the schedule is done or a
// signal stops it. run: the same service plus N local namm-worker processes, with a progress line per
// generation. Both resume the run a database already holds.
#include <algorithm>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "commands.h"
#include "namm/coordinator/run_server.h"
#include "namm/file_util.h"
#include "namm/tasks/task_path_options.h"

extern char** environ;

namespace namm::coordinator::cli {

namespace {

struct ServeFlags {
  std::string config, db, listen = "127.0.0.1:50051", token_file, log_level = "info";
  ServerTls tls;
  bool insecure_plaintext = false;
  tasks::TaskPathFlags paths;
  int64_t prompts_per_lease = 4;
  double lease_timeout_s = 30;
  int max_copies = 2;
  int max_attempts = 5;
  int quarantine_after = 3;
  double max_dropped_share = 0.05;
  int heartbeat_ms = 2000;
  int store_interval_ms = 2000;
  int io_error_patience_s = 600;
  int max_streams_per_peer = 256;
  int max_auth_failures_per_peer = 20;
  int max_message_bytes = 4 << 20;
  std::string metrics_listen;
  // serve only
  double linger_s = 0;
  // run only
  int local_workers = 0;
  std::string worker_binary;
  int worker_threads = 0;
  std::vector<std::string> worker_devices;  // assigned to local workers in turn
  std::string worker_dtype;                 // passed to local workers ("": their default)
  int worker_max_batch = 0;                 // passed to local workers (0: their default)
};

// "cpu", "cuda" or "cuda:N": what namm-worker --device takes (it checks that the device exists).
bool IsDeviceName(const std::string& d) {
  if (d == "cpu" || d == "cuda") return true;
  return d.size() > 5 && d.compare(0, 5, "cuda:") == 0 &&
         std::all_of(d.begin() + 5, d.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The run of `spec` in `store`, resumed when the database holds it (the spec edited only where the trajectory
// stays the same), else created; the run's lock (Store::LockRun: the database file's, whatever path names it) and
// its progress log, both held from before the trainer touches the store: a second coordinator of the run stops
// here, naming the first.
struct OpenedRun {
  std::unique_ptr<ProgressLog> log;
  std::unique_ptr<Trainer> trainer;  // goes first (background work included), then the lock
};

// Refused with who holds the run, as its progress log names them.
Status LockRun(Store& store, const RunSpec& spec, int64_t run_id) {
  const Status locked = store.LockRun(run_id);
  if (locked.code() != Status::Code::kFailedPrecondition) {
    return locked.ok() ? locked : locked.WithContext("run '" + spec.name + "' in " + store.path());
  }
  const std::string holder = progress_log_holder(progress_log_path(store.path(), run_id));
  return Status::FailedPrecondition("run '" + spec.name + "' in " + store.path() +
                                    ": another coordinator serves this run (" +
                                    (holder.empty() ? std::string("its pid and host unknown") : holder) + "; " +
                                    locked.message() + "): stop it first, or let it finish");
}

Result<OpenedRun> OpenRun(Store& store, const RunSpec& spec, const std::string& config,
                          const std::map<std::string, int64_t>& rows) {
  std::optional<RunRecord> stored;
  NAMM_ASSIGN_OR_RETURN(std::vector<RunRecord> runs, store.ListRuns());
  for (RunRecord& run : runs) {
    if (run.name == spec.name) stored = std::move(run);
  }
  OpenedRun opened;
  if (!stored) {
    spdlog::info("starting run '{}' in {}", spec.name, store.path());
    Result<int64_t> created = Trainer::WriteNewRun(store, spec);
    if (!created.ok()) {
      // Another coordinator may have created it meanwhile: then its lock decides.
      NAMM_ASSIGN_OR_RETURN(runs, store.ListRuns());
      const auto it = std::find_if(runs.begin(), runs.end(), [&](const RunRecord& r) { return r.name == spec.name; });
      if (it == runs.end()) return created.status();
      stored = *it;
    } else {
      NAMM_RETURN_IF_ERROR(LockRun(store, spec, *created));
      NAMM_ASSIGN_OR_RETURN(opened.log, ProgressLog::Open(progress_log_path(store.path(), *created)));
      NAMM_ASSIGN_OR_RETURN(opened.trainer, Trainer::Resume(store, *created, rows));
      return opened;
    }
  }
  NAMM_RETURN_IF_ERROR(LockRun(store, spec, stored->id));
  Result<std::unique_ptr<ProgressLog>> log = ProgressLog::Open(progress_log_path(store.path(), stored->id));
  if (!log.ok()) return log.status().WithContext("run '" + spec.name + "' in " + store.path());
  opened.log = std::move(*log);
  Result<std::vector<SpecDifference>> revised = Trainer::ReviseSpec(store, stored->id, spec);
  if (!revised.ok()) {
    return revised.status().WithContext("run '" + spec.name + "' in " + store.path() + " cannot resume from " +
                                        config + " (namm-coordinator status shows the stored spec; rename the "
                                        "run or use another database to start afresh)");
  }
  for (const SpecDifference& d : *revised) {
    spdlog::info("run '{}': {} changed from {} to {}", spec.name, d.key, d.stored, d.given);
  }
  spdlog::info("resuming run '{}' (run {}) at generation {}", spec.name, stored->id, stored->generation);
  NAMM_ASSIGN_OR_RETURN(opened.trainer, Trainer::Resume(store, stored->id, rows));
  return opened;
}

Status ApplyLogLevel(const std::string& level) {
  const spdlog::level::level_enum l = spdlog::level::from_str(level);
  if (l == spdlog::level::off && level != "off") {
    return Status::InvalidArgument("--log-level must be trace, debug, info, warn, error or off, got '" + level + "'");
  }
  spdlog::set_level(l);
  return Status::Ok();
}

// A fresh shared secret for local workers, in a private file.
Result<std::string> WriteLocalToken(const std::string& dir) {
  const std::string token = random_hex(48);
  const std::string path = dir + "/token";
  NAMM_RETURN_IF_ERROR(write_file_atomically(path, {token}));
  if (::chmod(path.c_str(), 0600) != 0) return Status::IOError(path + ": cannot restrict permissions");
  return path;
}

// Local worker i serves its metrics on the coordinator's port + 1 + i (or a free port when that is 0; the worker
// logs it). Empty when that port does not exist.
std::string WorkerMetricsAddress(const std::string& coordinator, int i) {
  const std::size_t colon = coordinator.rfind(':');
  const int port = std::atoi(coordinator.c_str() + colon + 1);
  if (port > 0 && port + 1 + i > 65535) return "";
  return coordinator.substr(0, colon + 1) + std::to_string(port == 0 ? 0 : port + 1 + i);
}

// namm-worker beside this binary, unless given.
std::string WorkerBinary(const std::string& given) {
  if (!given.empty()) return given;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "namm-worker";
  self[n] = '\0';
  return parent_directory(self) + "/namm-worker";
}

// Copies a local worker's output to this process's stderr a whole line at a time, each line prefixed with the
// worker's name: lines of several workers never mix mid-line.
class LineRelay {
 public:
  LineRelay(int fd, std::string prefix) : fd_(fd), prefix_(std::move(prefix)), thread_([this] { Loop(); }) {}
  ~LineRelay() {
    thread_.join();  // the worker has exited: the pipe is at its end
    ::close(fd_);
  }

 private:
  void Loop() {
    std::string pending;
    char buffer[4096];
    for (ssize_t n; (n = ::read(fd_, buffer, sizeof buffer)) != 0;) {
      if (n < 0) {
        if (errno == EINTR) continue;
        break;
      }
      pending.append(buffer, static_cast<std::size_t>(n));
      for (std::size_t end; (end = pending.find('\n')) != std::string::npos; pending.erase(0, end + 1)) {
        Emit(pending.substr(0, end));
      }
    }
    if (!pending.empty()) Emit(pending);
  }
  void Emit(const std::string& line) {
    static std::mutex mu;  // one line at a time across relays
    const std::string out = prefix_ + line + "\n";
    std::lock_guard<std::mutex> lock(mu);
    for (std::size_t at = 0; at < out.size();) {
      const ssize_t n = ::write(STDERR_FILENO, out.data() + at, out.size() - at);
      if (n <= 0 && errno != EINTR) return;
      if (n > 0) at += static_cast<std::size_t>(n);
    }
  }

  const int fd_;
  const std::string prefix_;
  std::thread thread_;
};

// Local worker processes: started with the run's model, watched, stopped; their output relayed line by line.
class LocalWorkers {
 public:
  ~LocalWorkers() {
    Stop(std::chrono::seconds(0));
    relays_.clear();
  }

  Status Start(const ServeFlags& f, const RunSpec& spec, int port, const std::string& token_file) {
    const std::string binary = WorkerBinary(f.worker_binary);
    if (::access(binary.c_str(), X_OK) != 0) {
      return Status::NotFound(binary + ": no namm-worker executable there (give --worker-binary)");
    }
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int threads = f.worker_threads > 0 ? f.worker_threads : std::max(1, cores / f.local_workers);
    for (int i = 0; i < f.local_workers; ++i) {
      std::vector<std::string> args = {binary, "serve", "--coordinator", "127.0.0.1:" + std::to_string(port),
                                       "--model", spec.model.path, "--token-file", token_file, "--exit-when-done",
                                       "--name", "local-" + std::to_string(i), "--threads", std::to_string(threads),
                                       "--insecure-plaintext",  // loopback
                                       "--log-level", f.log_level == "info" ? "warn" : f.log_level};
      if (!f.worker_dtype.empty()) args.insert(args.end(), {"--dtype", f.worker_dtype});
      if (f.worker_max_batch > 0) args.insert(args.end(), {"--max-batch", std::to_string(f.worker_max_batch)});
      if (!f.worker_devices.empty()) {
        args.insert(args.end(), {"--device", f.worker_devices[static_cast<std::size_t>(i) % f.worker_devices.size()]});
      }
      if (!spec.model.tokenizer.empty()) args.insert(args.end(), {"--tokenizer", spec.model.tokenizer});
      if (!f.metrics_listen.empty()) {
        const std::string address = WorkerMetricsAddress(f.metrics_listen, i);
        if (address.empty()) {
          return Status::InvalidArgument("--metrics-listen " + f.metrics_listen + ": local worker " +
                                         std::to_string(i) + " would serve its metrics past port 65535");
        }
        args.insert(args.end(), {"--metrics-listen", address});
        if (address.substr(address.rfind(':')) != ":0") {
          std::cout << "worker " << i << " metrics: http://" << address << "/metrics" << std::endl;
        }
      }
      if (!f.paths.tasks_dir.empty()) args.insert(args.end(), {"--tasks-dir", f.paths.tasks_dir});
      for (const std::string& d : f.paths.data_dirs) args.insert(args.end(), {"--data-dir", d});
      for (const std::string& d : f.paths.config_dirs) args.insert(args.end(), {"--config-dir", d});
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      int out[2];
      if (::pipe2(out, O_CLOEXEC) != 0) return Status::IOError(std::string("pipe: ") + std::strerror(errno));
      posix_spawn_file_actions_t actions;
      posix_spawn_file_actions_init(&actions);
      posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
      posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
      pid_t pid = 0;
      const int err = ::posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv.data(), environ);
      posix_spawn_file_actions_destroy(&actions);
      ::close(out[1]);
      if (err != 0) {
        ::close(out[0]);
        return Status::IOError("cannot start " + binary + ": " + std::strerror(err));
      }
      pids_.push_back(pid);
      relays_.push_back(std::make_unique<LineRelay>(out[0], "[local-" + std::to_string(i) + "] "));
    }
    return Status::Ok();
  }

  // Reaps workers that exited; returns how many are still running. Failures are logged once.
  int Poll() {
    int running = 0;
    for (pid_t& pid : pids_) {
      if (pid <= 0) continue;
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == 0) {
        ++running;
        continue;
      }
      if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        last_failure_ = WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status))
                                          : "signal " + std::to_string(WTERMSIG(status));
        spdlog::warn("local worker (pid {}) ended with {}", pid, last_failure_);
      }
      pid = 0;
    }
    return running;
  }

  // Waits up to `grace` for the workers to leave on their own, then drains them (SIGTERM), then kills them.
  void Stop(std::chrono::milliseconds grace) {
    const auto wait = [&](std::chrono::milliseconds limit) {
      const auto end = std::chrono::steady_clock::now() + limit;
      while (Poll() > 0 && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    };
    wait(grace);
    for (pid_t pid : pids_) {
      if (pid > 0) ::kill(pid, SIGTERM);
    }
    wait(std::chrono::seconds(10));
    for (pid_t pid : pids_) {
      if (pid > 0) ::kill(pid, SIGKILL);
    }
    wait(std::chrono::seconds(5));
  }

  const std::string& last_failure() const { return last_failure_; }

 private:
  std::vector<pid_t> pids_;
  std::vector<std::unique_ptr<LineRelay>> relays_;
  std::string last_failure_;
};

Status Serve(const ServeFlags& f) {
  NAMM_RETURN_IF_ERROR(ApplyLogLevel(f.log_level));
  NAMM_ASSIGN_OR_RETURN(RunSpec spec, load_run_spec(f.config));
  NAMM_RETURN_IF_ERROR(check_serveable(spec));  // before the run is created in the database
  if (f.local_workers == 0 && f.tls.cert.empty()) {
    if (!f.insecure_plaintext) {
      return Status::InvalidArgument("serve needs TLS: give --tls-cert and --tls-key (and --tls-client-ca to admit "
                                     "only workers with a certificate), or --insecure-plaintext on a trusted network");
    }
    spdlog::warn("serving in plaintext (--insecure-plaintext): the shared secret and every result cross the network "
                 "unencrypted");
  }
  // Every worker connection is a descriptor, as are the database's: at a soft limit of 1,024 (systemd's), 60 idle
  // connections under `ulimit -n 64` made the store's next open fail (SQLITE_CANTOPEN) and stopped the run.
  if (const Result<int64_t> files = raise_open_file_limit(); !files.ok()) {
    spdlog::warn("{}", files.status().ToString());
  } else {
    spdlog::debug("open files: at most {}", *files);
  }
  NAMM_ASSIGN_OR_RETURN(tasks::TaskPaths paths, tasks::task_paths_from_flags(f.paths));
  NAMM_ASSIGN_OR_RETURN(PromptCosts costs, load_prompt_costs(spec.all_tasks(), paths));
  // Waits for the database (another process holding its lock, a slow disk) are retried for as long as they
  // last, I/O errors that can pass (EIO, a full disk, EMFILE) for --io-error-patience; each is logged and counted.
  StoreWaits store_waits;
  StoreOptions store_options;
  store_options.on_wait = store_waits.Observer();
  store_options.io_error_patience = std::chrono::seconds(f.io_error_patience_s);
  store_options.checkpoint_elsewhere = true;  // the trainer's background compaction checkpoints
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Open(f.db, OpenMode::kCreate, store_options));
  NAMM_ASSIGN_OR_RETURN(OpenedRun run, OpenRun(*store, spec, f.config, row_counts(costs)));
  Trainer& trainer = *run.trainer;

  ServeOptions options;
  options.listen = f.local_workers > 0 ? "127.0.0.1:0" : f.listen;
  options.tls = f.tls;
  options.scheduler.max_prompts_per_lease = f.prompts_per_lease;
  options.scheduler.lease_timeout = std::chrono::milliseconds(static_cast<int64_t>(f.lease_timeout_s * 1000));
  options.scheduler.max_copies = f.max_copies;
  options.scheduler.max_attempts = f.max_attempts;
  options.scheduler.quarantine_after = f.quarantine_after;
  options.max_dropped_share = f.max_dropped_share;
  options.heartbeat_interval_ms = f.heartbeat_ms;
  options.store_interval = std::chrono::milliseconds(f.store_interval_ms);
  options.max_streams_per_peer = f.max_streams_per_peer;
  options.max_auth_failures_per_peer = f.max_auth_failures_per_peer;
  options.max_message_bytes = f.max_message_bytes;
  options.metrics_listen = f.metrics_listen;
  options.linger = std::chrono::duration<double>(f.linger_s);
  options.store_waits = &store_waits;

  // Local workers get a fresh secret in a private directory, removed at the end.
  std::string scratch;
  if (f.local_workers > 0) {
    char pattern[] = "/tmp/namm-run-XXXXXX";
    if (::mkdtemp(pattern) == nullptr) return Status::IOError("cannot create a private directory in /tmp");
    scratch = pattern;
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      if (!dir.empty()) std::filesystem::remove_all(dir);
    }
  } cleanup{scratch};
  std::string token_file = f.token_file;
  if (f.local_workers > 0) {
    NAMM_ASSIGN_OR_RETURN(token_file, WriteLocalToken(scratch));
    options.progress = [](const PhaseProgress& p) { std::cout << p.line << std::endl; };
  }
  NAMM_ASSIGN_OR_RETURN(options.token, read_secret_file(token_file));

  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<RunServer> server,
                        RunServer::Start(*store, trainer, *run.log, std::move(costs), std::move(options)));
  spdlog::info("serving run '{}' on port {}", spec.name, server->port());
  if (!server->metrics_url().empty()) {
    spdlog::info("metrics of run '{}' at {}", spec.name, server->metrics_url());
    if (f.local_workers > 0) std::cout << "coordinator metrics: " << server->metrics_url() << std::endl;
  }

  LocalWorkers workers;
  std::atomic<bool> serving{true};
  std::thread watcher;
  std::string workers_gone;
  if (f.local_workers > 0) {
    NAMM_RETURN_IF_ERROR(workers.Start(f, spec, server->port(), token_file));
    // Without any worker left the run cannot progress: stop rather than wait forever.
    watcher = std::thread([&] {
      while (serving) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        if (serving && workers.Poll() == 0) {
          workers_gone = "every local worker exited (last failure: " +
                         (workers.last_failure().empty() ? std::string("none") : workers.last_failure()) + ")";
          server->Stop();
          return;
        }
      }
    });
  }
  Result<ServeOutcome> outcome = server->Run();
  serving = false;
  if (watcher.joinable()) watcher.join();
  // Finished: workers leave on their own; interrupted: they drain.
  workers.Stop(outcome.ok() && outcome->finished ? std::chrono::seconds(10) : std::chrono::seconds(0));
  if (!outcome.ok()) {
    return outcome.status().WithNote("what the run stored so far is kept: once the cause is fixed, the same "
                                     "namm-coordinator " + std::string(f.local_workers > 0 ? "run" : "serve") +
                                     " command resumes it");
  }
  if (!workers_gone.empty() && !outcome->finished) {
    return Status::FailedPrecondition(workers_gone + "; the run stopped at generation " +
                                      std::to_string(outcome->next_generation) + " and resumes with the same command");
  }
  if (outcome->finished) {
    std::cout << "run '" << spec.name << "' finished; export the result with: namm-coordinator export --db " << f.db
              << " --best --out FILE" << std::endl;
  } else {
    std::cout << "run '" << spec.name << "' stopped at generation " << outcome->next_generation
              << "; the same command resumes it" << std::endl;
  }
  return Status::Ok();
}

void AddCommonOptions(CLI::App* cmd, ServeFlags& f) {
  cmd->add_option("--config", f.config, "Run spec (YAML), e.g. coordinator/runs/stories-cpu.yaml")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--db", f.db, "Run database (created if missing; a run it holds is resumed)")->required();
  tasks::add_task_path_options(cmd, f.paths);
  cmd->add_option("--prompts-per-lease", f.prompts_per_lease, "Prompts of one candidate and task per lease (default 4)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--lease-timeout", f.lease_timeout_s,
                  "Seconds without a heartbeat before a lease goes to another worker (default 30)")
      ->check(CLI::Range(0.1, 86400.0));
  cmd->add_option("--max-copies", f.max_copies,
                  "Workers running one prompt at once, straggler copies included (default 2; 1 disables copies)")
      ->check(CLI::Range(1, 16));
  cmd->add_option("--max-attempts", f.max_attempts,
                  "Different workers a prompt may report as failed before it is dropped from its generation "
                  "(default 5; crashes, disconnections and expired leases use no attempt)")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--max-dropped-share", f.max_dropped_share,
                  "Share of the run's prompts that may be dropped before the run stops instead (default 0.05)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--quarantine-after", f.quarantine_after,
                  "Prompt failures in a row after which a worker gets no more work (default 3)")
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--heartbeat-ms", f.heartbeat_ms, "How often workers send heartbeats (default 2000)")
      ->check(CLI::Range(50, 600000));
  cmd->add_option("--max-streams-per-peer", f.max_streams_per_peer,
                  "Lease streams one address may hold open (default 256; 0: no limit)")
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--max-auth-failures-per-peer", f.max_auth_failures_per_peer,
                  "Authentication failures one address may have within a minute before its calls are refused for "
                  "a minute (default 20; 0: no limit)")
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--store-interval-ms", f.store_interval_ms,
                  "How often accepted results are written to the database (default 2000; they are in the "
                  "progress log beside it at once)")
      ->check(CLI::Range(10, 600000));
  cmd->add_option("--io-error-patience", f.io_error_patience_s,
                  "Seconds the database's I/O errors that can pass (EIO, a full disk, too many open files) are "
                  "retried before the run stops (default 600; the progress log's are retried for as long as they "
                  "last; a stop signal takes effect when a wait ends)")
      ->check(CLI::Range(0, 86400 * 7));
  cmd->add_option("--max-message-bytes", f.max_message_bytes,
                  "Largest message accepted from a worker (default 4 MiB; a report of 1,024 prompts with statistics "
                  "is about 0.4 MiB)")
      ->check(CLI::Range(4096, 1 << 30));
  cmd->add_option("--log-level", f.log_level, "trace, debug, info (default), warn, error or off");
  cmd->add_option("--metrics-listen", f.metrics_listen,
                  "HOST:PORT to serve Prometheus metrics on at /metrics (default: none; port 0 picks a free one)");
}

}  // namespace

void AddServeCommands(CLI::App& app, Action& run) {
  auto s = std::make_shared<ServeFlags>();
  CLI::App* serve = app.add_subcommand("serve", "Serve a run to remote workers (namm-worker serve) over gRPC");
  AddCommonOptions(serve, *s);
  serve->add_option("--listen", s->listen, "HOST:PORT to listen on (default 127.0.0.1:50051)");
  serve->add_option("--token-file", s->token_file, "File holding the shared secret workers must present (>= 16 "
                                                   "printable characters)")
      ->required();
  serve->add_option("--tls-cert", s->tls.cert, "PEM certificate chain (enables TLS)");
  serve->add_option("--tls-key", s->tls.key, "PEM private key of --tls-cert");
  serve->add_option("--tls-client-ca", s->tls.client_ca, "PEM CA that worker certificates must chain to (mutual TLS)");
  serve->add_flag("--insecure-plaintext", s->insecure_plaintext,
                  "Serve without TLS (logs a warning; only on a trusted network)");
  serve->add_option("--linger", s->linger_s,
                    "Seconds to keep serving metrics after the run finished, or until SIGTERM (default 0; e.g. "
                    "1e9 under a supervisor that restarts exited services)")
      ->check(CLI::Range(0.0, 1e12));
  serve->callback([s, &run] {
    run = [s] {
      Status st = Serve(*s);
      return st.ok() ? 0 : Fail(st.message());
    };
  });

  auto r = std::make_shared<ServeFlags>();
  CLI::App* local = app.add_subcommand(
      "run", "Run a training run on this machine: the service plus N local namm-worker processes, one progress "
             "line per generation");
  AddCommonOptions(local, *r);
  local->add_option("--local-workers", r->local_workers, "Local worker processes")->required()->check(CLI::Range(1, 256));
  local->add_option("--worker-binary", r->worker_binary, "namm-worker to start (default: the one beside this binary)");
  local->add_option("--worker-threads", r->worker_threads, "CPU threads per worker (default: cores / workers)")
      ->check(CLI::PositiveNumber);
  local->add_option("--device", r->worker_devices,
                    "Devices of the local workers, comma-separated, given out in turn (e.g. cuda:0,cuda:1; default cpu)")
      ->delimiter(',')
      ->check(CLI::Validator(
          [](std::string& d) { return IsDeviceName(d) ? std::string() : "'" + d + "' is not cpu, cuda or cuda:N"; },
          "DEVICE"));
  local->add_option("--max-batch", r->worker_max_batch,
                    "Prompts each local worker runs together (namm-worker serve --max-batch; default: the worker's, 8)")
      ->check(CLI::Range(1, 256));
  local->add_option("--dtype", r->worker_dtype,
                    "Compute dtype of the local workers' model: fp32, bf16 or fp16 (default: fp32 on CPU, bf16 on CUDA)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  local->callback([r, &run] {
    run = [r] {
      Status st = Serve(*r);
      return st.ok() ? 0 : Fail(st.message());
    };
  });
}

}  // namespace namm::coordinator::cli
