// The distribution layer end to end, with real processes on loopback: namm-coordinator serve / run, namm-worker
// serve on the bundled stories260K model, and simulated workers (namm-sim-worker) whose scores are a pure function
// of the parameters, so that a run that lost workers or its coordinator can be compared bit for bit with an
// uninterrupted one computed here in-process.
#include <SQLiteCpp/SQLiteCpp.h>
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <fcntl.h>
#include <link.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include "../partition_proxy.h"
#include "../process_util.h"
#include "../temp_path.h"
#include "namm/coordinator/progress_log.h"
#include "namm/coordinator/run_spec.h"
#include "namm/coordinator/store.h"
#include "namm/coordinator/trainer.h"
#include "namm/file_util.h"
#include "namm/namm_file.h"
#include "namm/v1/coordinator.grpc.pb.h"
#include "namm/v1/protocol.h"
#include "synthetic_run.h"
#include "sim_executor.h"

namespace namm::coordinator {
namespace {

using namm::testing::Child;
using namm::testing::FreePort;
using namm::testing::ReadText;
using namm::testing::WaitUntil;
using namm::testing::WriteText;
using namm::testing::KillAndReap;
using namm::testing::RunProcess;
using namm::testing::Spawn;
using namm::testing::Wait;

// NAMM_TEST_COORDINATOR / NAMM_TEST_SIM_WORKER run the tests against another build's programs (an earlier
// commit's, to see a test fail where the fix is missing).
std::string ProgramPath(const char* variable, const char* built) {
  const char* other = std::getenv(variable);
  return other != nullptr && *other != '\0' ? other : built;
}
const std::string kCoordinator = ProgramPath("NAMM_TEST_COORDINATOR", NAMM_COORDINATOR_PATH);
const std::string kSimWorker = ProgramPath("NAMM_TEST_SIM_WORKER", NAMM_SIM_WORKER_PATH);
const std::string kWorker = NAMM_WORKER_PATH;
const std::string kSimFingerprint = "sha256:" + std::string(64, 'a');
const std::string kSimTasks = "syn/story_recall,syn/story_recall_accuracy";
constexpr int64_t kSimRows = 40;

// A simulated run's files: a shared secret, token-id rows of 100 to 2,000 tokens (their lengths set the
// simulated workers' delays), the spec, the database and logs.
struct SimRun {
  std::string dir, token, spec, db, yaml;
  int port = 0;
  std::string seconds_per_token = "0.00004";  // of the simulated workers
  std::string listen_host = "127.0.0.1";      // where the coordinator listens (workers connect to 127.0.0.1)

  explicit SimRun(const std::string& name, int stage1_generations = 3, int stage2_generations = 2) {
    dir = namm::testing::TempPath(name);
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    token = dir + "/token";
    WriteText(token, "sim-run-shared-secret-0123456789\n");
    std::ofstream rows(dir + "/story_recall.jsonl");
    for (int64_t r = 0; r < kSimRows; ++r) {
      nlohmann::json ids = nlohmann::json::array();
      for (int64_t i = 0; i < 100 + (r * 487) % 1900; ++i) ids.push_back(i % 500);
      rows << nlohmann::json{{"prompt_ids", ids}, {"continuation_ids", {1, 2}}}.dump() << "\n";
    }
    yaml = "name: " + name +
           "\n"
           "model: {path: /sim, fingerprint: " + kSimFingerprint + "}\n"
           "namm: {scorer: mlp, selection: binary}\n"
           "cmaes: {population: 8, sigma0: 0.065, seed: 11}\n"
           "prompts_per_task: 6\n"
           "eval_interval: 2\n"
           "eval_prompts: 4\n"
           "stages:\n"
           "  - {tasks: [syn/story_recall], generations: " + std::to_string(stage1_generations) + "}\n"
           "  - {tasks: [syn/story_recall, syn/story_recall_accuracy], generations: " +
           std::to_string(stage2_generations) + "}\n";
    spec = dir + "/spec.yaml";
    WriteText(spec, yaml);
    db = dir + "/run.db";
    port = FreePort();
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
  std::string log(const std::string& who) const { return dir + "/" + who + ".log"; }

  // Put before the coordinator's command (e.g. /usr/bin/env with variables).
  std::vector<std::string> coordinator_prefix;

  // Starts the coordinator and waits until it listens (or has exited).
  Child Serve(std::vector<std::string> extra = {}) const {
    const std::size_t logged = ReadText(log("coordinator")).size();
    const std::vector<std::string> command = {kCoordinator, "serve", "--config", spec, "--db", db, "--listen",
                                              listen_host + ":" + std::to_string(port), "--token-file", token,
                                              "--data-dir", "synthetic=" + dir, "--lease-timeout", "3",
                                              "--heartbeat-ms", "200", "--store-interval-ms", "50"};
    std::vector<std::string> args = coordinator_prefix;
    args.insert(args.end(), command.begin(), command.end());
    args.insert(args.end(), extra.begin(), extra.end());
    if (std::find(extra.begin(), extra.end(), "--tls-cert") == extra.end()) args.push_back("--insecure-plaintext");
    Child c = Spawn(args, log("coordinator"));
    WaitUntil([&] {
      return ReadText(log("coordinator")).find("serving run '", logged) != std::string::npos ||
             ::waitpid(c.pid, nullptr, WNOHANG) != 0;
    }, std::chrono::seconds(30));
    return c;
  }

  // `prefix`: a command that runs the worker (e.g. in another network namespace, where the coordinator is at
  // `coordinator`).
  Child SimWorker(const std::string& name, std::vector<std::string> extra = {}, std::vector<std::string> prefix = {},
                  const std::string& coordinator = "") const {
    std::vector<std::string> args = prefix;
    for (const std::string& a : {kSimWorker, std::string("--coordinator"), coordinator.empty() ? address() : coordinator,
                                 std::string("--token-file"), token, std::string("--fingerprint"), kSimFingerprint,
                                 std::string("--tasks"), kSimTasks, std::string("--data-dir"), "synthetic=" + dir,
                                 std::string("--seconds-per-token"), seconds_per_token, std::string("--name"), name}) {
      args.push_back(a);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    return Spawn(args, log(name));
  }

  // (next generation, evaluations recorded for it), read while the coordinator runs.
  std::pair<int64_t, int64_t> Progress() const {
    try {
      SQLite::Database raw(db, SQLite::OPEN_READONLY);
      SQLite::Statement run(raw, "SELECT generation FROM runs WHERE id = 1");
      if (!run.executeStep()) return {-1, 0};
      const int64_t generation = run.getColumn(0).getInt64();
      SQLite::Statement count(raw, "SELECT COUNT(*) FROM evaluations WHERE run_id = 1 AND generation = ?");
      count.bind(1, generation);
      count.executeStep();
      return {generation, count.getColumn(0).getInt64()};
    } catch (const std::exception&) {
      return {-1, 0};  // not created yet
    }
  }

  // Waits until generation `g` is under way: some of its results stored, not all.
  bool WaitMidGeneration(int64_t g) const {
    return WaitUntil([&] {
      const auto [generation, stored] = Progress();
      return generation == g && stored > 0;
    }, std::chrono::seconds(90));
  }
};

std::vector<float> AsFloats(const std::vector<double>& x) { return {x.begin(), x.end()}; }

// The run of `yaml` computed here, without processes or network: what any distributed run must end in.
struct InProcessRun {
  std::unique_ptr<Store> store;
  std::unique_ptr<Trainer> trainer;

  // `before_phase`: drops the prompts the distributed run dropped (see testing::DriveRun).
  explicit InProcessRun(const std::string& yaml, const std::function<Status(Trainer&)>& before_phase = nullptr) {
    store = Store::Open(namm::testing::FreshDatabasePath("in_process.db"), OpenMode::kCreate).value();
    const RunSpec spec = parse_run_spec(yaml, "spec").value();
    tasks::ReferenceScores reference;
    for (const std::string& task : spec.all_tasks()) {
      for (int64_t p = 0; p < kSimRows; ++p) (void)reference.Set(task, p, sim::sim_reference_score(task, p));
    }
    EXPECT_TRUE(store->ImportReferenceScores(spec.model.fingerprint, reference, "test", false).ok());
    std::map<std::string, int64_t> rows;
    for (const std::string& task : spec.all_tasks()) rows[task] = kSimRows;
    trainer = Trainer::Create(*store, spec, rows).value();
    // What a simulated worker answers for each unit.
    const auto simulate = [](const Trainer& t, const std::vector<WorkUnit>& units) {
      const GenerationPlan& plan = t.plan();
      std::vector<EvaluationRecord> results;
      for (const WorkUnit& u : units) {
        EvaluationRecord e;
        e.generation = plan.generation;
        e.candidate = u.candidate;
        e.task = u.task;
        e.prompt = u.prompt;
        e.score = sim::sim_score(AsFloats(plan.params_of(u.candidate)), u.task, u.prompt);
        e.worker = "in-process";
        if (plan.collect_norm_stats) e.norm_stats = sim::sim_norm_stats(u.task, u.prompt);
        results.push_back(e);
      }
      return results;
    };
    const Status driven = testing::DriveRun(*trainer, 1 << 30, simulate, before_phase);
    EXPECT_TRUE(driven.ok()) << driven.ToString();
  }

  CmaesState FinalState() const { return store->GetCheckpoint(1, "latest", 0, trainer->params()).value().state; }
};

// The finished distributed run in `db` against the in-process one: the same evaluations (each unit once, with the
// same score) and the same final optimizer state, bit for bit.
void ExpectSameAsInProcess(const std::string& db, const InProcessRun& expected) {
  auto opened = Store::Open(db, OpenMode::kReadOnly);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  auto store = std::move(opened).value();
  const auto got_run = store->GetRun(1);
  ASSERT_TRUE(got_run.ok()) << got_run.status().ToString();
  const RunRecord run = got_run.value();
  EXPECT_EQ(run.status, "finished");
  const CmaesParams& params = expected.trainer->params();
  EXPECT_TRUE(store->GetCheckpoint(1, "latest", 0, params)->state == expected.FinalState())
      << "the optimizer state differs from an uninterrupted run's";
  for (int64_t g = 0; g < run.generation; ++g) {
    const auto got = store->GetEvaluations(1, g).value();
    const auto want = expected.store->GetEvaluations(1, g).value();
    ASSERT_EQ(got.size(), want.size()) << "generation " << g;
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(std::tie(got[i].candidate, got[i].task, got[i].prompt),
                std::tie(want[i].candidate, want[i].task, want[i].prompt));
      EXPECT_EQ(got[i].score, want[i].score);
    }
  }
}

TEST(Distribution, WorkersKilledOrDrainedMidGenerationTheOthersFinishEveryUnitOnce) {
  SimRun r("dist_worker_kill");
  Child coordinator = r.Serve();
  Child a = r.SimWorker("sim-a"), b = r.SimWorker("sim-b"), c = r.SimWorker("sim-c");
  ASSERT_TRUE(r.WaitMidGeneration(2)) << ReadText(r.log("coordinator"));
  KillAndReap(a);  // holding leases: they go back to the queue when its connection drops
  ASSERT_TRUE(r.WaitMidGeneration(3)) << ReadText(r.log("coordinator"));
  ::kill(b.pid, SIGTERM);  // drains: finishes what it runs, returns the rest
  EXPECT_EQ(Wait(b), 0) << ReadText(r.log("sim-b"));
  EXPECT_EQ(Wait(c), 0) << ReadText(r.log("sim-c"));
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_NE(log.find("is draining"), std::string::npos) << log;
  EXPECT_NE(log.find("run 'dist_worker_kill' finished"), std::string::npos) << log;

  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
  // The survivor ran the end of the run; the base-model scores were computed as units and kept.
  SQLite::Database raw(r.db, SQLite::OPEN_READONLY);
  EXPECT_GT(raw.execAndGet("SELECT COUNT(*) FROM evaluations WHERE worker = 'sim-c-0' AND generation = 4").getInt64(), 0);
  EXPECT_GT(raw.execAndGet("SELECT COUNT(*) FROM reference_scores WHERE source LIKE 'computed by namm workers%'").getInt64(),
            0);
}

// Evolution over budgets through real processes: candidates run each task at its own threshold and at budget 8
// (task variants), the base model's reference runs once per base prompt, and the run ends as the in-process one.
TEST(Distribution, ARunOverBudgetsRunsEachReferenceOnceAndEndsAsTheInProcessRun) {
  SimRun r("dist_budgets", 2, 1);
  r.yaml.insert(r.yaml.find("stages:"), "budgets: [own, 8]\n");
  WriteText(r.spec, r.yaml);
  Child coordinator = r.Serve();
  Child a = r.SimWorker("sim-a"), b = r.SimWorker("sim-b");
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  EXPECT_EQ(Wait(a), 0) << ReadText(r.log("sim-a"));
  EXPECT_EQ(Wait(b), 0) << ReadText(r.log("sim-b"));
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
  SQLite::Database raw(r.db, SQLite::OPEN_READONLY);
  EXPECT_EQ(raw.execAndGet("SELECT COUNT(*) FROM reference_scores WHERE task LIKE '%@%'").getInt64(), 0);
  EXPECT_GT(raw.execAndGet("SELECT COUNT(*) FROM reference_scores").getInt64(), 0);
  for (const char* task : {"syn/story_recall", "syn/story_recall@budget=8", "syn/story_recall_accuracy@budget=8"}) {
    SQLite::Statement count(raw, "SELECT COUNT(*) FROM evaluations WHERE task = ?");
    count.bind(1, task);
    ASSERT_TRUE(count.executeStep());
    EXPECT_GT(count.getColumn(0).getInt64(), 0) << task;
  }
}

TEST(Distribution, CoordinatorKilledMidGenerationResumesBitIdentical) {
  SimRun r("dist_coordinator_kill");
  Child coordinator = r.Serve();
  Child a = r.SimWorker("sim-a"), b = r.SimWorker("sim-b");
  for (int64_t g : {1, 3}) {  // once in each stage
    ASSERT_TRUE(r.WaitMidGeneration(g)) << ReadText(r.log("coordinator"));
    KillAndReap(coordinator);
    const auto [generation, stored] = r.Progress();
    EXPECT_EQ(generation, g) << "killed mid-generation: the generation is not committed";
    EXPECT_GT(stored, 0) << "results that arrived before the kill are kept";
    coordinator = r.Serve();  // the workers reconnect to it
  }
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  EXPECT_EQ(Wait(a), 0) << ReadText(r.log("sim-a"));
  EXPECT_EQ(Wait(b), 0) << ReadText(r.log("sim-b"));
  EXPECT_NE(ReadText(r.log("coordinator")).find("resuming run 'dist_coordinator_kill'"), std::string::npos);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// A worker holding more unreported prompts than one registration may name (v1::kMaxIdsPerCall, 4,096) names what
// fits when its coordinator restarts, drops the rest and goes on (before, the registration was refused as invalid,
// which is fatal: the worker exited and every result it held was lost). 32 candidates of 1,100 prompts and leases of
// up to 1,024 prompts to one worker of 64 slots, whose prompts take about a second each.
TEST(DistributionLong, AWorkerHoldingMorePromptsThanARegistrationNamesGoesOnAfterARestart) {
  SimRun r("dist_many_held");
  {
    std::ofstream rows(r.dir + "/story_recall.jsonl", std::ios::trunc);
    for (int64_t row = 0; row < 1200; ++row) {
      nlohmann::json ids = nlohmann::json::array();
      for (int64_t i = 0; i < 100; ++i) ids.push_back((row + i) % 500);
      rows << nlohmann::json{{"prompt_ids", ids}, {"continuation_ids", {1, 2}}}.dump() << "\n";
    }
  }
  WriteText(r.spec, "name: dist_many_held\n"
                    "model: {path: /sim, fingerprint: " + kSimFingerprint + "}\n"
                    "namm: {scorer: mlp, selection: binary}\n"
                    "cmaes: {population: 32, sigma0: 0.065, seed: 11}\n"
                    "prompts_per_task: 1100\n"
                    "eval_interval: 1000\n"
                    "eval_prompts: 4\n"
                    "stages:\n"
                    "  - {tasks: [syn/story_recall], generations: 2}\n");
  r.seconds_per_token = "0.01";
  const std::vector<std::string> leases = {"--prompts-per-lease", "1024"};
  Child coordinator = r.Serve(leases);
  Child worker = r.SimWorker("sim-w", {"--units-concurrency", "8", "--max-batch", "8", "--log-level", "info"});
  ASSERT_TRUE(WaitUntil([&] { return r.Progress().second >= 8; }, std::chrono::seconds(120)))
      << ReadText(r.log("coordinator"));
  KillAndReap(coordinator);
  coordinator = r.Serve(leases);
  const bool reattached =
      WaitUntil([&] { return ReadText(r.log("sim-w")).find("re-attached") != std::string::npos; }, std::chrono::seconds(60));
  const std::string log = ReadText(r.log("sim-w"));
  EXPECT_TRUE(reattached) << log;
  EXPECT_NE(log.find("are not named again: a registration names at most 4096 prompts"), std::string::npos) << log;
  EXPECT_EQ(log.find("refused this worker"), std::string::npos) << log;
  EXPECT_EQ(::waitpid(worker.pid, nullptr, WNOHANG), 0) << "the worker goes on";
  KillAndReap(worker);
  KillAndReap(coordinator);
}

// Workers keep running their leases while the coordinator is down and keep what they finish; a restarted
// coordinator keeps its predecessor's leases for them and takes those results: nothing is run twice.
TEST(DistributionLong, CoordinatorKilledWithWorkersMidPromptRecomputesNothing) {
  SimRun r("dist_restart_no_rerun");
  r.seconds_per_token = "0.0003";  // prompts of 30 to 600 ms: every worker is mid-prompt at any instant
  const std::vector<std::string> no_copies = {"--max-copies", "1"};  // straggler copies rerun on purpose
  Child coordinator = r.Serve(no_copies);
  std::vector<Child> workers;
  for (int i = 0; i < 4; ++i) {
    workers.push_back(r.SimWorker("sim-" + std::to_string(i), {"--record", r.dir + "/ran-" + std::to_string(i)}));
  }
  for (int64_t g : {1, 3}) {  // once in each stage
    ASSERT_TRUE(r.WaitMidGeneration(g)) << ReadText(r.log("coordinator"));
    KillAndReap(coordinator);
    std::this_thread::sleep_for(std::chrono::milliseconds(800));  // the workers go on meanwhile
    coordinator = r.Serve(no_copies);
  }
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  for (Child& w : workers) EXPECT_EQ(Wait(w), 0);
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_NE(log.find("leases of the previous coordinator kept for their workers"), std::string::npos) << log;
  EXPECT_NE(log.find("re-attached with"), std::string::npos) << log;
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));

