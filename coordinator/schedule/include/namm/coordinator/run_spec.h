// A training run's specification (YAML): the model, the NAMM architecture, the optimizer, the incremental
// stages, and how prompts are sampled and the mean is evaluated. See coordinator/runs/*.yaml for examples and
// docs/coordinator.md for every key.
#pragma once

#include <string>
#include <vector>

#include "namm/coordinator/cma_es.h"
#include "namm/coordinator/stage_schedule.h"
#include "namm/namm_model.h"
#include "namm/status.h"
#include "namm/tasks/normalized_score.h"

namespace namm::coordinator {

struct ModelSpec {
  std::string path;          // Hugging Face directory or llama2.c checkpoint, as workers see it
  std::string tokenizer;     // optional, as namm-worker --tokenizer
  std::string rope_scaling;  // optional override, as namm-worker --rope-scaling
  std::string fingerprint;   // identifies the model for reference scores; required
};

struct StageSpec {
  // The stage's tasks (the incremental recipe adds one per stage), task variants included ("T@budget=16": the
  // candidates scored with that cache budget, namm/tasks/task_variant.h); the spec's budgets: / ratios: expanded.
  std::vector<std::string> tasks;
  // `weights: {TASK: w, ...}`: a task's weight in the stage's fitness and in the evaluation of the mean (both
  // modes of `fitness`); a task not named weighs 1. So a run over variants can lean towards the one its
  // selection would otherwise neglect (docs/results.md). Each in [0.001, 1000]; a weight of 1 is not kept.
  // Empty: the reference's unweighted mean.
  tasks::TaskWeights weights;
  int64_t generations = 0;
};

struct RunSpec {
  std::string name;
  ModelSpec model;
  NammArchitecture architecture;
  // `namm.init: FILE` (a deliberate difference from the reference, which starts every run at zeros): the run's
  // initial mean is that NAMM file's parameters, and its frozen normalization statistics, if they are frozen, are
  // the run's (no generation collects them; a count of 0 stays "unnormalized", as the file scores). The file must be
  // of the spec's architecture, and of the spec's model if it names one (export does). Read once, when the run is
  // created; the run's start is then stored with it, so a resume never reads the file again. Empty: zeros. A file
  // without the budget input starts a spec with `budget_input: true` with that embedding at zeros.
  std::string init;
  CmaesOptions cmaes;
  int64_t prompts_per_task = 64;  // sampled per task per generation, the same for every candidate
  int64_t eval_interval = 10;     // evaluate the mean every this many generations (and at each stage's start)
  int64_t eval_prompts = 0;       // per task: 0 = every prompt (the reference), else a fixed seeded subset
  tasks::ZeroBase zero_base = tasks::ZeroBase::kOnePlusCandidate;
  // How a candidate's tasks combine into its fitness: the mean of their normalized scores (the reference), or,
  // with `fitness: mean_rank`, the mean of its rank among the generation's candidates on each task (0 worst,
  // 1 best): every task (every budget of a run over budgets) then weighs the same in the selection, whatever
  // the spread of its scores. The evaluation of the mean stays the mean of normalized scores. Both weighted by
  // the stage's `weights`.
  bool rank_fitness = false;
  // `cache_weight: w` (a deliberate difference from the reference, whose fitness is the score alone): a
  // candidate's fitness is its (weighted) mean normalized score minus w times its mean relative cache over
  // the same evaluations (each prompt's mean KV-cache size over its queries, divided by the full cache's over
  // them, (n + 1) / 2 for n tokens fed), so that evolution trades score for memory at the NAMM's own
  // threshold. With `fitness: mean` and no budgets or ratios (those fix the cache); 0, the default, is the
  // reference's fitness. The evaluation of the mean is charged the same way, so the stage's best is chosen by
  // the same rule.
  double cache_weight = 0;
  std::vector<StageSpec> stages;
  std::string yaml;               // the text it was parsed from, stored with the run

  int64_t total_generations() const;
  // The stages' generations with the evaluation interval: which generation is in which stage, and evaluated.
  StageSchedule schedule() const;
  // Every task of every stage, sorted, without repeats.
  std::vector<std::string> all_tasks() const;
};

// Parses and validates a spec; errors name the key (and `source`).
Result<RunSpec> parse_run_spec(const std::string& yaml, const std::string& source);
Result<RunSpec> load_run_spec(const std::string& path);

}  // namespace namm::coordinator
