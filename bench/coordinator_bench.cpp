// The coordinator alone against simulated workers over real gRPC on loopback (tools/sim_worker): every worker
// answers with a fixed function of the candidate's parameters after a delay proportional to the prompt's length
// (the LongBench subsets in ../shared: dureader, multifieldqa_zh, passage_retrieval_zh, vcsum, lsht).
//
//   coordinator_bench [--workers 64] [--population 32] [--prompts 32] [--generations 4] [--unit-ms 30]
//
// Scenarios, each a real run (SQLite store, CMA-ES at the paper's N = 4172, the lease scheduler):
//   throughput     no delay: results per second the coordinator takes in (phase units / phase time), without and
//                  with its Prometheus metrics
//   homogeneous    every worker at speed 1, mean prompt --unit-ms
//   heterogeneous  one worker in eight at half speed
//   barrier        --barrier-generations (300) short generations (4 prompts per task of 10 ms): per generation,
//                  the time from its last result to the first prompt of the next one (tell, commit, plan, lease
//                  delivery), including the generations that request or apply a decomposition; bytes the process
//                  wrote per generation (/proc/self/io) and the database's size at the end; the mean is evaluated
//                  every 10 generations (a new stage best keeps its start state, covariance included)
//   (cmaes.eigen_delay is 500 generations here: a decomposition takes ~9 s at N = 4172 on 2 cores and these
//   generations ~0.2 s; a real generation takes minutes, and the run spec's default is 8.)
// For the two timed scenarios, per generation: the makespan (phase start to its last result) against the
// ideal (total work / total speed) and against the reference's static split computed on the same prompts and
// durations (world size W > 32: each member on W/32 workers, the sampled prompts split among them); and the
// added latency: the gap between a worker's consecutive leases of one generation (the report's round trip and
// the next lease's arrival), per lease and spread over a lease's prompts.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_args.h"
#include "namm/coordinator/run_server.h"
#include "namm/file_util.h"
#include "sim_executor.h"

using namespace namm;
using namespace namm::coordinator;