  std::map<std::string, int> runs;
  int64_t total = 0;
  for (int i = 0; i < 4; ++i) {
    std::istringstream lines(ReadText(r.dir + "/ran-" + std::to_string(i)));
    for (std::string line; std::getline(lines, line);) {
      ++runs[line];
      ++total;
    }
  }
  std::string twice;
  for (const auto& [unit, n] : runs) {
    if (n > 1) twice += unit + " (" + std::to_string(n) + " times)\n";
  }
  EXPECT_EQ(twice, "") << "prompts run more than once";
  SQLite::Database raw(r.db, SQLite::OPEN_READONLY);
  const int64_t stored = raw.execAndGet("SELECT COUNT(*) FROM evaluations").getInt64() +
                         raw.execAndGet("SELECT COUNT(*) FROM reference_scores").getInt64();
  EXPECT_EQ(total, stored) << "every prompt run is stored once (the statistics phase's included)";
}

// A network namespace joined to this one by a veth pair (this side 10.213.K.1/30, the namespace's .2), so that a
// process in it can be cut off and reconnected like a worker behind a failed switch. Needs root and iproute2.
class NetworkNamespace {
 public:
  NetworkNamespace() {
    const int k = static_cast<int>(::getpid() % 250);
    name_ = "namm-part-" + std::to_string(::getpid());
    host_link_ = "nmh" + std::to_string(::getpid());
    const std::string peer = "nmn" + std::to_string(::getpid());
    host_ip_ = "10.213." + std::to_string(k) + ".1";
    for (const std::string& c : {"ip netns add " + name_, "ip link add " + host_link_ + " type veth peer name " + peer,
                                 "ip link set " + peer + " netns " + name_,
                                 "ip addr add " + host_ip_ + "/30 dev " + host_link_, "ip link set " + host_link_ + " up",
                                 "ip netns exec " + name_ + " ip addr add 10.213." + std::to_string(k) + ".2/30 dev " + peer,
                                 "ip netns exec " + name_ + " ip link set " + peer + " up",
                                 "ip netns exec " + name_ + " ip link set lo up"}) {
      const auto r = RunProcess(c);
      if (r.exit_code != 0) {
        error_ = c + ": " + r.output;
        return;
      }
    }
  }
  ~NetworkNamespace() {
    (void)RunProcess("ip netns del " + name_);  // takes the veth pair with it
    (void)RunProcess("ip link del " + host_link_);
  }
  const std::string& error() const { return error_; }
  const std::string& host_ip() const { return host_ip_; }
  // A command prefix that runs a program in the namespace (Spawn takes a path, not a name to look up).
  std::vector<std::string> exec() const {
    std::string ip = RunProcess("command -v ip").output;
    ip.erase(ip.find_last_not_of(" \n") + 1);
    return {ip, "netns", "exec", name_};
  }
  // The link goes down: packets to and from the namespace are dropped, connections hang (no reset).
  bool Cut() const { return RunProcess("ip link set " + host_link_ + " down").exit_code == 0; }
  bool Heal() const { return RunProcess("ip link set " + host_link_ + " up").exit_code == 0; }

 private:
  std::string name_, host_link_, host_ip_, error_;
};

int64_t CounterValue(const std::string& exposition, const std::string& name) {
  const std::size_t at = exposition.find("\n" + name + "{");
  if (at == std::string::npos) return -1;
  return std::stoll(exposition.substr(exposition.find("} ", at) + 2));
}

int64_t LineCount(const std::string& file) {
  const std::string text = ReadText(file);
  return static_cast<int64_t>(std::count(text.begin(), text.end(), '\n'));
}

// How a test partitions a worker from the coordinator: the command prefix and the address the worker runs with,
// and the cut (packets dropped both ways, no reset) and the heal.
struct Partition {
  std::vector<std::string> prefix;
  std::string coordinator;
  std::function<bool()> cut, heal;
};

// A worker cut off mid-lease for twice the lease time and then reconnected: its leases are re-issued to the other
// worker, what it computed while cut off comes late and is ignored (or taken, if still missing) and counted, and
// the run ends as an uninterrupted one.
void ExpectAWorkerCutOffIsReplaced(SimRun& r, const Partition& partition) {
  const int metrics = FreePort();
  Child coordinator = r.Serve({"--metrics-listen", "127.0.0.1:" + std::to_string(metrics), "--linger", "600"});
  const std::string cut_ran = r.dir + "/ran-cut", other_ran = r.dir + "/ran-other";
  Child cut = r.SimWorker("sim-cut", {"--record", cut_ran, "--log-level", "info"}, partition.prefix,
                          partition.coordinator);
  Child other = r.SimWorker("sim-other", {"--record", other_ran});
  // Mid-run, with the worker to be cut off holding a lease of generation 1 it has started.
  ASSERT_TRUE(WaitUntil([&] { return ReadText(cut_ran).find("\n1 ") != std::string::npos ||
                                     ReadText(cut_ran).rfind("1 ", 0) == 0; },
                        std::chrono::seconds(120)))
      << ReadText(r.log("coordinator")) << ReadText(r.log("sim-cut"));
  ASSERT_TRUE(partition.cut());
  const int64_t ran_before = LineCount(cut_ran);
  std::this_thread::sleep_for(std::chrono::seconds(7));  // the lease timeout is 3 s
  const int64_t ran_while_cut = LineCount(cut_ran) - ran_before;
  ASSERT_TRUE(partition.heal());

  EXPECT_EQ(Wait(cut), 0) << ReadText(r.log("sim-cut"));
  EXPECT_EQ(Wait(other), 0) << ReadText(r.log("sim-other"));
  const std::string exposition = namm::testing::HttpGet(metrics, "/metrics");
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));

