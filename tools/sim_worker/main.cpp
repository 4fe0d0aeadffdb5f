// namm-sim-worker: simulated workers for a coordinator (see sim_executor.h). Tests start them as real processes
// to kill them mid-generation; operators can use them to load-test a deployment without GPUs.
#include <CLI/CLI.hpp>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdio>
#include <iostream>
#include <memory>
#include <thread>
#include <tuple>

#include "namm/file_util.h"
#include "namm/tasks/task_path_options.h"
#include "namm/worker/worker_metrics.h"
#include "sim_executor.h"

namespace {

struct Flags {
  std::string coordinator, token_file, fingerprint, name = "sim", tasks, log_level = "warn", metrics_listen;
  std::vector<std::string> fail, nan_score;
  namm::tasks::TaskPathFlags paths;
  namm::sim::SimOptions sim;
  int workers = 1;
  int concurrency = 1;
  int max_batch = 1;
};

std::atomic<int> g_signals{0};

namm::Status Run(const Flags& f) {
  spdlog::set_level(spdlog::level::from_str(f.log_level));
  NAMM_ASSIGN_OR_RETURN(std::string token, namm::read_secret_file(f.token_file));
  NAMM_ASSIGN_OR_RETURN(namm::tasks::TaskPaths paths, namm::tasks::task_paths_from_flags(f.paths));
  std::vector<std::string> task_names;
  for (std::size_t begin = 0; begin <= f.tasks.size();) {
    const std::size_t end = std::min(f.tasks.find(',', begin), f.tasks.size());
    if (end > begin) task_names.push_back(f.tasks.substr(begin, end - begin));
    begin = end + 1;
  }
  NAMM_ASSIGN_OR_RETURN(namm::coordinator::PromptCosts costs, namm::coordinator::load_prompt_costs(task_names, paths));
  if (!f.sim.record.empty()) {
    std::FILE* record = std::fopen(f.sim.record.c_str(), "a");
    if (record == nullptr) return namm::Status::InvalidArgument("cannot append to --record file " + f.sim.record);
    std::fclose(record);
  }
  namm::sim::SimOptions sim = f.sim;
  for (auto [specs, option, into] : {std::make_tuple(&f.fail, "--fail", &sim.fail),
                                     std::make_tuple(&f.nan_score, "--nan-score", &sim.nan_score)}) {
    for (const std::string& spec : *specs) {
      const auto colon = spec.rfind(':');
      if (colon == std::string::npos) {
        return namm::Status::InvalidArgument(std::string(option) + " expects TASK:PROMPT, got '" + spec + "'");
      }
      into->insert({spec.substr(0, colon), std::atoll(spec.c_str() + colon + 1)});
    }
  }

  std::unique_ptr<namm::worker::WorkerMetrics> metrics;  // shared by the simulated workers of this process
  if (!f.metrics_listen.empty()) {
    NAMM_ASSIGN_OR_RETURN(metrics, namm::worker::WorkerMetrics::Start(f.metrics_listen));
    std::cerr << "namm-sim-worker: metrics at " << metrics->url() << "\n";
  }
  std::vector<std::unique_ptr<namm::sim::SimExecutor>> executors;
  std::vector<std::unique_ptr<namm::worker::WorkerClient>> clients;
  for (int i = 0; i < f.workers; ++i) {
    namm::worker::WorkerClientOptions o;
    o.coordinator = f.coordinator;
    o.token = token;
    o.name = f.name + "-" + std::to_string(i);
    o.model_fingerprint = f.fingerprint;
    o.concurrency = f.concurrency;
    o.max_batch = f.max_batch;
    o.exit_when_done = true;
    o.backoff_max = std::chrono::milliseconds(2000);
    o.metrics = metrics.get();
    executors.push_back(std::make_unique<namm::sim::SimExecutor>(costs, sim, f.concurrency));
    clients.push_back(std::make_unique<namm::worker::WorkerClient>(o, *executors.back()));
  }
  // SIGTERM drains every simulated worker, like namm-worker.
  std::thread signals([&] {
    int seen = 0;
    while (true) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (g_signals < 0) return;
      if (g_signals > seen) {
        ++seen;
        for (auto& c : clients) c->Drain(seen > 1);
      }
    }
  });
  std::vector<namm::Status> results(clients.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < clients.size(); ++i) threads.emplace_back([&, i] { results[i] = clients[i]->Run(); });
  for (std::thread& t : threads) t.join();
  g_signals = -1;
  signals.join();
  int64_t accepted = 0, duplicates = 0;
  for (auto& c : clients) {
    accepted += c->stats().accepted;
    duplicates += c->stats().duplicates;
  }
  std::cerr << "namm-sim-worker: " << accepted << " results accepted, " << duplicates << " duplicates\n";
  for (const namm::Status& s : results) NAMM_RETURN_IF_ERROR(s);
  return namm::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"namm-sim-worker: simulated NAMM workers (a fixed function of the parameters after a delay)"};
  Flags f;
  app.add_option("--coordinator", f.coordinator, "The coordinator's HOST:PORT")->required();
  app.add_option("--token-file", f.token_file, "File holding the run's shared secret")->required();
  app.add_option("--fingerprint", f.fingerprint, "Model fingerprint to present (the run spec's)")->required();
  app.add_option("--tasks", f.tasks, "The run's tasks, comma-separated (their prompt lengths set the delays)")
      ->required();
  namm::tasks::add_task_path_options(&app, f.paths);
  app.add_option("--seconds-per-token", f.sim.seconds_per_cost, "Simulated seconds per prompt token (default 0)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--speed", f.sim.speed, "Relative speed of these workers (default 1)")->check(CLI::PositiveNumber);
  app.add_option("--workers", f.workers, "Simulated workers in this process (default 1)")->check(CLI::Range(1, 1024));
  app.add_option("--units-concurrency", f.concurrency, "Leases each worker runs at once (default 1)")
      ->check(CLI::Range(1, 64));
  app.add_option("--max-batch", f.max_batch,
                 "Prompts each executor thread takes together, from up to this many leases (run one after another "
                 "here; default 1)")
      ->check(CLI::Range(1, 256));
  app.add_option("--name", f.name, "Name prefix (default sim)");
  app.add_option("--fail", f.fail, "TASK:PROMPT these workers fail to run (repeatable; fault tests)");
  app.add_option("--nan-score", f.nan_score, "TASK:PROMPT these workers score NaN (repeatable; fault tests)");
  app.add_option("--record", f.sim.record, "Append a line per prompt run to this file (tests count reruns)");
  app.add_option("--log-level", f.log_level, "spdlog level (default warn)");
  app.add_option("--metrics-listen", f.metrics_listen, "HOST:PORT to serve Prometheus metrics on (default: none)");
  CLI11_PARSE(app, argc, argv);
  struct sigaction action {};
  action.sa_handler = [](int) { g_signals = g_signals + 1; };
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  const namm::Status s = Run(f);
  if (!s.ok()) {
    std::cerr << "namm-sim-worker: error: " << s.message() << "\n";
    return 1;
  }
  return 0;
}