namespace {

const std::vector<std::string> kTasks = {"lb/dureader", "lb/lsht", "lb/multifieldqa_zh", "lb/passage_retrieval_zh",
                                         "lb/vcsum"};

struct Flags {
  int workers = 64;
  int population = 32;
  int prompts = 32;
  int generations = 4;
  double unit_ms = 30;
  int prompts_per_lease = 4;
  int barrier_generations = 300;
  std::string only;  // run one scenario
  // Run the simulated workers in one namm-sim-worker process (this program's directory) instead of this one, so
  // that the coordinator's own CPU time can be told apart from theirs.
  bool worker_process = false;
  std::string bin_dir;
};

struct Scenario {
  std::string name;
  double seconds_per_cost = 0;
  int slow_every = 0;  // every slow_every-th worker runs at half speed (0: none)
  bool metrics = false;  // the coordinator serves Prometheus metrics (updated every tick)
  int eval_interval = 1000;  // generations between evaluations of the mean (a new best is copied for hand-over)
};

struct GenerationResult {
  int64_t units = 0;
  double makespan = 0, ideal = 0, static_split = 0;
};

struct ScenarioResult {
  std::vector<GenerationResult> generations;
  std::vector<double> gaps;  // seconds between consecutive prompts of one worker slot, within a generation
  int64_t duplicates = 0;
  // Per generation g >= 1 with a successor: its last result to the next generation's first prompt, and what the
  // optimizer did at its end (requested a decomposition, or applied one before the next generation).
  std::vector<double> barrier;
  std::vector<bool> requested, applied;
  std::vector<bool> evaluated, new_best;  // the mean was evaluated; its evaluation was a new stage best
  std::vector<double> tell;  // seconds of its tell(), per generation of `barrier`
  int64_t bytes_written = 0, db_bytes = 0, rss_bytes = 0;
  // CPU seconds (user + system) of the coordinator's process and of the workers' process (--worker-process).
  double coordinator_cpu = 0, workers_cpu = 0;
};

double CpuSeconds(int who) {
  rusage u{};
  ::getrusage(who, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// Starts namm-sim-worker with `workers` simulated workers against the coordinator at `port`.
pid_t SpawnWorkerProcess(const Flags& f, const Scenario& s, int port, const std::string& token_file,
                         const std::string& fingerprint) {
  std::string tasks;
  for (const std::string& t : kTasks) tasks += (tasks.empty() ? "" : ",") + t;
  std::vector<std::string> args = {f.bin_dir + "/namm-sim-worker", "--coordinator", "127.0.0.1:" + std::to_string(port),
                                   "--token-file", token_file, "--fingerprint", fingerprint, "--tasks", tasks,
                                   "--workers", std::to_string(f.workers), "--seconds-per-token",
                                   std::to_string(s.seconds_per_cost), "--log-level", "error"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
    std::fprintf(stderr, "cannot start %s\n", argv[0]);
    std::exit(1);
  }
  return pid;
}

int64_t ProcValue(const char* file, const char* key) {
  std::FILE* f = std::fopen(file, "r");
  if (f == nullptr) return 0;
  char line[256];
  int64_t value = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, key, std::strlen(key)) == 0) value = std::atoll(line + std::strlen(key));
  }
  std::fclose(f);
  return value;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

std::string SpecYaml(const Flags& f, const Scenario& s) {
  std::string tasks;
  for (const std::string& t : kTasks) tasks += (tasks.empty() ? "" : ", ") + t;
  return "name: coordinator-bench\n"
         "model: {path: /sim, fingerprint: sha256:" + std::string(64, '0') + "}\n"
         "namm: {scorer: bam, hidden: 32, selection: binary}\n"
         "cmaes: {population: " + std::to_string(f.population) + ", sigma0: 0.065, seed: 1, eigen_delay: 500}\n"
         "prompts_per_task: " + std::to_string(f.prompts) + "\n"
         "eval_interval: " + std::to_string(s.eval_interval) + "\n"
         "eval_prompts: 4\n"
         "stages:\n"
         "  - {tasks: [" + tasks + "], generations: " + std::to_string(f.generations + 1) + "}\n";
}

double Speed(const Scenario& s, int worker) { return s.slow_every > 0 && worker % s.slow_every == 0 ? 0.5 : 1.0; }

// The reference's static split of one generation, on the same durations: with W > lambda workers each member is
// replicated W / lambda times and the prompts of every task are split among the replicas in sampled order.
double StaticSplit(const Flags& f, const Scenario& s, const PromptCosts& costs, const PromptSample& samples) {
  const int replicas = std::max(1, f.workers / f.population);
  const int members_per_worker = std::max(1, f.population / f.workers);
  double worst = 0;
  for (int w = 0; w < f.workers; ++w) {
    const int replica = w % replicas;
    double work = 0;
    for (const auto& [task, prompts] : samples) {
      const std::size_t n = prompts.size();
      for (std::size_t i = n * replica / replicas; i < n * (replica + 1) / replicas; ++i) {
        const int64_t p = prompts[i];
        work += costs.at(task)[static_cast<std::size_t>(p)] * s.seconds_per_cost * (1 + sim::sim_jitter(task, p));
      }
    }
    worst = std::max(worst, work * members_per_worker / Speed(s, w));
  }
  return worst;
}

ScenarioResult RunScenario(const Flags& f, const Scenario& s, const PromptCosts& costs) {
  const std::string db = std::filesystem::temp_directory_path() / ("coordinator_bench_" + std::to_string(::getpid()) + ".db");
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(db + suffix);
  auto store = Store::Open(db, OpenMode::kCreate).value();
  const RunSpec spec = parse_run_spec(SpecYaml(f, s), "bench").value();
  tasks::ReferenceScores reference;
  for (const auto& [task, c] : costs) {
    for (std::size_t p = 0; p < c.size(); ++p) (void)reference.Set(task, static_cast<int64_t>(p), sim::sim_reference_score(task, static_cast<int64_t>(p)));
  }
  (void)store->ImportReferenceScores(spec.model.fingerprint, reference, "bench", false).value();
  auto trainer = Trainer::Create(*store, spec, row_counts(costs)).value();

  ScenarioResult result;
  std::map<int64_t, std::chrono::steady_clock::time_point> finished;  // generation -> its last result
  std::map<int64_t, std::pair<bool, bool>> decomposition;  // generation -> (requested at its end, applied after)
  std::map<int64_t, double> tell_seconds;
  int64_t last_eigen_generation = 0;
  std::map<int64_t, bool> evaluation;  // generation -> whether its evaluation of the mean was a new best
  double best_eval = -std::numeric_limits<double>::infinity();
  const int64_t bytes_before = ProcValue("/proc/self/io", "write_bytes:");
  ServeOptions options;
  options.listen = "127.0.0.1:0";
  options.token = std::string(32, 'x');
  options.handle_signals = false;
  options.max_streams_per_peer = 0;  // every simulated worker connects from loopback
  options.scheduler.max_prompts_per_lease = f.prompts_per_lease;
  if (s.metrics) options.metrics_listen = "127.0.0.1:0";
  options.progress = [&](const PhaseProgress& p) {
    if (!p.record || p.record->generation == 0) return;  // the statistics phase and the stage-start evaluation
    finished[p.record->generation] = p.finished;
    tell_seconds[p.record->generation] = p.record->tell_seconds;
    // The state the next generation starts from, its due decomposition applied.
    const CmaesState& next = trainer->state();
    decomposition[p.record->generation] = {next.pending_generation == next.generation,
                                           next.eigen.generation != last_eigen_generation};
    last_eigen_generation = next.eigen.generation;
    if (p.record->eval_fitness) {
      const bool best = *p.record->eval_fitness > best_eval;
      evaluation[p.record->generation] = best;
      if (best) best_eval = *p.record->eval_fitness;
    }
    GenerationResult g;
    g.units = p.units;
    g.makespan = p.seconds;
    double work = 0, speed = 0;
    for (int w = 0; w < f.workers; ++w) speed += Speed(s, w);
    for (const auto& [task, prompts] : p.record->samples) {
      for (int64_t prompt : prompts) {
        work += costs.at(task)[static_cast<std::size_t>(prompt)] * s.seconds_per_cost * (1 + sim::sim_jitter(task, prompt));
      }
    }
    g.ideal = work * f.population / speed;
    g.static_split = StaticSplit(f, s, costs, p.record->samples);
    result.generations.push_back(g);
  };
  auto log = ProgressLog::Open(progress_log_path(store->path(), trainer->run_id()));
  if (!log.ok()) {
    std::fprintf(stderr, "%s\n", log.status().ToString().c_str());
    std::exit(1);
  }
  auto server = RunServer::Start(*store, *trainer, **log, costs, options);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    std::exit(1);
  }
  std::vector<std::unique_ptr<sim::SimExecutor>> executors;
  std::vector<std::unique_ptr<worker::WorkerClient>> clients;
  const double cpu_before = CpuSeconds(RUSAGE_SELF), children_before = CpuSeconds(RUSAGE_CHILDREN);
  pid_t worker_process = 0;
  const std::string token_file = db + ".token";
  if (f.worker_process) {
    if (Status w = write_file_atomically(token_file, {options.token}); !w.ok()) {
      std::fprintf(stderr, "%s\n", w.ToString().c_str());
      std::exit(1);
    }
    worker_process = SpawnWorkerProcess(f, s, (*server)->port(), token_file, spec.model.fingerprint);
  }
  for (int w = 0; w < (f.worker_process ? 0 : f.workers); ++w) {
    worker::WorkerClientOptions o;
    o.coordinator = "127.0.0.1:" + std::to_string((*server)->port());
    o.token = options.token;
    o.name = "sim-" + std::to_string(w);
    o.model_fingerprint = spec.model.fingerprint;
    o.exit_when_done = true;
    sim::SimOptions sim_options;
    sim_options.seconds_per_cost = s.seconds_per_cost;
    sim_options.speed = Speed(s, w);
    executors.push_back(std::make_unique<sim::SimExecutor>(costs, sim_options, 1));
    clients.push_back(std::make_unique<worker::WorkerClient>(o, *executors.back()));
  }
  std::vector<std::thread> threads;
  for (auto& c : clients) threads.emplace_back([&c] { (void)c->Run(); });
  auto outcome = (*server)->Run();
  for (std::thread& t : threads) t.join();
  result.coordinator_cpu = CpuSeconds(RUSAGE_SELF) - cpu_before;
  if (worker_process != 0) {
    int status = 0;
    ::waitpid(worker_process, &status, 0);
    result.workers_cpu = CpuSeconds(RUSAGE_CHILDREN) - children_before;
    std::filesystem::remove(token_file);
  }
  if (!outcome.ok() || !outcome->finished) {
    std::fprintf(stderr, "scenario %s did not finish: %s\n", s.name.c_str(), outcome.status().ToString().c_str());
    std::exit(1);
  }
  for (auto& c : clients) result.duplicates += c->stats().duplicates;
  std::map<int64_t, std::chrono::steady_clock::time_point> first_prompt;
  for (auto& e : executors) {
    const sim::SimTiming timing = e->timing();
    for (const auto& [end, start] : timing.gaps) result.gaps.push_back(std::chrono::duration<double>(start - end).count());
    for (const auto& [generation, at] : timing.first_prompt) {
      const auto it = first_prompt.find(generation);
      if (it == first_prompt.end() || at < it->second) first_prompt[generation] = at;
    }
  }
  for (const auto& [generation, at] : finished) {
    const auto next = first_prompt.find(generation + 1);
    if (next == first_prompt.end()) continue;
    result.barrier.push_back(std::chrono::duration<double>(next->second - at).count());
    result.requested.push_back(decomposition[generation].first);
    result.applied.push_back(decomposition[generation].second);
    const auto evaluated = evaluation.find(generation);
    result.evaluated.push_back(evaluated != evaluation.end());
    result.new_best.push_back(evaluated != evaluation.end() && evaluated->second);
    result.tell.push_back(tell_seconds[generation]);
  }
  result.bytes_written = ProcValue("/proc/self/io", "write_bytes:") - bytes_before;
  result.rss_bytes = ProcValue("/proc/self/status", "VmHWM:") * 1024;
  server->reset();
  store.reset();
  for (const char* suffix : {"", "-wal", "-shm"}) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(db + suffix, ec);
    if (!ec) result.db_bytes += static_cast<int64_t>(size);
  }
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(db + suffix);
  return result;
}

}  // namespace