  EXPECT_GT(ran_while_cut, 0) << "the cut-off worker went on computing";
  EXPECT_GE(CounterValue(exposition, "namm_units_lost_total"), 1) << "its leases were re-issued\n" << exposition;
  EXPECT_GE(CounterValue(exposition, "namm_units_duplicate_results_total") +
                CounterValue(exposition, "namm_units_late_total"),
            1)
      << "what it computed while cut off arrived late and was counted\n" << exposition;
  EXPECT_GT(LineCount(other_ran), 0);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// The partition made by a forwarder that stops forwarding (tests/partition_proxy.h): no privileges, so every run
// of the default suite has it.
TEST(Distribution, AWorkerCutOffByAPartitionPastItsLeaseTimeIsReplacedAndItsLateResultsAreCounted) {
  SimRun r("dist_partition_proxy");
  r.seconds_per_token = "0.00015";  // prompts of 15 to 300 ms: the run takes ~25 s, the cut 7 of them
  namm::testing::PartitionProxy proxy(r.port);
  ExpectAWorkerCutOffIsReplaced(r, {{}, "127.0.0.1:" + std::to_string(proxy.port()),
                                    [&] { proxy.Cut(); return true; }, [&] { proxy.Heal(); return true; }});
}

// The same with a real network: the worker in another network namespace whose link goes down (root only).
TEST(DistributionLong, AWorkerCutOffPastItsLeaseTimeIsReplacedAndItsLateResultsAreCounted) {
  if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  if (RunProcess("ip -V").exit_code != 0) GTEST_SKIP() << "iproute2 (ip) is not installed";
  NetworkNamespace ns;
  if (!ns.error().empty()) GTEST_SKIP() << "cannot make a network namespace here: " << ns.error();
  SimRun r("dist_partition");
  r.seconds_per_token = "0.0005";  // prompts of 50 ms to 1 s
  r.listen_host = "0.0.0.0";
  ExpectAWorkerCutOffIsReplaced(r, {ns.exec(), ns.host_ip() + ":" + std::to_string(r.port), [&] { return ns.Cut(); },
                                    [&] { return ns.Heal(); }});
}

TEST(Distribution, AFinishedRunLingersWithItsMetricsUntilSigterm) {
  SimRun r("dist_linger");
  const int metrics = FreePort();
  Child coordinator = r.Serve({"--metrics-listen", "127.0.0.1:" + std::to_string(metrics), "--linger", "600"});
  Child worker = r.SimWorker("sim-a");
  EXPECT_EQ(Wait(worker), 0) << ReadText(r.log("sim-a"));
  ASSERT_TRUE(WaitUntil([&] { return ReadText(r.log("coordinator")).find("serving http") != std::string::npos; },
                        std::chrono::seconds(30)))
      << ReadText(r.log("coordinator"));
  const std::string exposition = namm::testing::HttpGet(metrics, "/metrics");
  EXPECT_NE(exposition.find("namm_run_finished{run=\"dist_linger\"} 1"), std::string::npos) << exposition;
  EXPECT_NE(exposition.find("namm_generations_completed_total{run=\"dist_linger\"} 5"), std::string::npos);
  EXPECT_EQ(::waitpid(coordinator.pid, nullptr, WNOHANG), 0) << "still serving";
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));

  // Restarted on the finished run (as a supervisor would), it lingers as well, with the run's last generation.
  coordinator = r.Serve({"--metrics-listen", "127.0.0.1:" + std::to_string(metrics), "--linger", "600"});
  std::string again;
  EXPECT_TRUE(WaitUntil([&] { return (again = namm::testing::HttpGet(metrics, "/metrics")).find(
                                         "namm_run_finished{run=\"dist_linger\"} 1") != std::string::npos; },
                        std::chrono::seconds(30)))
      << again << ReadText(r.log("coordinator"));
  EXPECT_NE(again.find("namm_population_fitness_mean{run=\"dist_linger\"}"), std::string::npos) << again;
  // Where the run ended (its second stage, generation 4 of 0-4), not a plan's defaults (stage 0, generation 0).
  for (const std::string series : {"namm_run_stage{run=\"dist_linger\"} 1", "namm_run_generation{run=\"dist_linger\"} 4",
                                    "namm_run_generations{run=\"dist_linger\"} 5", "namm_run_eta_seconds{run=\"dist_linger\"} 0"}) {
    EXPECT_NE(again.find(series + "\n"), std::string::npos) << series << "\n" << again;
  }
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
}

// The database's write lock held elsewhere (another process, or a sync on a loaded disk) for longer than SQLite's
// busy timeout (10 s: earlier builds stopped the run then, "recording evaluations failed ...: database is locked")
// is waited out: the coordinator retries, warns while it waits, logs the wait once with its duration, counts it
// on /metrics, and the run ends as an uninterrupted one.
TEST(Distribution, ADatabaseLockedLongerThanTheBusyTimeoutIsWaitedOut) {
  SimRun r("dist_store_wait", 4, 2);
  const int metrics = FreePort();
  Child coordinator = r.Serve({"--metrics-listen", "127.0.0.1:" + std::to_string(metrics), "--linger", "600"});
  Child worker = r.SimWorker("sim-a");
  ASSERT_TRUE(r.WaitMidGeneration(1)) << ReadText(r.log("coordinator"));
  const auto held = std::chrono::seconds(15);
  {
    SQLite::Database other(r.db, SQLite::OPEN_READWRITE);
    other.exec("BEGIN IMMEDIATE");
    std::this_thread::sleep_for(held);
    other.exec("COMMIT");
  }
  EXPECT_EQ(Wait(worker), 0) << ReadText(r.log("sim-a"));
  ASSERT_TRUE(WaitUntil([&] { return ReadText(r.log("coordinator")).find("serving http") != std::string::npos; },
                        std::chrono::seconds(60)))
      << ReadText(r.log("coordinator"));
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_NE(log.find("still waiting for the database after 1"), std::string::npos) << log;  // 10 to 12 s
  const std::size_t waited = log.find("s for the database (recording evaluations: database is locked (SQLITE_BUSY)");
  ASSERT_NE(waited, std::string::npos) << log;
  const double seconds = std::stod(log.substr(log.rfind("waited ", waited) + 7));
  EXPECT_GT(seconds, 10);
  EXPECT_LT(seconds, 16);
  const std::string exposition = namm::testing::HttpGet(metrics, "/metrics");
  EXPECT_NE(exposition.find("namm_store_waits_total{run=\"dist_store_wait\"} 1"), std::string::npos) << exposition;
  EXPECT_NE(exposition.find("namm_store_waiting_seconds{run=\"dist_store_wait\"} 0"), std::string::npos);
  EXPECT_NE(exposition.find("namm_store_wait_longest_seconds{run=\"dist_store_wait\"} 1"), std::string::npos);
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// A report the coordinator cannot take as sent (here: larger than its --max-message-bytes, the statistics of 40
// prompts at once) is not lost by the worker: it keeps the results and sends them in smaller reports. Earlier
// workers dropped results on any status but UNAVAILABLE, DEADLINE_EXCEEDED and NOT_FOUND, and the prompts ran
// again once their lease expired.
TEST(Distribution, AWorkerKeepsResultsTheCoordinatorDidNotTakeUntilItHasThem) {
  SimRun r("dist_report_kept", 1, 1);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"prompts_per_task: 6", "prompts_per_task: 40"}, {"eval_prompts: 4", "eval_prompts: 40"}}) {
    ASSERT_NE(r.yaml.find(from), std::string::npos);
    r.yaml.replace(r.yaml.find(from), from.size(), to);
  }
  WriteText(r.spec, r.yaml);
  r.seconds_per_token = "0";  // a lease's 40 prompts finish before its first report goes
  Child coordinator = r.Serve({"--max-message-bytes", "4096", "--prompts-per-lease", "40"});
  Child worker = r.SimWorker("sim-a", {"--record", r.dir + "/ran", "--log-level", "info"});
  EXPECT_EQ(Wait(coordinator, std::chrono::seconds(120)), 0) << ReadText(r.log("coordinator"));
  EXPECT_EQ(Wait(worker), 0);
  const std::string log = ReadText(r.log("sim-a"));
  EXPECT_NE(log.find("too large for the coordinator"), std::string::npos) << log;
  std::map<std::string, int> runs;
  std::istringstream lines(ReadText(r.dir + "/ran"));
  for (std::string line; std::getline(lines, line);) ++runs[line];
  std::string twice;
  for (const auto& [unit, n] : runs) {
    if (n > 1) twice += unit + " (" + std::to_string(n) + " times)\n";
  }
  EXPECT_EQ(twice, "") << "results the worker dropped were computed again";
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// The LD_PRELOAD value that loads the fault shim. In a sanitizer build the runtime must come first in the initial
// library list (AddressSanitizer refuses to start otherwise), so the runtime this test process loaded, the one
// our programs link, goes ahead of the shim.
std::string PreloadIoFaults() {
  std::string runtime;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* out) {
        const std::string name = info->dlpi_name != nullptr ? info->dlpi_name : "";
        const std::string base = name.substr(name.find_last_of('/') + 1);
        if (base.rfind("libasan.so", 0) != 0 && base.rfind("libtsan.so", 0) != 0) return 0;
        *static_cast<std::string*>(out) = name;
        return 1;
      },
      &runtime);
  return "LD_PRELOAD=" + (runtime.empty() ? "" : runtime + ":") + std::string(NAMM_IO_FAULTS_PATH);
}

// The prefix that runs the coordinator with its database and progress log (every file whose path contains
// "/run.db") failing with `error` on `calls` while `trigger` exists (tests/coordinator/io_faults.c: no privileges
// needed), each failure logged in DIR/faults.
std::vector<std::string> IoFaults(const SimRun& r, const std::string& trigger, const std::string& error,
                                  const std::string& calls, const std::vector<std::string>& more = {}) {
  std::vector<std::string> prefix = {"/usr/bin/env", PreloadIoFaults(),
                                     "NAMM_IO_FAULT_MATCH=/run.db", "NAMM_IO_FAULT_ERRNO=" + error,
                                     "NAMM_IO_FAULT_CALLS=" + calls, "NAMM_IO_FAULT_WHILE=" + trigger,
                                     "NAMM_IO_FAULT_LOG=" + r.dir + "/faults"};
  prefix.insert(prefix.end(), more.begin(), more.end());
  return prefix;
}

int64_t CountLines(const std::string& text, const std::string& containing) {
  int64_t n = 0;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) n += line.find(containing) != std::string::npos ? 1 : 0;
  return n;
}

// Errors that pass are no stop: bursts of EIO on the database's and the progress log's writes and syncs (the
// first 70 ms of every 700, for the whole run), and of EMFILE on opening the database's files (the first 300 ms
// of every 700: background connections), each kind's first call failing too, are retried and the run finishes
// with every result and the trajectory of an undisturbed run. So does a single EMFILE on the first open after
// the coordinator serves (a background connection's), of the database file or of its write-ahead log.
// Earlier, the first failed progress-log append stopped the run at its next tick, and SQLITE_IOERR or
// SQLITE_CANTOPEN on any connection stopped it at once. Later, one EMFILE outside a burst left a background
// connection read-only (SQLite's fallback when opening for writing fails): on the database file its checkpoint
// failed with EBADF until the coordinator's patience ran out; on the log the run stopped with SQLITE_READONLY.
TEST(Distribution, IoErrorBurstsOnTheStoreAndTheProgressLogLeaveTheRunWhole) {
  struct Case {
    std::string name, error, calls, down_ms, match;
  };
  for (const Case& c : std::vector<Case>{{"EIO", "EIO", "write,sync", "70", "/run.db"},
                                         {"EMFILE", "EMFILE", "open", "300", "/run.db"},
                                         {"EMFILE_once", "EMFILE", "open", "0", "/run.db"},
                                         {"EMFILE_once_wal", "EMFILE", "open", "0", "/run.db-wal"}}) {
    SCOPED_TRACE(c.name);
    SimRun r("dist_io_" + c.name, 3, 2);
    const std::string trigger = r.dir + "/faulty";
    // The first matching call after the trigger fails whenever it comes: a short run opens few background
    // connections, and bursts alone missed them all once (under AddressSanitizer, a loaded machine).
    r.coordinator_prefix = IoFaults(r, trigger, c.error, c.calls,
                                    {"NAMM_IO_FAULT_PERIOD_MS=700", "NAMM_IO_FAULT_DOWN_MS=" + c.down_ms,
                                     "NAMM_IO_FAULT_FIRST=1", "NAMM_IO_FAULT_MATCH=" + c.match});
    Child coordinator = r.Serve({"--io-error-patience", "60"});  // a stuck wait fails the test in a minute
    WriteText(trigger, "");  // once it serves: the first connection's open fails at once by design
    Child a = r.SimWorker("sim-a"), b = r.SimWorker("sim-b");
    EXPECT_EQ(Wait(coordinator, std::chrono::seconds(300)), 0) << ReadText(r.log("coordinator"));
    EXPECT_EQ(Wait(a), 0);
    EXPECT_EQ(Wait(b), 0);
    const std::string faults = ReadText(r.dir + "/faults"), log = ReadText(r.log("coordinator"));
    if (c.error == "EIO") {
      EXPECT_GT(CountLines(faults, ".progress"), 0) << "the progress log failed";
      EXPECT_GT(CountLines(faults, "/run.db") - CountLines(faults, ".progress"), 0) << "the database failed";
      EXPECT_NE(log.find("progress log: appends go through again"), std::string::npos) << log;
    } else if (c.down_ms == "0") {
      EXPECT_EQ(CountLines(faults, "open "), 1) << faults;
      EXPECT_NE(log.find("SQLite opened it read-only (SQLITE_CANTOPEN); 1 retries)"), std::string::npos) << log;
    } else {
      EXPECT_GT(CountLines(faults, "open "), 0) << "a connection failed to open its files";
    }
    EXPECT_NE(log.find("(SQLITE_"), std::string::npos) << "the store's waits are logged, their error named";
    ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
  }
}

