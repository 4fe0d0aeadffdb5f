// Observability end to end: a real training run (namm-coordinator run with a local namm-worker on stories260K)
// serving /metrics; the expositions pass `promtool check metrics`; a real Prometheus server on loopback scrapes
// them and answers queries through its HTTP API; and every metric name the Grafana dashboard and the alert rules
// use is exposed.
#include <gtest/gtest.h>
#include <signal.h>
#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "../process_util.h"
#include "../temp_path.h"

namespace namm::coordinator {
namespace {

using namm::testing::Child;
using namm::testing::FreePort;
using namm::testing::HttpGet;
using namm::testing::ReadText;
using namm::testing::RunProcess;
using namm::testing::Spawn;
using namm::testing::WaitUntil;
using namm::testing::WriteText;

const std::string kCoordinator = NAMM_COORDINATOR_PATH;
const std::string kWorker = NAMM_WORKER_PATH;
const std::string kSimWorker = NAMM_SIM_WORKER_PATH;
const std::string kSource = NAMM_SOURCE_DIR;

bool OnPath(const std::string& program) { return RunProcess("command -v " + program).exit_code == 0; }

// The value of the first sample `series` (a name, or a name with labels as exposed) in a text exposition.
std::optional<double> Sample(const std::string& exposition, const std::string& series) {
  std::istringstream lines(exposition);
  for (std::string line; std::getline(lines, line);) {
    if (line.compare(0, series.size(), series) == 0 && line.size() > series.size() &&
        (line[series.size()] == ' ' || (series.find('{') == std::string::npos && line[series.size()] == '{'))) {
      return std::stod(line.substr(line.rfind(' ') + 1));
    }
  }
  return std::nullopt;
}

// Names of the samples in an exposition (histograms contribute _bucket, _sum and _count).
std::set<std::string> SampleNames(const std::string& exposition) {
  std::set<std::string> names;
  std::istringstream lines(exposition);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    names.insert(line.substr(0, line.find_first_of("{ ")));
  }
  return names;
}

// A training run that outlives the tests: the coordinator with one local worker, both serving metrics.
class Observability : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string shared = NAMM_SHARED_DIR;
    const std::string model = shared + "/models/stories260K/stories260K.bin";
    const std::string tokenizer = shared + "/models/stories260K/tok512.bin";
    if (!std::filesystem::exists(model)) {
      skip_ = model + " is missing (../shared)";
      return;
    }
    dir_ = namm::testing::TempPath("observability");
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    const std::string model_flags = " --model " + model + " --tokenizer " + tokenizer;
    const auto built = RunProcess(kWorker + " build-synthetic" + model_flags + " --out " + dir_ +
                                  "/story_recall.jsonl --rows 8 --pool 8 --story-tokens 100 --prefix-tokens 60 "
                                  "--continuation-tokens 20 --distractor-tokens 500");
    ASSERT_EQ(built.exit_code, 0) << built.output;
    const auto fingerprint = RunProcess(kWorker + " fingerprint" + model_flags);
    ASSERT_EQ(fingerprint.exit_code, 0) << fingerprint.output;
    WriteText(dir_ + "/spec.yaml", "name: observed\n"
                                   "model: {path: " + model + ", tokenizer: " + tokenizer + ", fingerprint: " +
                                       fingerprint.output.substr(0, fingerprint.output.find('\n')) + "}\n"
                                   "namm: {scorer: bam, hidden: 32, selection: binary}\n"
                                   "cmaes: {population: 4, sigma0: 0.065, seed: 5}\n"
                                   "prompts_per_task: 2\n"
                                   "eval_interval: 1\n"
                                   "eval_prompts: 2\n"
                                   "stages:\n"
                                   "  - {tasks: [syn/story_recall], generations: 1000}\n");
    metrics_port_ = FreePort();
    coordinator_ = Spawn({kCoordinator, "run", "--config", dir_ + "/spec.yaml", "--db", dir_ + "/run.db",
                          "--local-workers", "1", "--data-dir", "synthetic=" + dir_, "--metrics-listen",
                          "127.0.0.1:" + std::to_string(metrics_port_)},
                         log());
    // A committed generation, so that the fitness gauges exist.
    ASSERT_TRUE(WaitUntil([] { return Scrape(metrics_port_).find("namm_population_fitness_mean{") != std::string::npos; },
                          std::chrono::seconds(120)))
        << ReadText(log());
    // A refused worker (wrong secret), so that the rejection counter has a series.
    const std::string logged = ReadText(log());
    std::smatch port;
    ASSERT_TRUE(std::regex_search(logged, port, std::regex("serving run 'observed' on port (\\d+)"))) << logged;
    WriteText(dir_ + "/wrong-token", "not-the-run-secret-0123456789\n");
    const auto refused = RunProcess(kSimWorker + " --coordinator 127.0.0.1:" + port[1].str() + " --token-file " +
                                    dir_ + "/wrong-token --fingerprint sha256:x --tasks syn/story_recall --data-dir "
                                    "synthetic=" + dir_);
    EXPECT_NE(refused.exit_code, 0);
    EXPECT_NE(refused.output.find("wrong shared secret"), std::string::npos) << refused.output;
  }

  static void TearDownTestSuite() {
    if (coordinator_.pid > 0) {
      ::kill(coordinator_.pid, SIGTERM);
      EXPECT_EQ(namm::testing::Wait(coordinator_), 0) << ReadText(log());
    }
  }

  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }

  static std::string log() { return dir_ + "/run.log"; }
  static std::string Scrape(int port) { return HttpGet(port, "/metrics"); }

  static inline std::string skip_, dir_;
  static inline int metrics_port_ = 0;  // the coordinator's; the worker's is the next one
  static inline Child coordinator_;
};