constexpr const char* kUsage = R"(Usage: coordinator_bench [--only throughput|homogeneous|heterogeneous|barrier] [--workers 64]
       [--population 32] [--prompts 32] [--generations 4] [--unit-ms 30] [--prompts-per-lease N]
       [--barrier-generations 300] [--worker-process 0|1]
The coordinator alone against simulated workers over real gRPC on loopback; the scenarios are described in the
header of bench/coordinator_bench.cpp.
)";

int main(int argc, char** argv) {
  Flags f;
  const std::optional<int> exit = namm::bench::ParseArgs(argc, argv, kUsage, [&](const std::string& flag,
                                                                                const std::string& value) {
    const auto v = [&] { return std::stod(value); };
    if (flag == "--only") f.only = value;
    else if (flag == "--workers") f.workers = static_cast<int>(v());
    else if (flag == "--population") f.population = static_cast<int>(v());
    else if (flag == "--prompts") f.prompts = static_cast<int>(v());
    else if (flag == "--generations") f.generations = static_cast<int>(v());
    else if (flag == "--unit-ms") f.unit_ms = v();
    else if (flag == "--prompts-per-lease") f.prompts_per_lease = static_cast<int>(v());
    else if (flag == "--barrier-generations") f.barrier_generations = static_cast<int>(v());
    else if (flag == "--worker-process") f.worker_process = v() != 0;
    else return false;
    return true;
  });
  if (exit) return *exit;
  f.bin_dir = std::filesystem::absolute(argv[0]).parent_path().string();
  if (f.worker_process && f.only != "throughput") {
    std::fprintf(stderr, "--worker-process 1 goes with --only throughput (the other scenarios time each worker)\n");
    return 2;
  }
  tasks::TaskPaths paths = tasks::default_task_paths();
  auto costs = load_prompt_costs(kTasks, paths);
  if (!costs.ok()) {
    std::fprintf(stderr, "coordinator_bench needs the LongBench subsets in ../shared: %s\n",
                 costs.status().ToString().c_str());
    return 1;
  }
  double cost_sum = 0, count = 0, cost_min = 1e300, cost_max = 0;
  for (const auto& [task, c] : *costs) {
    for (double x : c) {
      cost_sum += x;
      ++count;
      cost_min = std::min(cost_min, x);
      cost_max = std::max(cost_max, x);
    }
  }
  const double spc = f.unit_ms / 1000.0 / (cost_sum / count);
  std::printf("coordinator_bench: %d simulated workers over gRPC on loopback, population %d, %zu tasks x %d prompts, "
              "%d prompts per lease, N = 4172\n", f.workers, f.population, kTasks.size(), f.prompts,
              f.prompts_per_lease);
  std::printf("prompt lengths (estimated tokens) %.0f..%.0f, mean %.0f -> mean prompt %.1f ms, longest %.1f ms\n\n",
              cost_min, cost_max, cost_sum / count, f.unit_ms, cost_max * spc * 1000);

  spdlog::set_level(spdlog::level::warn);
  if (f.only.empty() || f.only == "throughput") {
    // Without and with the coordinator's metrics, back to back: their cost as a ratio.
    double median[2] = {0, 0};
    for (const bool metrics : {false, true}) {
      const ScenarioResult r = RunScenario(f, {"throughput", 0, 0, metrics}, *costs);
      std::vector<double> rates;
      for (const GenerationResult& g : r.generations) rates.push_back(static_cast<double>(g.units) / g.makespan);
      median[metrics] = Median(rates);
      std::printf("throughput (no delay%s): %.0f results/s median over %zu generations (min %.0f, max %.0f), %lld "
                  "units per generation\n",
                  metrics ? ", metrics on" : "", median[metrics], rates.size(),
                  *std::min_element(rates.begin(), rates.end()), *std::max_element(rates.begin(), rates.end()),
                  static_cast<long long>(r.generations.front().units));
      int64_t units = 0;
      for (const GenerationResult& g : r.generations) units += g.units;
      std::printf("  CPU per 1,000 results: coordinator %.3f s%s (the whole run, setup included)\n",
                  r.coordinator_cpu * 1000 / static_cast<double>(units),
                  f.worker_process ? (", workers' process " + std::to_string(r.workers_cpu * 1000 / static_cast<double>(units)) + " s").c_str() : " (workers in the same process)");
      // Lease latency as a worker sees it: from one prompt's end to its slot's next prompt's start (the report's
      // round trip and the next lease's arrival). Timed by the simulated workers, so in this process only.
      if (!r.gaps.empty()) {
        std::printf("  lease latency (a worker slot's gap between consecutive prompts): p50 %.2f ms, p99 %.2f ms\n",
                    Median(r.gaps) * 1000, Quantile(r.gaps, 0.99) * 1000);
      }
      std::printf("  peak RSS so far %.0f MB (%s)\n", static_cast<double>(r.rss_bytes) / 1e6,
                  f.worker_process ? "the coordinator's process" : "the coordinator and the simulated workers");
    }
    std::printf("metrics on / off: %.3f\n\n", median[1] / median[0]);
  }

  if (f.only.empty() || f.only == "barrier") {
    Flags b = f;
    b.prompts = 4;
    b.generations = f.barrier_generations;
    const auto start = std::chrono::steady_clock::now();
    // Prompts of 10 ms on average: the simulated workers sleep like real ones compute, and leave the CPU to
    // the coordinator (a decomposition beside workers that never sleep takes minutes on 2 cores).
    // The mean evaluated every 10 generations: a new stage best keeps its start state for the hand-over.
    const ScenarioResult r = RunScenario(b, {"barrier", spc * 10 / f.unit_ms, 0, false, 10}, *costs);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::vector<double> all, requested, applied, evaluated, new_best;
    for (std::size_t i = 0; i < r.barrier.size(); ++i) {
      all.push_back(r.barrier[i] * 1000);
      if (r.evaluated[i]) evaluated.push_back(r.barrier[i] * 1000);
      if (r.new_best[i]) new_best.push_back(r.barrier[i] * 1000);
      if (r.requested[i]) requested.push_back(r.barrier[i] * 1000);
      if (r.applied[i]) applied.push_back(r.barrier[i] * 1000);
    }
    const auto max_of = [](const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); };
    std::printf("barrier over %zu generations (%lld units each, %.0f s): last result -> next generation's first prompt "
                "median %.1f ms, p99 %.1f ms, max %.1f ms\n",
                all.size(), static_cast<long long>(r.generations.front().units), seconds, Median(all),
                Quantile(all, 0.99), max_of(all));
    std::vector<double> tell_ms;
    for (double t : r.tell) tell_ms.push_back(t * 1000);
    std::printf("  tell(): median %.1f ms, p99 %.1f ms, max %.1f ms\n", Median(tell_ms), Quantile(tell_ms, 0.99),
                max_of(tell_ms));
    std::printf("  generations requesting a decomposition: %zu, barrier max %.1f ms; applying one: %zu, max %.1f ms\n",
                requested.size(), max_of(requested), applied.size(), max_of(applied));
    std::printf("  generations evaluating the mean: %zu, barrier max %.1f ms; with a new stage best: %zu, max %.1f ms\n",
                evaluated.size(), max_of(evaluated), new_best.size(), max_of(new_best));
    std::vector<std::size_t> order(all.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return all[x] > all[y]; });
    std::printf("  slowest:");
    for (std::size_t i = 0; i < std::min<std::size_t>(5, order.size()); ++i) {
      std::printf(" generation %zu %.0f ms (tell %.0f ms)%s;", order[i] + 1, all[order[i]], r.tell[order[i]] * 1000,
                  r.requested[order[i]] ? " (requested)" : r.applied[order[i]] ? " (applied)" : "");
    }
    std::printf("\n");
    std::printf("  written: %.2f MB per generation (%.1f MB in all, /proc/self/io); database at the end %.1f MB; "
                "peak RSS %.0f MB\n\n",
                static_cast<double>(r.bytes_written) / 1e6 / static_cast<double>(b.generations + 1),
                static_cast<double>(r.bytes_written) / 1e6, static_cast<double>(r.db_bytes) / 1e6,
                static_cast<double>(r.rss_bytes) / 1e6);
  }

  std::printf("%-14s %4s %7s %10s %8s %10s %12s %8s %14s %12s %12s\n", "scenario", "gen", "units", "makespan", "ideal",
              "/ideal", "static split", "/ideal", "gap p50 (ms)", "gap p99 (ms)", "per unit (ms)");
  for (const Scenario& s : {Scenario{"homogeneous", spc, 0}, Scenario{"heterogeneous", spc, 8}}) {
    if (!f.only.empty() && f.only != s.name) continue;
    const ScenarioResult r = RunScenario(f, s, *costs);
    for (std::size_t i = 0; i < r.generations.size(); ++i) {
      const GenerationResult& g = r.generations[i];
      std::printf("%-14s %4zu %7lld %9.3fs %7.3fs %10.3f %11.3fs %8.3f\n", s.name.c_str(), i + 1,
                  static_cast<long long>(g.units), g.makespan, g.ideal, g.makespan / g.ideal, g.static_split,
                  g.static_split / g.ideal);
    }
    std::vector<double> ratios;
    for (const GenerationResult& g : r.generations) ratios.push_back(g.makespan / g.ideal);
    std::vector<double> static_ratios;
    for (const GenerationResult& g : r.generations) static_ratios.push_back(g.static_split / g.ideal);
    std::printf("%-14s %4s %7s %10s %8s %10.3f %12s %8.3f %14.2f %12.2f %12.3f   (medians; %lld duplicate results)\n",
                s.name.c_str(), "all", "", "", "", Median(ratios), "", Median(static_ratios), Median(r.gaps) * 1000,
                Quantile(r.gaps, 0.99) * 1000, Median(r.gaps) * 1000 / f.prompts_per_lease,
                static_cast<long long>(r.duplicates));
  }
  return 0;
}
