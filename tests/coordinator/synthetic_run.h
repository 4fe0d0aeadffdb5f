// A deterministic stand-in for workers in coordinator tests: every unit's score is a fixed function of the
// candidate's parameters and the prompt, so a run's trajectory depends only on the spec, and two runs (one of
// them interrupted) can be compared bit for bit.
#pragma once

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "namm/coordinator/run_spec.h"
#include "namm/coordinator/store.h"
#include "namm/coordinator/trainer.h"

namespace namm::coordinator::testing {

// Two stages on two made-up tasks with an MLP NAMM (676 parameters), small enough for unit tests. At N = 676 the
// lazy schedule decomposes every ~110 generations; kFrequentDecompositions makes it every ~4, delayed by 2.
constexpr const char* kFrequentDecompositions = ", eigen_gap_factor: 0.02, eigen_delay: 2";
inline std::string SyntheticSpecYaml(const std::string& name = "synthetic", int stage0 = 3, int stage1 = 2,
                                     const std::string& cmaes_extra = "") {
  return "name: " + name +
         "\n"
         "model: {path: /nowhere/model.bin, fingerprint: synthetic-model}\n"
         "namm: {scorer: mlp, selection: binary}\n"
         "cmaes: {population: 8, sigma0: 0.065, seed: 7" + cmaes_extra + "}\n"
         "prompts_per_task: 4\n"
         "eval_interval: 2\n"
         "eval_prompts: 6\n"
         "stages:\n"
         "  - {tasks: [t/a], generations: " + std::to_string(stage0) + "}\n"
         "  - {tasks: [t/a, t/b], generations: " + std::to_string(stage1) + "}\n";
}

inline std::map<std::string, int64_t> SyntheticTaskRows() { return {{"t/a", 20}, {"t/b", 10}}; }

// Reference (base-model) score of every prompt: the all-zero NAMM's score.
inline double SyntheticScore(const std::vector<double>& x, const std::string& task, int64_t prompt) {
  double d2 = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double target = 0.01 * (static_cast<double>((i + (task == "t/b" ? 3 : 0)) % 7) - 3.0);
    d2 += (x[i] - target) * (x[i] - target);
  }
  return (0.5 + 0.1 * static_cast<double>(prompt % 5)) / (1.0 + 4.0 * d2);
}

inline tasks::ReferenceScores SyntheticReference(int64_t dimension) {
  tasks::ReferenceScores r;
  const std::vector<double> zero(static_cast<std::size_t>(dimension), 0.0);
  for (const auto& [task, rows] : SyntheticTaskRows()) {
    for (int64_t p = 0; p < rows; ++p) (void)r.Set(task, p, SyntheticScore(zero, task, p));
  }
  return r;
}

inline NormStats SyntheticNormStats(const std::string& task, int64_t prompt) {
  NormStats s;
  s.count = 10 + prompt;
  for (std::size_t i = 0; i < s.mean.size(); ++i) {
    s.mean[i] = 0.1 * static_cast<double>(prompt) + static_cast<double>(i) + (task == "t/b" ? 1 : 0);
    s.var[i] = 1.0 + 0.01 * static_cast<double>(prompt * static_cast<int64_t>(i));
  }
  return s;
}

// The results of `units` of the trainer's current plan.
inline std::vector<EvaluationRecord> EvaluateUnits(const Trainer& t, const std::vector<WorkUnit>& units) {
  std::vector<EvaluationRecord> out;
  const GenerationPlan& p = t.plan();
  for (const WorkUnit& u : units) {
    EvaluationRecord e;
    e.generation = p.generation;
    e.candidate = u.candidate;
    e.task = u.task;
    e.prompt = u.prompt;
    e.score = SyntheticScore(p.params_of(u.candidate), u.task, u.prompt);
    e.cache_size_mean = 100.0 + static_cast<double>(u.prompt);
    e.cache_size_final = 90 + u.prompt;
    e.prompt_tokens = 1000 + u.prompt;
    e.generated_tokens = 0;
    e.worker = "test";
    e.duration_seconds = 0.01;
    if (p.collect_norm_stats) e.norm_stats = SyntheticNormStats(u.task, u.prompt);
    out.push_back(std::move(e));
  }
  return out;
}

// Computes the results of units of the trainer's current plan.
using Evaluator = std::function<std::vector<EvaluationRecord>(const Trainer&, const std::vector<WorkUnit>&)>;

// Evaluates (with `evaluate`) and advances until the run is finished or `max_advances` phases were completed.
// `before_phase` (optional) runs at the start of every phase, e.g. to drop prompts.
inline Status DriveRun(Trainer& t, int max_advances = 1 << 30, const Evaluator& evaluate = EvaluateUnits,
                       const std::function<Status(Trainer&)>& before_phase = nullptr) {
  for (int k = 0; k < max_advances && !t.finished(); ++k) {
    if (before_phase) NAMM_RETURN_IF_ERROR(before_phase(t));
    NAMM_ASSIGN_OR_RETURN(std::vector<WorkUnit> missing, t.Missing());
    NAMM_RETURN_IF_ERROR(t.Record(evaluate(t, missing)).status());
    NAMM_RETURN_IF_ERROR(t.Advance().status());
  }
  return Status::Ok();
}

// A `before_phase` for DriveRun that drops `prompt` of `task` from every phase that plans it, as a coordinator
// does with a prompt that fails on every worker.
inline std::function<Status(Trainer&)> DropEverywhere(const std::string& task, int64_t prompt) {
  return [=](Trainer& t) -> Status {
    for (const WorkUnit& u : t.plan().units) {
      if (u.task == task && u.prompt == prompt) return t.Drop(task, prompt, "fails everywhere").status();
    }
    return Status::Ok();
  };
}

}  // namespace namm::coordinator::testing