// A resumed run whose progress log cannot start over (its first write after opening fails: the rewrite in
// Recover(), after the log was emptied) goes on, the log rewritten by the next append, and ends as an
// uninterrupted run. Before, that write's error stopped the coordinator just after it said it served: CI's burst
// test above hit it when the trigger came between the two.
TEST(Distribution, AResumeWhoseProgressLogCannotStartOverGoesOn) {
  SimRun r("dist_resume_log_eio", 3, 1);
  Child coordinator = r.Serve();
  Child worker = r.SimWorker("sim-a");
  ASSERT_TRUE(r.WaitMidGeneration(1)) << ReadText(r.log("coordinator"));
  KillAndReap(coordinator);
  const std::string trigger = r.dir + "/faulty";
  WriteText(trigger, "");
  // Opening the log writes this process's name in its header (passes); the next write is the rewrite (fails).
  r.coordinator_prefix = IoFaults(r, trigger, "EIO", "write",
                                  {"NAMM_IO_FAULT_MATCH=.progress", "NAMM_IO_FAULT_SKIP=1", "NAMM_IO_FAULT_FIRST=1",
                                   "NAMM_IO_FAULT_PERIOD_MS=1000000", "NAMM_IO_FAULT_DOWN_MS=0"});
  coordinator = r.Serve();
  const int exit_code = Wait(coordinator, std::chrono::seconds(300));
  EXPECT_EQ(exit_code, 0) << ReadText(r.log("coordinator"));
  if (exit_code != 0) KillAndReap(worker);  // it would wait for a coordinator for ever
  EXPECT_EQ(Wait(worker), 0) << ReadText(r.log("sim-a"));
  EXPECT_EQ(CountLines(ReadText(r.dir + "/faults"), ".progress"), 1) << ReadText(r.dir + "/faults");
  EXPECT_NE(ReadText(r.log("coordinator")).find("Input/output error (the run goes on; appends retry it)"),
            std::string::npos) << ReadText(r.log("coordinator"));
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// A full disk under the database (ENOSPC on every write of its write-ahead log) pauses the run while it lasts and
// stops it only after --io-error-patience, naming the error and saying that the same command resumes it; that
// command, once serving, its disk full again for 3 s and then freed, finishes the run as an uninterrupted one.
// (This test mounted a tmpfs as root before; the fault shim needs no privileges, so CI runs it. The progress log
// stays writable here, so that results keep coming for the store to fail on: with it full too, no report is
// taken and the run waits without a store call to run out of patience; the burst test above covers that log.)
TEST(Distribution, AFullDiskPausesTheRunOrStopsItAfterItsPatienceAndTheSameCommandResumes) {
  SimRun r("dist_full_disk", 6, 1);
  const std::string trigger = r.dir + "/disk_full";
  r.coordinator_prefix = IoFaults(r, trigger, "ENOSPC", "write", {"NAMM_IO_FAULT_MATCH=/run.db-wal"});
  Child coordinator = r.Serve({"--io-error-patience", "2"});
  Child worker = r.SimWorker("sim-a");
  ASSERT_TRUE(r.WaitMidGeneration(1)) << ReadText(r.log("coordinator"));
  WriteText(trigger, "");
  EXPECT_EQ(Wait(coordinator, std::chrono::seconds(300)), 1) << ReadText(r.log("coordinator"));
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_NE(log.find("(SQLITE_FULL) (after 2 s of retries)"), std::string::npos) << log;
  EXPECT_NE(log.find("what the run stored so far is kept: once the cause is fixed, the same namm-coordinator serve "
                     "command resumes it"), std::string::npos) << log;
  const int64_t stopped_at = r.Progress().first;
  EXPECT_GT(stopped_at, 0);
  EXPECT_LT(stopped_at, 6);

  std::filesystem::remove(trigger);  // a first open fails at once: nothing to wait for when a path is wrong
  coordinator = r.Serve();           // the default patience (600 s)
  const int64_t failed_before = CountLines(ReadText(r.dir + "/faults"), "write");
  WriteText(trigger, "");
  std::this_thread::sleep_for(std::chrono::seconds(3));
  EXPECT_EQ(::waitpid(coordinator.pid, nullptr, WNOHANG), 0) << "waiting, not stopped: " << ReadText(r.log("coordinator"));
  EXPECT_GT(CountLines(ReadText(r.dir + "/faults"), "write"), failed_before) << "the disk was full meanwhile";
  std::filesystem::remove(trigger);
  EXPECT_EQ(Wait(coordinator, std::chrono::seconds(300)), 0) << ReadText(r.log("coordinator"));
  KillAndReap(worker);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// One coordinator per run: a second `serve` or `run` of it stops at once, naming the first (pid and host), and
// leaves the first one's progress log and run alone; so does one that reaches the database by a symbolic link or
// a hard link in another folder, or after the progress log was deleted (the lock is the database file's, by its
// identity: earlier it was a flock on a path made from the --db string, which each of these got past).
TEST(Distribution, ASecondCoordinatorOfARunIsRefusedNamingTheFirst) {
  SimRun r("dist_second_coordinator", 3, 2);
  Child first = r.Serve();
  ASSERT_EQ(::waitpid(first.pid, nullptr, WNOHANG), 0) << ReadText(r.log("coordinator"));
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string holder = "pid " + std::to_string(first.pid) + " on " + host;
  const auto second = [&](const std::string& command, const std::string& db) {
    const auto start = std::chrono::steady_clock::now();
    const auto refused = RunProcess(kCoordinator + " " + command + " --config " + r.spec + " --db " + db +
                                    " --data-dir synthetic=" + r.dir);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << command;
    EXPECT_EQ(refused.exit_code, 1) << refused.output;
    return refused.output;
  };
  const std::string serve = "serve --listen 127.0.0.1:" + std::to_string(FreePort()) + " --token-file " + r.token +
                            " --insecure-plaintext";
  for (const std::string& command : {serve, std::string("run --local-workers 1")}) {
    const std::string output = second(command, r.db);
    EXPECT_NE(output.find("run 'dist_second_coordinator' in " + r.db + ": another coordinator serves this run (" +
                          holder),
              std::string::npos)
        << output;
  }
  const std::string symlink = r.dir + "/linked.db", other = r.dir + "/elsewhere", hard_link = other + "/same.db";
  std::filesystem::create_symlink(r.db, symlink);
  std::filesystem::create_directories(other);
  std::filesystem::create_hard_link(r.db, hard_link);
  std::string output = second(serve, symlink);
  EXPECT_NE(output.find("run 'dist_second_coordinator' in " + symlink + ": another coordinator serves this run (" +
                        holder),
            std::string::npos)
      << "the symbolic link leads to the same progress log too: " << output;
  output = second(serve, hard_link);
  EXPECT_NE(output.find("run 'dist_second_coordinator' in " + hard_link + ": another coordinator serves this run ("),
            std::string::npos)
      << output;
  struct stat db_stat = {};
  ASSERT_EQ(::stat(r.db.c_str(), &db_stat), 0);
  EXPECT_NE(output.find("inode " + std::to_string(db_stat.st_ino) + ")"), std::string::npos) << output;
  const std::string log_path = progress_log_path(r.db, 1);
  ASSERT_TRUE(std::filesystem::exists(log_path));
  std::filesystem::remove(log_path);
  output = second(serve, r.db);
  EXPECT_NE(output.find("another coordinator serves this run (its pid and host unknown; another coordinator holds "
                        "the lock on run 1 of " + r.db),
            std::string::npos)
      << output;
  EXPECT_FALSE(std::filesystem::exists(log_path)) << "the refused coordinator wrote nothing";
  std::filesystem::remove(hard_link);
  Child worker = r.SimWorker("sim-a");
  EXPECT_EQ(Wait(first), 0) << ReadText(r.log("coordinator"));
  EXPECT_EQ(Wait(worker), 0);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// Workers that take several leases at once and run their prompts as one batch (--max-batch), one of them
// killed midway: the run ends as the in-process one does.
TEST(Distribution, BatchingWorkersLeaveTheTrajectoryUnchanged) {
  SimRun r("dist_batching");
  Child coordinator = r.Serve();
  Child a = r.SimWorker("sim-a", {"--max-batch", "8"}), b = r.SimWorker("sim-b", {"--max-batch", "3", "--units-concurrency", "2"});
  while (r.Progress().first < 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  KillAndReap(b);
  Child c = r.SimWorker("sim-c", {"--max-batch", "5"});
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  EXPECT_EQ(Wait(a), 0);
  EXPECT_EQ(Wait(c), 0);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

TEST(Distribution, ServingWithoutTlsNeedsToBeAskedFor) {
  SimRun r("dist_plaintext");
  const auto refused = RunProcess(kCoordinator + " serve --config " + r.spec + " --db " + r.db + " --listen " +
                                  r.address() + " --token-file " + r.token + " --data-dir synthetic=" + r.dir);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("serve needs TLS"), std::string::npos) << refused.output;
  EXPECT_FALSE(std::filesystem::exists(r.db)) << "nothing was created";
  const auto worker = RunProcess(kWorker + " serve --coordinator " + r.address() + " --token-file " + r.token +
                                 " --model /nowhere/model.bin");
  EXPECT_NE(worker.output.find("serve needs TLS"), std::string::npos) << worker.output;
  // Asked for: it serves, and says what that means. Started at a soft limit of 64 open files, it serves at its
  // hard limit (every connection is a descriptor: 60 idle ones stopped a run's store at 64).
  r.coordinator_prefix = {"/usr/bin/prlimit", "--nofile=64:4096"};
  Child coordinator = r.Serve();
  std::string open_files;
  std::istringstream limits(ReadText("/proc/" + std::to_string(coordinator.pid) + "/limits"));
  for (std::string line; std::getline(limits, line);) {
    if (line.rfind("Max open files", 0) == 0) open_files = line;
  }
  EXPECT_NE(open_files.find("4096                 4096"), std::string::npos) << open_files;
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0);
  EXPECT_NE(ReadText(r.log("coordinator")).find("serving in plaintext (--insecure-plaintext)"), std::string::npos);
}

TEST(Distribution, APlaceholderFingerprintIsRefusedBeforeTheRunIsCreated) {
  SimRun r("dist_placeholder");
  std::string yaml = r.yaml;
  yaml.replace(yaml.find(kSimFingerprint), kSimFingerprint.size(), "sha256:fill-me-in");
  WriteText(r.spec, yaml);
  const auto serve = RunProcess(kCoordinator + " serve --config " + r.spec + " --db " + r.db + " --listen " +
                                r.address() + " --token-file " + r.token + " --data-dir synthetic=" + r.dir);
  EXPECT_NE(serve.exit_code, 0);
  EXPECT_NE(serve.output.find("'sha256:fill-me-in' is not a worker fingerprint"), std::string::npos) << serve.output;
  // Nothing was created: the corrected spec starts the run as if the first attempt never happened.
  EXPECT_FALSE(std::filesystem::exists(r.db) && !Store::Open(r.db, OpenMode::kReadOnly).value()->ListRuns()->empty());
}

// Simulated workers that come and go in the fault tests: four to start, one replaced at random, the rest reaped
// at the end (a worker may still wait for a coordinator that finished).
struct WorkerPool {
  const SimRun& run;
  std::vector<Child> workers;
  int started = 0;

  explicit WorkerPool(const SimRun& r) : run(r) {
    for (int i = 0; i < 4; ++i) Add();
  }
  // Batching on: each worker takes up to four leases at once and runs their prompts as one batch.
  void Add() { workers.push_back(run.SimWorker("sim-" + std::to_string(started++), {"--max-batch", "4"})); }
  // A random worker, moved to the back (to be stopped, then Replace()d).
  Child& Pick(std::mt19937& rng) {
    std::swap(workers[rng() % workers.size()], workers.back());
    return workers.back();
  }
  void Replace() {
    workers.pop_back();
    Add();
  }
  void ReapAll() {
    for (Child& w : workers) {
      WaitUntil([&] { return ::waitpid(w.pid, nullptr, WNOHANG) != 0; }, std::chrono::seconds(5));
      ::kill(w.pid, SIGKILL);
      ::waitpid(w.pid, nullptr, 0);
    }
  }
};

// Soak (label `long`): a longer run under a seeded storm of faults: workers SIGKILLed or drained and replaced,
// the coordinator SIGKILLed or stopped and restarted, at random moments. However often anything failed, the run
// ends exactly as the uninterrupted in-process one.
TEST(DistributionSoak, RandomWorkerAndCoordinatorFaultsLeaveTheTrajectoryUnchanged) {
  SimRun r("dist_soak", 40, 40);
  std::mt19937 rng(20261123);
  Child coordinator = r.Serve();
  WorkerPool pool(r);
  int exit_code = 0;  // of the coordinator that ended the run by itself
  const auto finished = [&] {
    int status = 0;
    if (::waitpid(coordinator.pid, &status, WNOHANG) != coordinator.pid) return false;
    exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return true;
  };
  int worker_kills = 0, drains = 0, coordinator_kills = 0, coordinator_stops = 0;
  while (!finished()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(200, 1500)(rng)));
    if (finished()) break;
    const int action = std::uniform_int_distribution<int>(0, 9)(rng);
    if (action < 5) {  // a worker dies and a new one joins
      Child& worker = pool.Pick(rng);
      if (action < 3) {
        KillAndReap(worker);
        ++worker_kills;
      } else {
        ::kill(worker.pid, SIGTERM);
        EXPECT_EQ(Wait(worker), 0) << "a drained worker exits cleanly";
        ++drains;
      }
      pool.Replace();
    } else if (action < 7) {
      if (action == 5) {
        KillAndReap(coordinator);
        ++coordinator_kills;
      } else {
        ::kill(coordinator.pid, SIGTERM);
        EXPECT_EQ(Wait(coordinator), 0) << "a stopped coordinator exits cleanly";
        ++coordinator_stops;
      }
      if (r.Progress().first < 0) continue;  // killed before the run existed: nothing to resume
      const auto store = Store::Open(r.db, OpenMode::kReadOnly);
      ASSERT_TRUE(store.ok()) << store.status().ToString();
      if ((*store)->GetRun(1)->status == "finished") break;
      coordinator = r.Serve();
    }
  }
  EXPECT_EQ(exit_code, 0) << ReadText(r.log("coordinator"));
  pool.ReapAll();
  std::printf("faults: %d worker kills, %d drains, %d coordinator kills, %d coordinator stops\n", worker_kills,
              drains, coordinator_kills, coordinator_stops);
  EXPECT_GT(worker_kills + drains + coordinator_kills + coordinator_stops, 10);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// Kills at the paper's dimension (N = 4172, the BAM scorer): a seeded storm of 20 `kill -9`s of the coordinator
// and of workers, some aimed at the moments a coordinator is writing a covariance snapshot or decomposing in the
// background (cmaes.eigen_gap_factor is lowered so that decompositions come every few generations). The run
// ends bit-identical to an uninterrupted one, every unit stored once.
TEST(DistributionLong, AStormOfKillsAtThePapersDimensionLeavesTheTrajectoryUnchanged) {
  SimRun r("dist_storm", 80, 80);  // long enough to outlast the storm (~1 s a generation)
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"namm: {scorer: mlp, selection: binary}", "namm: {scorer: bam, hidden: 32, selection: binary}"},
           {"seed: 11}", "seed: 11, eigen_gap_factor: 0.005, eigen_delay: 3}"}}) {
    ASSERT_NE(r.yaml.find(from), std::string::npos);
    r.yaml.replace(r.yaml.find(from), from.size(), to);
  }
  WriteText(r.spec, r.yaml);
  std::mt19937 rng(20261125);
  Child coordinator = r.Serve();
  WorkerPool pool(r);
  const std::string background = "in the background";
  int worker_kills = 0, coordinator_kills = 0, aimed_at_snapshots = 0, aimed_at_decompositions = 0;
  for (int fault = 0; fault < 20; ++fault) {
    ASSERT_EQ(::waitpid(coordinator.pid, nullptr, WNOHANG), 0) << "the run ended before the storm did\n"
                                                               << ReadText(r.log("coordinator"));
    const int kind = fault % 5;  // 0: a snapshot being written, 1: a decomposition running, else at random
    if (kind < 2) {
      // The next background decomposition of this coordinator: its snapshot (70 MB) is written in the first
      // few hundred milliseconds, the decomposition (~9 s here) goes on after.
      const std::size_t from = ReadText(r.log("coordinator")).size();
      const bool seen = WaitUntil([&] {
        return ReadText(r.log("coordinator")).find(background, from) != std::string::npos ||
               ::waitpid(coordinator.pid, nullptr, WNOHANG) != 0;
      }, std::chrono::seconds(90));
      ASSERT_EQ(::waitpid(coordinator.pid, nullptr, WNOHANG), 0) << "the run ended before the storm did";
      std::this_thread::sleep_for(std::chrono::milliseconds(kind == 0 ? 100 : 3000));
      (kind == 0 ? aimed_at_snapshots : aimed_at_decompositions) += seen ? 1 : 0;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(200, 2000)(rng)));
    }
    if (kind < 2 || rng() % 3 == 0) {
      KillAndReap(coordinator);
      ++coordinator_kills;
      coordinator = r.Serve();
    } else {
      KillAndReap(pool.Pick(rng));
      pool.Replace();
      ++worker_kills;
    }
  }
  // The rest of the run decomposes every ~6 generations, single-threaded at N = 4172 (20 s each beside the
  // workers on a 2-core AVX2 machine, where 320 s after the storm reached generation 116 of 160).
  EXPECT_EQ(Wait(coordinator, std::chrono::seconds(1200)), 0) << ReadText(r.log("coordinator"));
  pool.ReapAll();
  std::printf("storm: %d coordinator kills (%d while a snapshot was written, %d during a decomposition), %d worker "
              "kills\n", coordinator_kills, aimed_at_snapshots, aimed_at_decompositions, worker_kills);
  EXPECT_GE(aimed_at_snapshots, 3);
  EXPECT_GE(aimed_at_decompositions, 3);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// Load beside a process, as another user's jobs on a shared head node: `cpu` threads spinning, and one writing
