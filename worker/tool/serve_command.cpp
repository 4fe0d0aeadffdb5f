// namm-worker serve: the worker daemon. Loads the model once, registers with a run's coordinator and runs the
// prompts it leases (proto/namm/v1/coordinator.proto) until the run ends or a signal drains it.
// namm-worker fingerprint: prints the model fingerprint a run spec's model.fingerprint must name.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <iostream>
#include <thread>

#include "commands.h"
#include "namm/cpu_threads.h"
#include "namm/file_util.h"
#include "namm/tasks/task_path_options.h"
#include "namm/worker/coordinator_client.h"
#include "namm/worker/model_fingerprint.h"
#include "namm/worker/namm_executor.h"
#include "namm/worker/worker_metrics.h"
#include "setup.h"

namespace namm::worker::cli {

namespace {

struct ServeOptions {
  ModelOptions model;
  tasks::TaskPathFlags paths;
  std::string coordinator, token_file, name, log_level = "info", metrics_listen;
  ClientTls tls;
  bool insecure_plaintext = false;
  int concurrency = 1;
  int max_batch = 8;
  KvMemoryOptions kv;
  int threads = 0;
  bool exit_when_done = false;
};

// SIGTERM / SIGINT: the first drains gracefully, the second returns every lease and exits. A handler counts
// them, whichever thread the kernel picks: blocking them for a waiter left the threads started before main
// (OpenBLAS starts its pool as it loads) with the default action, which killed the worker instead of draining
// it. The count is the handler's only state, and a handler can reach nothing but a global.
std::atomic<int> drain_signals{0};
std::atomic<bool> drain_watched{false};  // a thread acts on the count (the worker serves)
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<bool>::is_always_lock_free,
              "the handler's state must be safe in a signal handler");

// A second signal while nothing acts on them (the model loading, the worker shutting down) leaves at once: no
// lease is held then.
extern "C" void CountDrainSignal(int) {
  if (drain_signals.fetch_add(1) + 1 >= 2 && !drain_watched.load()) ::_exit(1);
}

// Counts from its construction (a signal while the model loads is acted on once serving starts), acts from
// Watch(client), and puts the previous handlers back when it goes.
class SignalDrain {
 public:
  SignalDrain() {
    drain_signals = 0;
    drain_watched = false;
    struct sigaction action {};
    action.sa_handler = CountDrainSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (std::size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &action, &previous_[i]);
  }
  ~SignalDrain() {
    Stop();
    for (std::size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &previous_[i], nullptr);
  }
  // Stops acting on signals (they are still counted); before `client` goes.
  void Stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
    drain_watched = false;
  }
  void Watch(WorkerClient& client) {
    drain_watched = true;
    thread_ = std::thread([this, &client] {
      bool draining = false;
      while (!done_) {
        const int received = drain_signals.load();
        if (received >= 1 && !draining) {
          draining = true;
          std::cerr << "namm-worker: draining: finishing running leases, returning the rest (signal again to leave "
                       "at once)\n";
          client.Drain(false);
        }
        if (received >= 2) {
          std::cerr << "namm-worker: leaving now: every lease goes back\n";
          client.Drain(true);
          std::_Exit(1);  // without waiting for running prompts: the coordinator has their leases back
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  }

 private:
  static constexpr std::array<int, 2> kSignals = {SIGTERM, SIGINT};
  std::array<struct sigaction, 2> previous_{};
  std::atomic<bool> done_{false};
  std::thread thread_;
};

Status Serve(const ServeOptions& o) {
  SignalDrain drain;  // counting from here: a signal while the model loads drains the worker once it serves
  const spdlog::level::level_enum level = spdlog::level::from_str(o.log_level);
  if (level == spdlog::level::off && o.log_level != "off") {
    return Status::InvalidArgument("--log-level must be trace, debug, info, warn, error or off, got '" + o.log_level + "'");
  }
  spdlog::set_level(level);
  NAMM_ASSIGN_OR_RETURN(std::string token, read_secret_file(o.token_file));
  std::unique_ptr<WorkerMetrics> metrics;
  if (o.tls.ca.empty()) {
    if (!o.insecure_plaintext) {
      return Status::InvalidArgument("serve needs TLS: give --tls-ca (the CA of the coordinator's certificate, and "
                                     "--tls-cert/--tls-key for mutual TLS), or --insecure-plaintext on a trusted "
                                     "network");
    }
    spdlog::warn("connecting in plaintext (--insecure-plaintext): the shared secret and every result cross the "
                 "network unencrypted");
  }
  if (!o.metrics_listen.empty()) {
    NAMM_ASSIGN_OR_RETURN(metrics, WorkerMetrics::Start(o.metrics_listen));
    std::cerr << "namm-worker: metrics at " << metrics->url() << "\n";
  }
  NAMM_ASSIGN_OR_RETURN(tasks::TaskPaths paths, tasks::task_paths_from_flags(o.paths));
  NAMM_ASSIGN_OR_RETURN(std::string fingerprint, model_fingerprint(o.model.model, FingerprintedTokenizer(o.model)));
  NAMM_ASSIGN_OR_RETURN(LoadedModelAndTokenizer loaded, LoadModelAndTokenizer(o.model));
  NAMM_ASSIGN_OR_RETURN(const int64_t kv_budget, ApplyKvMemory(*loaded.model, o.kv));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  set_cpu_threads(o.threads > 0 ? o.threads : std::max(1, cores / o.concurrency));

  WorkerClientOptions client;
  client.coordinator = o.coordinator;
  client.token = token;
  char host[256] = "host";
  ::gethostname(host, sizeof host - 1);
  client.name = o.name.empty() ? std::string(host) + "/" + o.model.device + "/" + std::to_string(::getpid()) : o.name;
  client.model_fingerprint = fingerprint;
  client.device = o.model.device;
  client.concurrency = o.concurrency;
  client.max_batch = o.max_batch;
  client.tls = o.tls;
  client.exit_when_done = o.exit_when_done;
  client.metrics = metrics.get();
  NammExecutor executor(*loaded.model, *loaded.tokenizer, paths);
  executor.set_concurrency(o.concurrency);
  WorkerClient worker(client, executor);
  std::cerr << "namm-worker: " << client.name << " serving " << loaded.model->config().Describe() << " ("
            << fingerprint << ") to " << o.coordinator << "; KV caches up to "
            << (kv_budget > 0 ? std::to_string(kv_budget >> 20) + " MiB together" : std::string("any size"))
            << (o.kv.kv_block_tokens > 0 ? ", in blocks of " + std::to_string(o.kv.kv_block_tokens) + " tokens" : std::string())
            << "\n";
  drain.Watch(worker);
  const Status status = worker.Run();
  drain.Stop();
  const WorkerClientStats s = worker.stats();
  std::cerr << "namm-worker: " << s.leases << " leases, " << s.accepted << " results accepted, " << s.duplicates
            << " duplicates, " << s.cancelled << " cancelled, " << s.failed << " failed prompts\n";
  return status;
}

}  // namespace

void AddServeCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "Worker daemon: run the prompts a training run's coordinator leases");
  AddModelOptions(cmd, o->model);
  tasks::add_task_path_options(cmd, o->paths);
  cmd->add_option("--coordinator", o->coordinator, "The coordinator's HOST:PORT")->required();
  cmd->add_option("--token-file", o->token_file, "File holding the run's shared secret")->required();
  cmd->add_option("--name", o->name, "Name in the coordinator's logs and records (default: host/device/pid)");
  cmd->add_option("--units-concurrency", o->concurrency, "Executor threads, each running its own batches (default 1)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--max-batch", o->max_batch,
                  "Prompts an executor thread runs together in one batched forward pass per step, from up to this many "
                  "leases of one task (default 8), fewer where their KV caches would not fit --max-kv-bytes together; a "
                  "prompt's score does not depend on it on the CPU in float32")
      ->check(CLI::Range(1, 256));
  AddKvMemoryOptions(cmd, o->kv,
                     "a batch holds the prompts whose caches fit together (as each last ran here), and prompts that "
                     "find the pool dry run again with fewer beside them");
  cmd->add_option("--threads", o->threads, "Intra-op CPU threads (default: cores / units concurrency)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--tls-ca", o->tls.ca, "PEM CA that signed the coordinator's certificate (enables TLS)");
  cmd->add_option("--tls-cert", o->tls.cert, "PEM client certificate (mutual TLS)");
  cmd->add_option("--tls-key", o->tls.key, "PEM client private key (mutual TLS)");
  cmd->add_option("--tls-server-name", o->tls.server_name, "Name to verify in the coordinator's certificate");
  cmd->add_flag("--insecure-plaintext", o->insecure_plaintext,
                "Connect without TLS (logs a warning; only on a trusted network)");
  cmd->add_option("--log-level", o->log_level, "trace, debug, info (default), warn, error or off");
  cmd->add_option("--metrics-listen", o->metrics_listen,
                  "HOST:PORT to serve Prometheus metrics on at /metrics (default: none; port 0 picks a free one)");
  cmd->add_flag("--exit-when-done", o->exit_when_done, "Exit once the run has finished (default: wait for more)");
  cmd->callback([o, &run] {
    run = [o] {
      Status s = Serve(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });

  auto f = std::make_shared<ModelOptions>();
  CLI::App* fp = app.add_subcommand("fingerprint", "Print the model fingerprint for a run spec's model.fingerprint");
  fp->add_option("--model", f->model, "Hugging Face model directory or llama2.c checkpoint (.bin)")->required();
  fp->add_option("--tokenizer", f->tokenizer, "Tokenizer file (default: a tokenizer.bin beside a llama2.c model)");
  fp->callback([f, &run] {
    run = [f] {
      Result<std::string> r = model_fingerprint(f->model, FingerprintedTokenizer(*f));
      if (!r.ok()) return Fail(r.status().message());
      std::cout << *r << "\n";
      return 0;
    };
  });
}

}  // namespace namm::worker::cli