TEST_F(Observability, BothExpositionsPassPromtoolAndCountWhatHappened) {
  if (!OnPath("promtool")) GTEST_SKIP() << "promtool is missing (Debian package prometheus: scripts/install-deps.sh)";
  // The run loop takes the service's counters into the metrics at its next tick: the refused worker of the setup
  // shows once one has passed.
  std::string coordinator;
  const auto refusal_counted = [&] {
    coordinator = Scrape(metrics_port_);
    return Sample(coordinator, "namm_requests_rejected_total{run=\"observed\",code=\"UNAUTHENTICATED\"}")
               .value_or(0) >= 1.0;
  };
  EXPECT_TRUE(namm::testing::WaitUntil(refusal_counted, std::chrono::seconds(10)))
      << "the refused worker was not counted";
  const std::string worker = Scrape(metrics_port_ + 1);
  ASSERT_FALSE(worker.empty()) << "no worker metrics at port " << metrics_port_ + 1;
  for (const auto& [name, text] : std::map<std::string, std::string>{{"coordinator", coordinator}, {"worker", worker}}) {
    const std::string file = dir_ + "/" + name + ".prom";
    WriteText(file, text);
    const auto check = RunProcess("promtool check metrics < " + file);
    EXPECT_EQ(check.exit_code, 0) << name << ": " << check.output;
    EXPECT_EQ(check.output, "") << name << " exposition has lint problems";
  }
  // The numbers say what the run did.
  EXPECT_EQ(Sample(coordinator, "namm_run_info"), 1.0);
  EXPECT_GE(Sample(coordinator, "namm_run_generation{run=\"observed\"}").value_or(-1), 1.0);
  EXPECT_EQ(Sample(coordinator, "namm_run_generations{run=\"observed\"}"), 1000.0);
  EXPECT_EQ(Sample(coordinator, "namm_workers{run=\"observed\",state=\"connected\"}"), 1.0);
  EXPECT_GE(Sample(coordinator, "namm_requests_rejected_total{run=\"observed\",code=\"UNAUTHENTICATED\"}").value_or(0),
            1.0);
  EXPECT_GT(Sample(coordinator, "namm_units_completed_total").value_or(0), 0.0);
  EXPECT_GT(Sample(coordinator, "namm_cmaes_sigma").value_or(0), 0.0);
  EXPECT_GE(Sample(coordinator, "namm_generations_completed_total").value_or(0), 1.0);
  const double fitness = Sample(coordinator, "namm_population_fitness_mean").value_or(-1);
  EXPECT_GT(fitness, 0.0);
  EXPECT_GT(Sample(coordinator, "namm_eval_task_normalized_score{run=\"observed\",task=\"syn/story_recall\"}").value_or(0),
            0.0);
  EXPECT_GT(Sample(worker, "namm_worker_prompts_completed_total").value_or(0), 0.0);
  EXPECT_GT(Sample(worker, "namm_worker_prefill_tokens_total").value_or(0), 0.0);
  EXPECT_GT(Sample(worker, "namm_worker_prefill_tokens_per_second").value_or(0), 0.0);
  EXPECT_GT(Sample(worker, "namm_worker_device_memory_bytes").value_or(0), 1e6);
  EXPECT_EQ(Sample(worker, "namm_worker_connected"), 1.0);
  EXPECT_EQ(Sample(worker, "namm_worker_errors_total{kind=\"prompt\"}"), 0.0);
  // A prompt's latency is observed once per prompt.
  EXPECT_EQ(Sample(worker, "namm_worker_prompt_duration_seconds_count"),
            Sample(worker, "namm_worker_prompts_completed_total"));
}