// 256 MB at a time with fdatasync (a full disk queue makes every other sync of the file system wait).
class Hogs {
 public:
  Hogs(const std::string& dir, int cpu) {
    for (int i = 0; i < cpu; ++i) {
      threads_.emplace_back([this] {
        volatile uint64_t x = 0;
        while (!stop_) x = x + 1;
      });
    }
    threads_.emplace_back([this, file = dir + "/hog"] {
      const std::string chunk(1 << 20, 'h');
      while (!stop_) {
        const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        for (int mb = 0; mb < 256 && !stop_; ++mb) (void)!::write(fd, chunk.data(), chunk.size());
        ::fdatasync(fd);
        ::close(fd);
      }
      ::unlink(file.c_str());
    });
  }
  ~Hogs() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// Store contention never stops a run. A run shaped like the interruption experiment where this first happened
// (N = 4172, the separable CMA-ES: a snapshot and a compaction after every generation), 500 generations, with two
// spinning threads and a disk writer beside it, and every sync of the database file made 12 s slow (an LD_PRELOAD
// shim: a throttled disk). Earlier builds' compaction held the write lock through such a sync
// (wal_checkpoint(TRUNCATE)), and the trainer's next store gave up after SQLite's 10 s busy timeout: "recording
// evaluations failed ...: database is locked" (reproduced with the previous build: NAMM_TEST_COORDINATOR).
TEST(DistributionLong, StoreContentionNeverStopsARun) {
  SimRun r("dist_contention", 500, 1);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"namm: {scorer: mlp, selection: binary}", "namm: {scorer: bam, hidden: 32, selection: binary}"},
           {"seed: 11}", "seed: 11, covariance: diagonal}"}}) {
    ASSERT_NE(r.yaml.find(from), std::string::npos);
    r.yaml.replace(r.yaml.find(from), from.size(), to);
  }
  WriteText(r.spec, r.yaml);
  r.seconds_per_token = "0.00001";
  r.coordinator_prefix = {"/usr/bin/env", PreloadIoFaults(), "NAMM_SLOW_FSYNC_MS=12000",
                          "NAMM_SLOW_FSYNC_SUFFIX=/run.db", "NAMM_SLOW_FSYNC_LOG=" + r.dir + "/slow_syncs"};
  const int metrics = FreePort();
  int exit_code = -1;
  {
    Hogs hogs(r.dir, 2);
    Child coordinator = r.Serve({"--metrics-listen", "127.0.0.1:" + std::to_string(metrics), "--linger", "600"});
    Child a = r.SimWorker("sim-a"), b = r.SimWorker("sim-b");
    EXPECT_EQ(Wait(a, std::chrono::seconds(3000)), 0) << ReadText(r.log("sim-a"));
    EXPECT_EQ(Wait(b, std::chrono::seconds(60)), 0);
    EXPECT_TRUE(WaitUntil([&] { return ReadText(r.log("coordinator")).find("serving http") != std::string::npos; },
                          std::chrono::seconds(60)));
    const std::string exposition = namm::testing::HttpGet(metrics, "/metrics");
    std::printf("%s", [&] {
      std::string lines;
      std::istringstream in(exposition);
      for (std::string line; std::getline(in, line);) {
        if (line.rfind("namm_store_", 0) == 0 && line.find("_bucket") == std::string::npos) lines += line + "\n";
      }
      return lines;
    }().c_str());
    ::kill(coordinator.pid, SIGTERM);
    exit_code = Wait(coordinator);
  }
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_EQ(exit_code, 0) << log;
  EXPECT_EQ(log.find("stopped"), std::string::npos) << log;
  double longest = 0;
  for (std::size_t at = log.find("] waited "); at != std::string::npos; at = log.find("] waited ", at + 1)) {
    longest = std::max(longest, std::stod(log.substr(at + 9)));
  }
  const std::string syncs = ReadText(r.dir + "/slow_syncs");
  std::printf("longest wait for the database: %.3f s; %zu slowed syncs of the database file\n", longest,
              static_cast<std::size_t>(std::count(syncs.begin(), syncs.end(), '\n')));
  EXPECT_FALSE(syncs.empty()) << "the shim slowed no sync";
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// Every prompt of the first task, for --fail.
std::vector<std::string> FailEveryPrompt() {
  std::vector<std::string> args;
  for (int64_t p = 0; p < kSimRows; ++p) args.insert(args.end(), {"--fail", "syn/story_recall:" + std::to_string(p)});
  return args;
}

TEST(Distribution, AWorkerWhosePromptsFailIsQuarantinedAndTheOthersFinish) {
  SimRun r("dist_failing_worker");
  Child coordinator = r.Serve();
  Child bad = r.SimWorker("sim-bad", FailEveryPrompt()), good = r.SimWorker("sim-good");
  EXPECT_EQ(Wait(bad), 1);
  EXPECT_NE(ReadText(r.log("sim-bad")).find("gives this worker no more work"), std::string::npos)
      << ReadText(r.log("sim-bad"));
  EXPECT_EQ(Wait(good), 0) << ReadText(r.log("sim-good"));
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_NE(log.find("could not run syn/story_recall prompt"), std::string::npos) << log;
  EXPECT_NE(log.find("failed 3 prompts in a row and gets no more work"), std::string::npos) << log;
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

// Drops, as the coordinator stored them, for an in-process run to repeat.
std::function<Status(Trainer&)> DropAsStored(const std::string& db) {
  const std::vector<DroppedPrompt> dropped = Store::Open(db, OpenMode::kReadOnly).value()->GetDroppedPrompts(1).value();
  return [dropped](Trainer& t) -> Status {
    for (const DroppedPrompt& d : dropped) {
      if (d.generation == t.plan().generation) NAMM_RETURN_IF_ERROR(t.Drop(d.task, d.prompt, d.error).status());
    }
    return Status::Ok();
  };
}

TEST(Distribution, PromptsFailingEverywhereBeyondTheDroppedShareStopTheRunWithTheirError) {
  SimRun r("dist_failing_prompt");
  // No quarantine here: with it, both workers could be quarantined after failing different prompts (a failed
  // prompt may go back to the worker that failed it) before any prompt failed on two, and the run would wait for
  // new workers forever (the quarantine has its own test above).
  Child coordinator = r.Serve({"--max-attempts", "2", "--quarantine-after", "1000000"});
  Child a = r.SimWorker("sim-a", FailEveryPrompt()), b = r.SimWorker("sim-b", FailEveryPrompt());
  EXPECT_EQ(Wait(coordinator), 1) << ReadText(r.log("coordinator"));
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_NE(log.find("failed on 2 different workers (last error: "), std::string::npos) << log;
  EXPECT_NE(log.find("simulated failure of syn/story_recall prompt"), std::string::npos) << log;
  EXPECT_NE(log.find("more than 5% (--max-dropped-share)"), std::string::npos) << log;
  EXPECT_NE(log.find("run the same command to resume"), std::string::npos) << log;
  // Nothing was lost: the run is where it stopped with the drop that stopped it stored, and resumes (here with a
  // healthy worker) to the end an in-process run with the same drop reaches.
  EXPECT_EQ(r.Progress().first, 0);
  EXPECT_EQ(Store::Open(r.db, OpenMode::kReadOnly).value()->GetDroppedPrompts(1)->size(), 1u);
  coordinator = r.Serve();
  Child healthy = r.SimWorker("sim-healthy");
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  EXPECT_EQ(Wait(healthy), 0);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml, DropAsStored(r.db)));
  // The failing workers were quarantined by the resumed coordinator (and exited), or were still waiting for a
  // coordinator to come back.
  for (Child* w : {&a, &b}) {
    WaitUntil([&] { return ::waitpid(w->pid, nullptr, WNOHANG) != 0; }, std::chrono::seconds(5));
    ::kill(w->pid, SIGKILL);
    ::waitpid(w->pid, nullptr, 0);
  }
}

