// A simulated worker for load tests and fault-injection tests of the coordinator: it answers every prompt with a
// fixed function of the candidate's parameters (a shifted Rastrigin function, mapped into (0, 1]) after a delay
// proportional to the prompt's length. No model: the coordinator, the protocol and the network are what is
// exercised. Scores are a pure function of (parameters, task, prompt), so two runs of one spec can be compared
// bit for bit whatever the workers did.
#pragma once

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "namm/coordinator/prompt_costs.h"
#include "namm/worker/coordinator_client.h"

namespace namm::sim {

struct SimOptions {
  double seconds_per_cost = 0;  // delay of a prompt = its cost (prompt tokens) x this / speed, +-20% per prompt
  double speed = 1;             // relative speed of this worker
  std::set<std::pair<std::string, int64_t>> fail;  // (task, prompt) pairs this worker fails, for fault tests
  std::set<std::pair<std::string, int64_t>> nan_score;  // (task, prompt) pairs it scores NaN (a broken model)
  // Appends a line per prompt run to this file (tests count what ran twice): "GENERATION CANDIDATE TASK PROMPT
  // KIND", KIND one of candidate, statistics (a lease collecting statistics) and reference.
  std::string record;
};

// The score of `params` on a prompt: the base score of the prompt times 1 / (1 + Rastrigin(x) / N) around a
// fixed optimum. The base model (reference leases) scores the base score.
double sim_reference_score(const std::string& task, int64_t prompt);
double sim_score(const std::vector<float>& params, const std::string& task, int64_t prompt);
// The parameters' factor in sim_score: 1 / (1 + Rastrigin(x) / N).
double sim_params_factor(const std::vector<float>& params);
// Deterministic per-prompt feature statistics for the statistics phase.
NormStats sim_norm_stats(const std::string& task, int64_t prompt);
// The relative jitter (in [-0.2, 0.2]) of a prompt's running time around its cost.
double sim_jitter(const std::string& task, int64_t prompt);

// Time a worker spent between prompts: the coordinator's share of a unit's latency.
struct SimTiming {
  int64_t prompts = 0;
  double busy_seconds = 0;      // sleeping as the simulated computation
  // Per slot, from the end of a lease's last prompt to the start of the next lease of the same generation: the
  // report's round trip and the next lease's arrival.
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point>> gaps;
  // When the first prompt of each generation (of candidates, not collecting statistics) started.
  std::map<int64_t, std::chrono::steady_clock::time_point> first_prompt;
};

class SimExecutor final : public worker::LeaseExecutor {
 public:
  SimExecutor(coordinator::PromptCosts costs, SimOptions options, int slots);

  Status Prepare(const worker::RunInfo& run) override;
  // Each prompt in turn (a simulated worker has no batched engine).
  std::vector<Result<worker::PromptOutcome>> RunPrompts(const std::vector<worker::PromptJob>& jobs, int slot) override;

  SimTiming timing() const;

 private:
  Result<worker::PromptOutcome> RunPrompt(const worker::LeaseWork& lease, int64_t prompt, int slot);
  using Clock = std::chrono::steady_clock;
  const coordinator::PromptCosts costs_;
  const SimOptions options_;
  mutable std::mutex mu_;
  int64_t param_count_ = 0;
  // sim_params_factor of the latest parameter vectors (a lease's prompts share one), so that simulated workers
  // cost little CPU next to the coordinator they load.
  std::map<std::shared_ptr<const std::vector<float>>, double> factors_;
  struct SlotHistory {
    uint64_t lease = 0;
    int64_t generation = -1;
    Clock::time_point end;
  };
  std::vector<SlotHistory> last_;  // per slot
  SimTiming timing_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> record_{nullptr, &std::fclose};
};

}  // namespace namm::sim