TEST_F(Observability, APrometheusServerScrapesTheRunAndAnswersQueries) {
  if (!OnPath("prometheus")) GTEST_SKIP() << "prometheus is missing (Debian package prometheus: scripts/install-deps.sh)";
  const int port = FreePort();
  WriteText(dir_ + "/prometheus.yml", "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                                      "scrape_configs:\n"
                                      "  - job_name: namm-coordinator\n"
                                      "    static_configs: [{targets: ['127.0.0.1:" + std::to_string(metrics_port_) +
                                          "']}]\n"
                                      "  - job_name: namm-worker\n"
                                      "    static_configs: [{targets: ['127.0.0.1:" + std::to_string(metrics_port_ + 1) +
                                          "']}]\n");
  Child prometheus = Spawn({"/usr/bin/prometheus", "--config.file=" + dir_ + "/prometheus.yml",
                            "--storage.tsdb.path=" + dir_ + "/tsdb", "--web.listen-address=127.0.0.1:" +
                            std::to_string(port)},
                           dir_ + "/prometheus.log");
  // The value of an instant query's first series, once Prometheus has one.
  const auto query = [&](const std::string& promql) -> std::optional<double> {
    const std::string body = HttpGet(port, "/api/v1/query?query=" + promql);
    if (body.empty()) return std::nullopt;
    const auto j = nlohmann::json::parse(body, nullptr, false);
    if (j.is_discarded() || j["status"] != "success" || j["data"]["result"].empty()) return std::nullopt;
    return std::stod(j["data"]["result"][0]["value"][1].get<std::string>());
  };
  std::optional<double> generation, worker_up;
  EXPECT_TRUE(WaitUntil([&] { return (generation = query("namm_run_generation")).has_value(); },
                        std::chrono::seconds(60)))
      << ReadText(dir_ + "/prometheus.log");
  EXPECT_GE(generation.value_or(-1), 1.0);
  EXPECT_TRUE(WaitUntil([&] { return (worker_up = query("up%7Bjob%3D%22namm-worker%22%7D")).has_value(); },
                        std::chrono::seconds(30)));
  EXPECT_EQ(worker_up, 1.0);
  ::kill(prometheus.pid, SIGTERM);
  EXPECT_EQ(namm::testing::Wait(prometheus), 0) << ReadText(dir_ + "/prometheus.log");
}

// Every `namm_*` name in a PromQL expression of the dashboard (panel targets, template variables) and of the
// alert rules is a sample the coordinator or the worker exposes.
TEST_F(Observability, EveryMetricTheDashboardAndTheAlertsUseIsExposed) {
  std::set<std::string> exposed = SampleNames(Scrape(metrics_port_));
  for (const std::string& name : SampleNames(Scrape(metrics_port_ + 1))) exposed.insert(name);
  ASSERT_GT(exposed.size(), 40u);

  std::vector<std::pair<std::string, std::string>> expressions;  // (where, PromQL)
  const auto dashboard = nlohmann::json::parse(ReadText(kSource + "/dashboards/namm-training.json"));
  std::function<void(const nlohmann::json&, const std::string&)> walk = [&](const nlohmann::json& j,
                                                                             const std::string& path) {
    if (j.is_object()) {
      for (const auto& [key, value] : j.items()) {
        if ((key == "expr" || key == "query") && value.is_string()) expressions.push_back({path + "." + key, value});
        walk(value, path + "." + key);
      }
    } else if (j.is_array()) {
      for (std::size_t i = 0; i < j.size(); ++i) walk(j[i], path + "[" + std::to_string(i) + "]");
    }
  };
  walk(dashboard, "namm-training.json");
  const YAML::Node alerts = YAML::LoadFile(kSource + "/deploy/prometheus/alerts.yml");
  for (const YAML::Node& group : alerts["groups"]) {
    for (const YAML::Node& rule : group["rules"]) {
      expressions.push_back({"alerts.yml " + rule["alert"].as<std::string>(), rule["expr"].as<std::string>()});
    }
  }
  ASSERT_GT(expressions.size(), 10u);

  const std::regex metric("namm_[a-zA-Z0-9_]+");
  int checked = 0;
  for (const auto& [where, expr] : expressions) {
    for (auto it = std::sregex_iterator(expr.begin(), expr.end(), metric); it != std::sregex_iterator(); ++it) {
      EXPECT_EQ(exposed.count(it->str()), 1u) << where << " uses " << it->str() << ", which is not exposed: " << expr;
      ++checked;
    }
  }
  EXPECT_GT(checked, 30);
}

}  // namespace
}  // namespace namm::coordinator