// The same for a prompt every worker scores NaN (as a model whose logits overflow would): the worker reports it as
// its failure, so it uses attempts and is dropped (before, the coordinator refused the score, the worker forgot the
// prompt, and its lease expired and went back to the queue for ever, using no attempt).
TEST(Distribution, APromptFailingEverywhereIsDroppedForEveryCandidateAndTheRunGoesOn) {
  for (const auto& [option, error] : {std::make_pair("--fail", "simulated failure"),
                                      std::make_pair("--nan-score", "scored nan, not a number in [0, 1]")}) {
    SCOPED_TRACE(option);
    SimRun r(std::string("dist_dropped_prompt") + (option[2] == 'f' ? "" : "_nan"));
    const std::vector<std::string> fail = {option, "syn/story_recall:3"};
    Child coordinator = r.Serve({"--max-attempts", "2", "--max-dropped-share", "0.5", "--quarantine-after", "1000000"});
    Child a = r.SimWorker("sim-a", fail), b = r.SimWorker("sim-b", fail);
    EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
    EXPECT_EQ(Wait(a), 0);
    EXPECT_EQ(Wait(b), 0);
    EXPECT_NE(ReadText(r.log("coordinator")).find("dropped from generation"), std::string::npos);
    // Dropped wherever a generation planned it, and nowhere else: the in-process run dropping it everywhere ends
    // in the same state with the same evaluations.
    const InProcessRun expected(r.yaml, testing::DropEverywhere("syn/story_recall", 3));
    const auto got = Store::Open(r.db, OpenMode::kReadOnly).value()->GetDroppedPrompts(1).value();
    const auto want = expected.store->GetDroppedPrompts(1).value();
    ASSERT_EQ(got.size(), want.size());
    ASSERT_FALSE(got.empty());
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(std::tie(got[i].generation, got[i].task, got[i].prompt),
                std::tie(want[i].generation, want[i].task, want[i].prompt));
      EXPECT_NE(got[i].error.find(error), std::string::npos) << got[i].error;
    }
    ExpectSameAsInProcess(r.db, expected);
  }
}

// A raw client of the protocol, to send what no namm worker would.
class RawClient {
 public:
  explicit RawClient(const std::string& address, const std::string& token = "sim-run-shared-secret-0123456789")
      : RawClient(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), token) {}
  // Over a channel of the test's own (TLS).
  explicit RawClient(const std::shared_ptr<grpc::Channel>& channel,
                     const std::string& token = "sim-run-shared-secret-0123456789")
      : stub_(v1::Coordinator::NewStub(channel)), token_(token) {}

  void Authorize(grpc::ClientContext& c) const {
    if (!token_.empty()) c.AddMetadata("x-namm-token", token_);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }
  grpc::Status Register(const std::string& name, const std::string& fingerprint, const std::string& device,
                        int slots, v1::RegisterResponse* out, uint32_t protocol = v1::kProtocolVersion) {
    grpc::ClientContext c;
    Authorize(c);
    v1::RegisterRequest request;
    request.set_worker_name(name);
    request.mutable_capabilities()->set_model_fingerprint(fingerprint);
    request.mutable_capabilities()->set_device(device);
    request.mutable_capabilities()->set_max_concurrent_leases(slots);
    request.set_protocol_version(protocol);
    return stub_->Register(&c, request, out);
  }
  grpc::Status Report(const v1::ReportRequest& request, v1::ReportResponse* out = nullptr) {
    grpc::ClientContext c;
    Authorize(c);
    v1::ReportResponse ignored;
    return stub_->Report(&c, request, out != nullptr ? out : &ignored);
  }
  v1::Coordinator::Stub& stub() { return *stub_; }

 private:
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::string token_;
};

v1::PromptResult GoodResult(int64_t prompt) {
  v1::PromptResult r;
  r.set_prompt(prompt);
  r.set_score(0.25);
  r.set_cache_size_mean(100);
  r.set_cache_size_final(90);
  r.set_prompt_tokens(500);
  r.set_seconds(0.5);
  v1::NormStats* s = r.mutable_norm_stats();
  s->set_count(10);
  for (int i = 0; i < 17; ++i) {
    s->add_mean(i);
    s->add_var(1);
  }
  return r;
}

