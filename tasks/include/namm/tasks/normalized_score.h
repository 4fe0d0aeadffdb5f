// Fitness normalized by the base model (spec §7.1-7.2).
//
// Per task, the candidate's mean score over the sampled prompts divided by the base model's (full-cache)
// mean over the same prompts — a ratio of means, not a mean of ratios; the fitness is the mean over tasks,
// unweighted as in the reference unless a run spec weighs its tasks (TaskWeights). A candidate as good as the base
// model scores 1 on every task.
//
// When the base model scores 0 on every sampled prompt of a task the ratio is undefined. The reference divides
// by (100 x base mean + 1e-7), so any non-zero candidate score becomes ~10^7 and swamps every other task. By
// default namm scores such a task 1 + candidate mean instead: matching the base model (0) gives 1, as
// everywhere else, and doing better is rewarded in proportion, without the blow-up. The reference's formula
// is available as ZeroBase::kReferenceEpsilon.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "namm/status.h"

namespace namm::tasks {

// task name -> row index -> score in [0, 1].
using PromptScores = std::map<std::string, std::map<int64_t, double>>;

// Per-prompt base-model scores. File format (the reference's per_request files): a JSON object
// {"<task>": {"<row index>": score, ...}, ...}. The reference's aggregate files (a one-element list whose
// object holds "performance_per_request") are read too.
class ReferenceScores {
 public:
  static Result<ReferenceScores> Load(const std::string& path);
  // Writes the per-request format, atomically.
  Status Save(const std::string& path) const;

  // A task variant's ("T@budget=16", task_variant.h) is its base task's.
  std::optional<double> Get(const std::string& task, int64_t row) const;
  // Refuses scores outside [0, 1], non-finite ones and a task variant's.
  Status Set(const std::string& task, int64_t row, double score);
  const PromptScores& scores() const { return scores_; }

 private:
  PromptScores scores_;
};

enum class ZeroBase {
  kOnePlusCandidate,  // namm's default: 1 + candidate mean
  kReferenceEpsilon,  // the reference: (100 x candidate mean) / (100 x base mean + 1e-7)
};

struct TaskFitness {
  std::string task;
  int64_t prompts = 0;
  double candidate_mean = 0;  // in [0, 1]
  double base_mean = 0;
  double normalized = 0;
};

// task name -> its weight in a fitness (> 0); a task not named weighs 1. Empty: the reference's unweighted mean.
using TaskWeights = std::map<std::string, double>;

inline double task_weight(const TaskWeights& weights, const std::string& task) {
  const auto it = weights.find(task);
  return it == weights.end() ? 1.0 : it->second;
}

struct Fitness {
  double value = 0;                 // mean of the tasks' normalized scores, weighted by TaskWeights
  std::vector<TaskFitness> tasks;   // in task-name order
};

// `candidate`: the candidate's per-prompt scores on the sampled prompts of each task. Every prompt needs a
// reference score; a missing one is an error naming the task and row. `weights` (a deliberate difference from the
// reference, for runs whose tasks are one task's variants: budgets, prompt=keep): value = sum(w * normalized) / sum(w).
Result<Fitness> normalized_fitness(const PromptScores& candidate, const ReferenceScores& reference,
                                   ZeroBase zero_base = ZeroBase::kOnePlusCandidate, const TaskWeights& weights = {});

// A cache's size against the full cache's, the memory side of a normalized score: the mean over a sequence's n
// fed tokens of the cached tokens each query attended to, divided by the full cache's mean over them, (n + 1) / 2;
// 0 when nothing was fed. namm-api's cache report and the trainer's cache_weight both count it so.
inline double relative_cache(double mean_kv_tokens, int64_t tokens_fed) {
  return tokens_fed > 0 ? mean_kv_tokens / ((static_cast<double>(tokens_fed) + 1) / 2) : 0;
}

}  // namespace namm::tasks