// Whether `status` has `code` and a message containing `words`.
::testing::AssertionResult Refused(const grpc::Status& status, grpc::StatusCode code, const std::string& words) {
  if (status.error_code() == code && status.error_message().find(words) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got code " << status.error_code() << " '" << status.error_message()
                                       << "', wanted code " << code << " with '" << words << "'";
}

// Whether a report was answered OK with nothing taken but `prompt` refused for a reason containing `words`.
::testing::AssertionResult PromptRefused(const grpc::Status& status, const v1::ReportResponse& response,
                                         int64_t prompt, const std::string& words) {
  if (!status.ok()) return ::testing::AssertionFailure() << "the report failed: " << status.error_message();
  if (response.accepted() != 0 || response.refused_size() != 1 || response.refused(0).prompt() != prompt ||
      response.refused(0).reason().find(words) == std::string::npos) {
    return ::testing::AssertionFailure() << "wanted prompt " << prompt << " refused with '" << words << "', got "
                                         << response.ShortDebugString();
  }
  return ::testing::AssertionSuccess();
}

// The run's stored state, to show that refused calls leave it alone.
std::string StoredState(const std::string& db) {
  SQLite::Database raw(db, SQLite::OPEN_READONLY);
  std::string out;
  for (const char* q : {"SELECT COUNT(*) FROM evaluations", "SELECT COUNT(*) FROM reference_scores",
                        "SELECT generation || status FROM runs", "SELECT hex(state) FROM checkpoints"}) {
    SQLite::Statement s(raw, q);
    while (s.executeStep()) out += s.getColumn(0).getString() + "|";
  }
  return out;
}

TEST(Distribution, BadWorkersAndResultsAreRefusedAndTheRunIsUntouched) {
  SimRun r("dist_refusals");
  // Reference scores imported: the first phase holds only the statistics phase's leases.
  nlohmann::json refs;
  for (const std::string task : {"syn/story_recall", "syn/story_recall_accuracy"}) {
    for (int64_t p = 0; p < kSimRows; ++p) refs[task][std::to_string(p)] = 0.5;
  }
  WriteText(r.dir + "/refs.json", refs.dump());
  ASSERT_EQ(RunProcess(kCoordinator + " import-reference --db " + r.db + " --model-fingerprint " + kSimFingerprint +
                       " --json " + r.dir + "/refs.json").exit_code, 0);
  Child coordinator = r.Serve({"--max-message-bytes", "65536"});
  RawClient client(r.address());
  v1::RegisterResponse reg;
  ASSERT_TRUE(WaitUntil([&] { return client.Register("w", kSimFingerprint, "cpu", 1, &reg).ok(); },
                        std::chrono::seconds(30)));
  // `namm-worker --device cuda` (and `namm-coordinator run --device cuda`'s workers) send the plain device name
  // (before, refused as not cuda:N after the model had loaded).
  ASSERT_TRUE(client.Register("w", kSimFingerprint, "cuda", 1, &reg).ok());
  const std::string before = StoredState(r.db);

  // Registration.
  EXPECT_TRUE(Refused(RawClient(r.address(), "").Register("w", kSimFingerprint, "cpu", 1, &reg),
                      grpc::StatusCode::UNAUTHENTICATED, "x-namm-token"));
  EXPECT_TRUE(Refused(RawClient(r.address(), "not-the-secret-at-all").Register("w", kSimFingerprint, "cpu", 1, &reg),
                      grpc::StatusCode::UNAUTHENTICATED, "wrong shared secret"));
  EXPECT_TRUE(Refused(client.Register("w", "sha256:" + std::string(64, 'b'), "cpu", 1, &reg),
                      grpc::StatusCode::FAILED_PRECONDITION, "model fingerprint"));
  EXPECT_TRUE(Refused(client.Register("", kSimFingerprint, "cpu", 1, &reg), grpc::StatusCode::INVALID_ARGUMENT,
                      "worker_name"));
  EXPECT_TRUE(Refused(client.Register("w", kSimFingerprint, "tpu:0", 1, &reg), grpc::StatusCode::INVALID_ARGUMENT,
                      "capabilities.device"));
  EXPECT_TRUE(Refused(client.Register("w", kSimFingerprint, "cpu", 0, &reg), grpc::StatusCode::INVALID_ARGUMENT,
                      "max_concurrent_leases"));
  EXPECT_TRUE(Refused(client.Register("w", kSimFingerprint, "cpu", 1, &reg, 0), grpc::StatusCode::FAILED_PRECONDITION,
                      "protocol version 0"));
  {
    grpc::ClientContext c;
    client.Authorize(c);
    v1::RegisterRequest request;
    request.set_worker_name("w");
    request.mutable_capabilities()->set_model_fingerprint(kSimFingerprint);
    request.mutable_capabilities()->set_device("cpu");
    request.mutable_capabilities()->set_max_concurrent_leases(1);
    request.set_protocol_version(v1::kProtocolVersion);
    request.add_held_leases()->set_lease_id(5);
    EXPECT_TRUE(Refused(client.stub().Register(&c, request, &reg), grpc::StatusCode::INVALID_ARGUMENT, "has no kind"));
  }

  // A registered worker gets a statistics-phase lease of the mean, with its parameters.
  ASSERT_TRUE(client.Register("raw", kSimFingerprint, "cpu", 1, &reg).ok());
  grpc::ClientContext stream;
  client.Authorize(stream);
  v1::LeasesRequest leases_request;
  leases_request.set_worker_id(reg.worker_id());
  auto reader = client.stub().Leases(&stream, leases_request);
  v1::WorkBatch batch;
  ASSERT_TRUE(reader->Read(&batch));
  ASSERT_EQ(batch.leases_size(), 1);
  const v1::Lease lease = batch.leases(0);
  EXPECT_EQ(lease.kind(), v1::Lease::KIND_CANDIDATE);
  EXPECT_EQ(lease.candidate(), -1);
  EXPECT_TRUE(lease.collect_norm_stats());
  ASSERT_EQ(batch.parameters_size(), 1);
  EXPECT_EQ(batch.parameters(0).values_size(), 676);
  const int64_t prompt = lease.prompts(0);

  v1::ReportResponse response;
  auto report = [&](const std::function<void(v1::PromptResult&)>& edit) {
    v1::ReportRequest request;
    request.set_worker_id(reg.worker_id());
    request.set_lease_id(lease.lease_id());
    *request.add_results() = GoodResult(prompt);
    edit(*request.mutable_results(0));
    response.Clear();
    return client.Report(request, &response);
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // A malformed or unexpected result is refused on its own, naming why (the rest of a report would be taken).
  EXPECT_TRUE(PromptRefused(report([&](auto& x) { x.set_score(nan); }), response, prompt, "score"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.set_score(1.5); }), response, prompt, "in [0, 1]"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.set_cache_size_mean(std::numeric_limits<double>::infinity()); }),
                            response, prompt, "cache_size_mean"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.set_seconds(-1); }), response, prompt, "seconds"));
  // Numbers past any real prompt's, whose sums made a fitness infinite (a stopped run, at every resume), the frozen
  // statistics' count negative (a run that no longer opens) or a worker's speed infinite.
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.set_cache_size_mean(1e308); }), response, prompt,
                            "cache_size_mean 1e+308 is not in [0, 501] (the prompt's tokens + 1)"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.set_cache_size_final(502); }), response, prompt,
                            "cache_size_final 502 is not in [0, 501]"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.set_generated_tokens(int64_t{1} << 40); }), response, prompt,
                            "token counts must be in [0, 2^31]"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.set_seconds(5e-324); }), response, prompt, "seconds 4.94066e-324"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.mutable_norm_stats()->set_count(INT64_MAX); }), response, prompt,
                            "count 9223372036854775807 is not in [0, 2^40]"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.mutable_norm_stats()->set_mean(2, 1e200); }), response, prompt,
                            "bin 2 has a mean outside"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.clear_norm_stats(); }), response, prompt, "norm_stats are required"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.mutable_norm_stats()->mutable_mean()->RemoveLast(); }), response,
                            prompt, "17 values"));
  EXPECT_TRUE(PromptRefused(report([&](auto& x) { x.mutable_norm_stats()->set_var(3, nan); }), response, prompt,
                            "bin 3"));
  EXPECT_TRUE(PromptRefused(report([](auto& x) { x.set_prompt(kSimRows + 5); }), response, kSimRows + 5,
                            "not part of lease"));
  {
    v1::ReportRequest request;
    request.set_worker_id(reg.worker_id());
    const uint64_t unknown = lease.lease_id() + 987654;  // above every lease handed out
    request.set_lease_id(unknown);
    *request.add_results() = GoodResult(prompt);
    // An unknown lease is refused per prompt (NOT_FOUND means an unknown worker, who registers again).
    EXPECT_TRUE(PromptRefused(client.Report(request, &response), response, prompt,
                              "unknown lease " + std::to_string(unknown)));
    request.set_lease_id(lease.lease_id());
    *request.add_results() = GoodResult(prompt);
    EXPECT_TRUE(Refused(client.Report(request), grpc::StatusCode::INVALID_ARGUMENT, "reported twice"));
    request.mutable_results()->RemoveLast();
    request.set_worker_id("w-not-registered");
    EXPECT_TRUE(Refused(client.Report(request), grpc::StatusCode::NOT_FOUND, "register again"));
    request.set_worker_id(reg.worker_id());
    EXPECT_TRUE(Refused(RawClient(r.address(), "not-the-secret-at-all").Report(request),
                        grpc::StatusCode::UNAUTHENTICATED, "wrong shared secret"));
    // Larger than --max-message-bytes.
    for (int i = 0; i < 20000; ++i) request.mutable_results(0)->mutable_norm_stats()->add_mean(1);
    EXPECT_EQ(client.Report(request).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  EXPECT_EQ(StoredState(r.db), before) << "refused calls changed the stored run";

  // A report with a prompt the coordinator does not expect takes the rest and names that one; a copy of a taken
  // result is a counted duplicate.
  {
    v1::ReportRequest request;
    request.set_worker_id(reg.worker_id());
    request.set_lease_id(lease.lease_id());
    *request.add_results() = GoodResult(kSimRows + 7);
    *request.add_results() = GoodResult(prompt);
    ASSERT_TRUE(client.Report(request, &response).ok());
    EXPECT_EQ(response.accepted(), 1);
    ASSERT_EQ(response.refused_size(), 1) << response.ShortDebugString();
    EXPECT_EQ(response.refused(0).prompt(), kSimRows + 7);
    EXPECT_NE(response.refused(0).reason().find("is not part of lease " + std::to_string(lease.lease_id())),
              std::string::npos);
    request.mutable_results()->DeleteSubrange(0, 1);
    ASSERT_TRUE(client.Report(request, &response).ok());
    EXPECT_EQ(response.accepted(), 0);
    EXPECT_EQ(response.duplicates(), 1);
    EXPECT_EQ(response.refused_size(), 0);
  }

  // Real namm-worker daemons with a wrong secret or another model are refused and say why.
  const std::string model = std::string(NAMM_SHARED_DIR) + "/models/stories260K/stories260K.bin";
  if (std::filesystem::exists(model)) {
    const std::string wrong_token = r.dir + "/wrong-token";
    WriteText(wrong_token, "another-secret-0123456789");
    const std::string worker = kWorker + " serve --insecure-plaintext --coordinator " + r.address() + " --model " +
                               model + " --tokenizer " + NAMM_SHARED_DIR + "/models/stories260K/tok512.bin --token-file ";
    const auto wrong_model = RunProcess(worker + r.token);
    EXPECT_EQ(wrong_model.exit_code, 1);
    EXPECT_NE(wrong_model.output.find("has model fingerprint 'sha256:"), std::string::npos) << wrong_model.output;
    const auto wrong_secret = RunProcess(worker + wrong_token);
    EXPECT_EQ(wrong_secret.exit_code, 1);
    EXPECT_NE(wrong_secret.output.find("wrong shared secret"), std::string::npos) << wrong_secret.output;
  }
  stream.TryCancel();
  reader->Finish();

  // SIGTERM stores what arrived and exits cleanly: exactly the one accepted result.
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  EXPECT_NE(ReadText(r.log("coordinator")).find("SIGTERM: stopping at generation 0"), std::string::npos);
  auto store = Store::Open(r.db, OpenMode::kReadOnly).value();
  const auto evaluations = store->GetEvaluations(1, 0).value();
  ASSERT_EQ(evaluations.size(), 1u);
  EXPECT_EQ(evaluations[0].prompt, prompt);
  EXPECT_EQ(evaluations[0].score, 0.25);
  EXPECT_EQ(evaluations[0].worker, "raw");
}

// Lease ids are the coordinator's: a held lease it never issued is not kept at a registration (earlier, it was
// activated, a later lease took the same id, and its prompts were stranded), and the run goes on.
TEST(Distribution, ALeaseNeverIssuedIsNotKeptAtARegistration) {
  SimRun r("dist_forged_lease", 1, 1);
  Child coordinator = r.Serve();
  RawClient forger(r.address());
  v1::RegisterResponse reg;
  ASSERT_TRUE(WaitUntil([&] { return forger.Register("honest", kSimFingerprint, "cpu", 1, &reg).ok(); },
                        std::chrono::seconds(30)));
  grpc::ClientContext c;
  forger.Authorize(c);
  v1::RegisterRequest request;
  request.set_worker_name("forger");
  request.mutable_capabilities()->set_model_fingerprint(kSimFingerprint);
  request.mutable_capabilities()->set_device("cpu");
  request.mutable_capabilities()->set_max_concurrent_leases(1);
  request.set_protocol_version(v1::kProtocolVersion);
  // The first lease a fresh run's coordinator issues (epoch 1): nothing has been leased yet.
  const uint64_t next = (uint64_t{1} << 32) + 1;
  v1::HeldLease* held = request.add_held_leases();
  held->set_lease_id(next);
  held->set_kind(v1::Lease::KIND_CANDIDATE);
  held->set_generation(0);
  held->set_candidate(-1);
  held->set_task("syn/story_recall");
  for (int64_t p = 0; p < kSimRows; ++p) held->add_prompts(p);
  ASSERT_TRUE(forger.stub().Register(&c, request, &reg).ok());
  EXPECT_EQ(reg.kept_leases_size(), 0);
  EXPECT_NE(ReadText(r.log("coordinator"))
                .find("worker 'forger' registered holding lease " + std::to_string(next) +
                      ", which it cannot hold (this coordinator never issued it): not kept"),
            std::string::npos)
      << ReadText(r.log("coordinator"));
  Child worker = r.SimWorker("sim-0");
  EXPECT_EQ(Wait(coordinator, std::chrono::seconds(120)), 0) << ReadText(r.log("coordinator"));
  EXPECT_EQ(Wait(worker), 0);
  ExpectSameAsInProcess(r.db, InProcessRun(r.yaml));
}

TEST(Distribution, APeerGuessingTheSecretOrOpeningTooManyStreamsIsRefused) {
  SimRun r("dist_peer_limits");
  Child coordinator = r.Serve({"--max-auth-failures-per-peer", "3", "--max-streams-per-peer", "1"});
  RawClient client(r.address());
  v1::RegisterResponse reg, reg2;
  ASSERT_TRUE(WaitUntil([&] { return client.Register("a", kSimFingerprint, "cpu", 1, &reg).ok(); },
                        std::chrono::seconds(30)));
  ASSERT_TRUE(client.Register("b", kSimFingerprint, "cpu", 1, &reg2).ok());
  // One stream per address here: the second is refused while the first is open.
  grpc::ClientContext first, second;
  client.Authorize(first);
  client.Authorize(second);
  v1::LeasesRequest a, b;
  a.set_worker_id(reg.worker_id());
  b.set_worker_id(reg2.worker_id());
  auto stream_a = client.stub().Leases(&first, a);
  v1::WorkBatch batch;
  ASSERT_TRUE(stream_a->Read(&batch));
  auto stream_b = client.stub().Leases(&second, b);
  EXPECT_FALSE(stream_b->Read(&batch));
  EXPECT_TRUE(Refused(stream_b->Finish(), grpc::StatusCode::RESOURCE_EXHAUSTED, "lease streams open already"));
  first.TryCancel();
  // Three wrong secrets from this address lock it out: its calls without the secret are refused at once for a
  // minute, while workers presenting the secret from the same address (behind NAT, on one host) are not.
  RawClient guesser(r.address(), "not-the-secret-at-all");
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(guesser.Register("g", kSimFingerprint, "cpu", 1, &reg).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_TRUE(Refused(guesser.Register("g", kSimFingerprint, "cpu", 1, &reg), grpc::StatusCode::RESOURCE_EXHAUSTED,
                      "too many authentication failures"));
  EXPECT_TRUE(Refused(RawClient(r.address(), "").Register("g", kSimFingerprint, "cpu", 1, &reg),
                      grpc::StatusCode::RESOURCE_EXHAUSTED, "no x-namm-token"));
  EXPECT_TRUE(client.Register("c", kSimFingerprint, "cpu", 1, &reg).ok()) << "a worker with the secret at that address";
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_NE(log.find("failed authentication 3 times: its calls without the right secret are refused for 60 s"),
            std::string::npos) << log;
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0);
}

TEST(Distribution, MutualTlsAdmitsOnlyWorkersWithACertificateFromTheCa) {
  SimRun r("dist_tls");
  const std::string d = r.dir + "/tls/";
  // The certificates the deployment files expect, made by the script they name.
  const auto made = RunProcess(std::string(NAMM_SOURCE_DIR) + "/deploy/tls/make-certs.sh " + d + " localhost 127.0.0.1");
  ASSERT_EQ(made.exit_code, 0) << made.output;
  Child coordinator = r.Serve({"--tls-cert", d + "server.pem", "--tls-key", d + "server.key", "--tls-client-ca",
                               d + "ca.pem"});
  auto connect = [&](bool with_certificate) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ReadText(d + "ca.pem");
    if (with_certificate) {
      o.pem_cert_chain = ReadText(d + "worker.pem");
      o.pem_private_key = ReadText(d + "worker.key");
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return RawClient(grpc::CreateCustomChannel(r.address(), grpc::SslCredentials(o), args));
  };
  auto try_register = [&](RawClient&& client) {
    v1::RegisterResponse response;
    return client.Register("tls", kSimFingerprint, "cpu", 1, &response);
  };
  ASSERT_TRUE(WaitUntil([&] { return try_register(connect(true)).ok(); }, std::chrono::seconds(30)))
      << ReadText(r.log("coordinator"));
  EXPECT_FALSE(try_register(connect(false)).ok()) << "a client without a certificate got in";
  EXPECT_FALSE(try_register(RawClient(r.address())).ok()) << "a plaintext client got in";
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
}

// Over TLS the secret is checked on a call's metadata before gRPC reads its body: a body that is no message at
// all is refused for its missing secret, not parsed (a peer without the secret once held 1.16 GB of the server in
// unfinished 3.9 MB bodies). Server-only TLS, where any client connects.
TEST(Distribution, OverTlsACallWithoutTheSecretIsRefusedBeforeItsBodyIsRead) {
  SimRun r("dist_tls_before_body");
  const std::string d = r.dir + "/tls/";
  const auto made = RunProcess(std::string(NAMM_SOURCE_DIR) + "/deploy/tls/make-certs.sh " + d + " localhost 127.0.0.1");
  ASSERT_EQ(made.exit_code, 0) << made.output;
  Child coordinator = r.Serve({"--tls-cert", d + "server.pem", "--tls-key", d + "server.key",
                               "--max-auth-failures-per-peer", "3"});
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadText(d + "ca.pem");
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  const auto channel = grpc::CreateCustomChannel(r.address(), grpc::SslCredentials(o), args);
  grpc::GenericStub generic(channel);
  // A Register call whose body is bytes no protobuf parser takes (a field of wire type 7).
  auto call = [&](const std::string& token) {
    const std::string junk(64, '\x0f');
    grpc::Slice slice(junk);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext c;
    if (!token.empty()) c.AddMetadata("x-namm-token", token);
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    // On a completion queue this thread polls (no callback thread: ThreadSanitizer cannot see the hand-over in
    // Debian's gRPC).
    grpc::CompletionQueue queue;
    auto pending = generic.PrepareUnaryCall(&c, "/namm.v1.Coordinator/Register", request, &queue);
    pending->StartCall();
    grpc::Status status;
    pending->Finish(&response, &status, &queue);
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(queue.Next(&tag, &ok));
    queue.Shutdown();
    while (queue.Next(&tag, &ok)) {
    }
    return status;
  };
  ASSERT_TRUE(WaitUntil([&] { return call("").error_code() != grpc::StatusCode::UNAVAILABLE; },
                        std::chrono::seconds(30))) << ReadText(r.log("coordinator"));
  // With the secret the body is read, and refused as what it is.
  const grpc::Status with_secret = call("sim-run-shared-secret-0123456789");
  EXPECT_NE(with_secret.error_code(), grpc::StatusCode::OK);
  EXPECT_NE(with_secret.error_code(), grpc::StatusCode::UNAUTHENTICATED) << with_secret.error_message();
  // Without it (the first call above was one), or with a wrong one, the body never is: the refusal names the
  // secret, and the address is locked out after three, as in the handlers.
  EXPECT_TRUE(Refused(call("not-the-secret-at-all"), grpc::StatusCode::UNAUTHENTICATED, "wrong shared secret"));
  EXPECT_TRUE(Refused(call("not-the-secret-either"), grpc::StatusCode::UNAUTHENTICATED, "wrong shared secret"));
  EXPECT_TRUE(Refused(call(""), grpc::StatusCode::RESOURCE_EXHAUSTED, "too many authentication failures from TLS peers"));
  // A worker with the secret still gets in.
  v1::RegisterResponse response;
  EXPECT_TRUE(RawClient(channel).Register("tls", kSimFingerprint, "cpu", 1, &response).ok());
  ::kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(Wait(coordinator), 0) << ReadText(r.log("coordinator"));
  const std::string log = ReadText(r.log("coordinator"));
  EXPECT_NE(log.find("failed authentication 3 times"), std::string::npos) << log;
}

// The bundled model (../shared) and a fresh directory for a run on it.
struct StoriesSetup {
  std::string model = std::string(NAMM_SHARED_DIR) + "/models/stories260K/stories260K.bin";
  std::string tokenizer = std::string(NAMM_SHARED_DIR) + "/models/stories260K/tok512.bin";
  std::string dir, model_flags = " --model " + model + " --tokenizer " + tokenizer;

  explicit StoriesSetup(const std::string& name) : dir(namm::testing::TempPath(name)) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
};

// run --device gives each local worker its device in turn; a device this machine lacks fails that worker with
// the worker's own message and the others finish the run. A malformed device is refused before anything runs.
TEST(Distribution, LocalWorkersGetTheirDevicesInTurn) {
  const StoriesSetup setup("dist_devices");
  if (!std::filesystem::exists(setup.model)) GTEST_SKIP() << setup.model << " is missing (../shared)";
  const std::string &model = setup.model, &tokenizer = setup.tokenizer, &dir = setup.dir;
  const std::string& model_flags = setup.model_flags;
  ASSERT_EQ(RunProcess(kWorker + " build-synthetic" + model_flags + " --out " + dir + "/story_recall.jsonl --rows 4 "
                       "--pool 4 --story-tokens 100 --prefix-tokens 60 --continuation-tokens 20 --distractor-tokens 500")
                .exit_code,
            0);
  const auto fingerprint = RunProcess(kWorker + " fingerprint" + model_flags);
  ASSERT_EQ(fingerprint.exit_code, 0) << fingerprint.output;
  WriteText(dir + "/spec.yaml", "name: devices\nmodel: {path: " + model + ", tokenizer: " + tokenizer +
                                    ", fingerprint: " + fingerprint.output.substr(0, fingerprint.output.find('\n')) +
                                    "}\ncmaes: {population: 4, seed: 1}\nprompts_per_task: 2\neval_prompts: 2\n"
                                    "stages:\n  - {tasks: [syn/story_recall], generations: 1}\n");
  const std::string run = kCoordinator + " run --config " + dir + "/spec.yaml --db " + dir + "/run.db --data-dir synthetic=" +
                          dir + " --local-workers 2 --log-level info";
  const auto refused = RunProcess(run + " --device cpu,gpu0");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("--device: 'gpu0' is not cpu, cuda or cuda:N"), std::string::npos) << refused.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/run.db"));

  const auto ran = RunProcess(run + " --device cuda:0,cpu");
  EXPECT_NE(ran.output.find("worker 'local-1' registered as "), std::string::npos) << ran.output;
  EXPECT_NE(ran.output.find(" (cpu, "), std::string::npos) << ran.output;
  const bool cuda = ran.output.find(" (cuda:0, ") != std::string::npos;
  if (!cuda) {  // no GPU here: local-0 says why and local-1 runs everything
    EXPECT_NE(ran.output.find("[local-0] namm-worker: error: --device cuda:0: this build or machine has no CUDA"),
              std::string::npos)
        << ran.output;
  }
  EXPECT_EQ(ran.exit_code, 0) << ran.output;
}

// The complete small run: stories260K on the synthetic story-recall task, population 8, 3 generations,
// 2 local namm-worker processes, ending with an exported NAMM. Scores stored by the workers are checked against
// namm-worker run-task on the same prompts.
TEST(Distribution, StoriesRunWithTwoLocalWorkersEndsWithAnExportedNamm) {
  const StoriesSetup setup("dist_stories");
  if (!std::filesystem::exists(setup.model)) GTEST_SKIP() << setup.model << " is missing (../shared)";
  const std::string &model = setup.model, &tokenizer = setup.tokenizer, &dir = setup.dir;
  const std::string& model_flags = setup.model_flags;
  const auto built = RunProcess(kWorker + " build-synthetic" + model_flags + " --out " + dir +
                                "/story_recall.jsonl --rows 8 --pool 8 --story-tokens 100 --prefix-tokens 60 "
                                "--continuation-tokens 20 --distractor-tokens 500");
  ASSERT_EQ(built.exit_code, 0) << built.output;
  const auto fingerprint = RunProcess(kWorker + " fingerprint" + model_flags);
  ASSERT_EQ(fingerprint.exit_code, 0) << fingerprint.output;
  const std::string sha = fingerprint.output.substr(0, fingerprint.output.find('\n'));
  ASSERT_EQ(sha.size(), 7u + 64u) << fingerprint.output;
  EXPECT_EQ(load_run_spec(std::string(NAMM_RUNS_DIR) + "/stories-cpu.yaml")->model.fingerprint, sha)
      << "the shipped stories-cpu.yaml names another model";
  WriteText(dir + "/spec.yaml", "name: stories-test\n"
                                "model: {path: " + model + ", tokenizer: " + tokenizer + ", fingerprint: " + sha + "}\n"
                                "namm: {scorer: bam, hidden: 32, selection: binary}\n"
                                "cmaes: {population: 8, sigma0: 0.065, seed: 3}\n"
                                "prompts_per_task: 2\n"
                                "eval_interval: 2\n"
                                "eval_prompts: 2\n"
                                "stages:\n"
                                "  - {tasks: [syn/story_recall], generations: 3}\n");
  const std::string db = dir + "/run.db";
  const auto run = RunProcess(kCoordinator + " run --config " + dir + "/spec.yaml --db " + db +
                              " --local-workers 2 --data-dir synthetic=" + dir + " --log-level debug");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  // The workers' log lines come whole, each prefixed with its worker's name.
  EXPECT_NE(run.output.find("\n[local-0] "), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("\n[local-1] "), std::string::npos) << run.output;
  for (std::size_t at = run.output.find("[local-"); at != std::string::npos; at = run.output.find("[local-", at + 1)) {
    EXPECT_TRUE(at == 0 || run.output[at - 1] == '\n') << "a worker's line mixed into another at " << at;
  }
  for (const char* line : {"normalization statistics frozen", "generation 0 (stage 0) | best ",
                           "generation 2 (stage 0) | best ", "run 'stories-test' finished"}) {
    EXPECT_NE(run.output.find(line), std::string::npos) << line << "\n" << run.output;
  }

  {
    SQLite::Database raw(db, SQLite::OPEN_READONLY);
    EXPECT_EQ(raw.execAndGet("SELECT status FROM runs").getString(), "finished");
    EXPECT_EQ(raw.execAndGet("SELECT COUNT(*) FROM generations").getInt64(), 3);
    EXPECT_EQ(raw.execAndGet("SELECT COUNT(*) FROM evaluations WHERE generation = 1").getInt64(), 8 * 2);
    // Every result from the two local workers, both of which served (how the work split is timing: on a loaded
    // machine one worker, its model still loading, once found the other had done every unit).
    EXPECT_EQ(raw.execAndGet("SELECT COUNT(*) FROM evaluations WHERE worker NOT IN ('local-0', 'local-1')").getInt64(),
              0);
  }
  for (const char* worker : {"worker 'local-0' registered as ", "worker 'local-1' registered as "}) {
    EXPECT_NE(run.output.find(worker), std::string::npos) << worker << "\n" << run.output;
  }
  // status --generations: a row per generation (generation, stage, best, mean, std, sigma, eval of the mean).
  const auto status = RunProcess(kCoordinator + " status --db " + db + " --generations");
  ASSERT_EQ(status.exit_code, 0) << status.output;
  for (const char* row : {"\n           0     0 ", "\n           1     0 ", "\n           2     0 "}) {
    EXPECT_NE(status.output.find(row), std::string::npos) << status.output;
  }

  auto store = Store::Open(db, OpenMode::kReadOnly).value();
  // A reference score the workers computed (full cache) is what run-task computes for that prompt.
  const tasks::ReferenceScores references = store->GetReferenceScores(sha).value();
  ASSERT_FALSE(references.scores().at("syn/story_recall").empty());
  const auto& [prompt, reference] = *references.scores().at("syn/story_recall").begin();
  const auto base = RunProcess(kWorker + " run-task" + model_flags + " --task syn/story_recall --data-dir synthetic=" +
                               dir + " --rows " + std::to_string(prompt) + " --json");
  ASSERT_EQ(base.exit_code, 0) << base.output;
  EXPECT_NEAR(nlohmann::json::parse(base.output)["rows"][0]["score"].get<double>(), reference, 1e-6);

  // Generation 1's best candidate, exported, scores what its worker reported.
  const GenerationRecord g1 = store->GetGeneration(1, 1).value();
  const std::string best1 = dir + "/gen1-best.namm";
  ASSERT_EQ(RunProcess(kCoordinator + " export --db " + db + " --generation 1 --params best --out " + best1).exit_code, 0);
  const EvaluationRecord* reported = nullptr;
  const auto evaluations = store->GetEvaluations(1, 1).value();
  for (const EvaluationRecord& e : evaluations) {
    if (e.candidate == g1.best_candidate) reported = &e;
  }
  ASSERT_NE(reported, nullptr);
  const auto rerun = RunProcess(kWorker + " run-task" + model_flags + " --task syn/story_recall --data-dir synthetic=" +
                                dir + " --rows " + std::to_string(reported->prompt) + " --namm " + best1 + " --json");
  ASSERT_EQ(rerun.exit_code, 0) << rerun.output;
  EXPECT_NEAR(nlohmann::json::parse(rerun.output)["rows"][0]["score"].get<double>(), reported->score, 1e-6);

  // The run's result, exported.
  const std::string out = dir + "/best.namm";
  const auto exported = RunProcess(kCoordinator + " export --db " + db + " --best --out " + out);
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  auto namm = read_namm_file(out);
  ASSERT_TRUE(namm.ok()) << namm.status().ToString();
  EXPECT_EQ(namm->params.size(), 4172u);
  EXPECT_EQ(namm->norm_state, NormState::kFrozen);
}

}  // namespace
}  // namespace namm::coordinator
