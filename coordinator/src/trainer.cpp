#include "namm/coordinator/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <tuple>

#include "namm/coordinator/prompt_sampler.h"

namespace namm::coordinator {

namespace {

std::vector<int64_t> StageGenerations(const RunSpec& spec) {
  std::vector<int64_t> g;
  for (const StageSpec& s : spec.stages) g.push_back(s.generations);
  return g;
}

Status CheckTaskRows(const RunSpec& spec, const std::map<std::string, int64_t>& rows) {
  for (const std::string& task : spec.all_tasks()) {
    const auto it = rows.find(task);
    if (it == rows.end() || it->second <= 0) {
      return Status::InvalidArgument("the run needs the number of prompts of task " + task);
    }
  }
  return Status::Ok();
}

std::vector<StageRecord> StageRecords(const RunSpec& spec) {
  std::vector<StageRecord> stages;
  for (std::size_t k = 0; k < spec.stages.size(); ++k) {
    StageRecord r;
    r.stage = static_cast<int64_t>(k);
    r.tasks = spec.stages[k].tasks;
    r.generations = spec.stages[k].generations;
    stages.push_back(std::move(r));
  }
  return stages;
}

// Per-task prompt scores of one candidate on `prompts`, from the generation's evaluations.
tasks::PromptScores ScoresOf(const std::vector<EvaluationRecord>& evaluations, int64_t candidate,
                             const PromptSample& prompts) {
  tasks::PromptScores scores;
  for (const EvaluationRecord& e : evaluations) {
    if (e.candidate != candidate) continue;
    const auto it = prompts.find(e.task);
    if (it == prompts.end() || !std::binary_search(it->second.begin(), it->second.end(), e.prompt)) continue;
    scores[e.task][e.prompt] = e.score;
  }
  return scores;
}

// `prompts` without the dropped pairs (a task left with none disappears).
PromptSample Without(const PromptSample& prompts, const std::set<std::pair<std::string, int64_t>>& dropped) {
  PromptSample out;
  for (const auto& [task, rows] : prompts) {
    for (int64_t row : rows) {
      if (dropped.count({task, row}) == 0) out[task].push_back(row);
    }
  }
  return out;
}

std::map<std::string, TaskScore> TaskScores(const tasks::Fitness& f) {
  std::map<std::string, TaskScore> out;
  for (const tasks::TaskFitness& t : f.tasks) out[t.task] = TaskScore{t.candidate_mean, t.normalized};
  return out;
}

// Mean over the population's (or the mean's) evaluations of the mean cache size, or with `final`, of the final one.
double MeanCacheSize(const std::vector<EvaluationRecord>& evaluations, bool of_mean, bool final = false) {
  double sum = 0;
  int64_t count = 0;
  for (const EvaluationRecord& e : evaluations) {
    if ((e.candidate == kMeanCandidate) != of_mean) continue;
    sum += final ? static_cast<double>(e.cache_size_final) : e.cache_size_mean;
    ++count;
  }
  return count > 0 ? sum / static_cast<double>(count) : std::nan("");
}

}  // namespace

bool WorkUnit::operator<(const WorkUnit& o) const {
  return std::tie(candidate, task, prompt) < std::tie(o.candidate, o.task, o.prompt);
}

std::vector<double> GenerationPlan::params_of(int64_t candidate) const {
  if (candidate == kMeanCandidate) return mean;
  return {population.candidate(candidate), population.candidate(candidate) + population.dimension};
}

Trainer::Trainer(Store& store, RunSpec spec, CmaesParams params, std::map<std::string, int64_t> task_rows)
    : store_(store),
      spec_(std::move(spec)),
      params_(std::move(params)),
      schedule_(StageGenerations(spec_), spec_.eval_interval),
      task_rows_(std::move(task_rows)) {}

Result<std::unique_ptr<Trainer>> Trainer::Create(Store& store, const RunSpec& spec,
                                                 const std::map<std::string, int64_t>& task_rows) {
  NAMM_RETURN_IF_ERROR(CheckTaskRows(spec, task_rows));
  NAMM_ASSIGN_OR_RETURN(CmaesParams params, make_cmaes_params(spec.architecture.param_count(), spec.cmaes));
  const std::vector<float> initial = initial_params(spec.architecture);
  NAMM_ASSIGN_OR_RETURN(CmaesState state,
                        initial_cmaes_state(params, std::vector<double>(initial.begin(), initial.end())));
  NewRun run;
  run.name = spec.name;
  run.spec_yaml = spec.yaml;
  run.model_fingerprint = spec.model.fingerprint;
  run.stages = StageRecords(spec);
  run.initial_state = &state;
  NAMM_ASSIGN_OR_RETURN(int64_t run_id, store.CreateRun(run));
  return Resume(store, run_id, task_rows);
}

Result<std::unique_ptr<Trainer>> Trainer::Resume(Store& store, int64_t run_id,
                                                 const std::map<std::string, int64_t>& task_rows) {
  NAMM_ASSIGN_OR_RETURN(RunRecord run, store.GetRun(run_id));
  NAMM_ASSIGN_OR_RETURN(RunSpec spec, parse_run_spec(run.spec_yaml, "the spec of run " + std::to_string(run_id)));
  NAMM_RETURN_IF_ERROR(CheckTaskRows(spec, task_rows));
  NAMM_ASSIGN_OR_RETURN(CmaesParams params, make_cmaes_params(spec.architecture.param_count(), spec.cmaes));
  std::unique_ptr<Trainer> t(new Trainer(store, std::move(spec), std::move(params), task_rows));
  t->run_id_ = run_id;
  NAMM_RETURN_IF_ERROR(t->Load());
  return t;
}

Status Trainer::Load() {
  NAMM_ASSIGN_OR_RETURN(RunRecord run, store_.GetRun(run_id_));
  NAMM_ASSIGN_OR_RETURN(CheckpointRecord latest, store_.GetCheckpoint(run_id_, "latest", 0, params_));
  if (latest.generation != run.generation) {
    return Status::Corruption("run " + std::to_string(run_id_) + " is at generation " +
                              std::to_string(run.generation) + " but its latest checkpoint starts generation " +
                              std::to_string(latest.generation));
  }
  state_ = std::move(latest.state);
  generation_ = run.generation;
  finished_ = run.status == "finished";
  norm_stats_ = run.norm_stats;
  NAMM_ASSIGN_OR_RETURN(std::vector<DroppedPrompt> dropped, store_.GetDroppedPrompts(run_id_));
  drops_ = DropCounts{static_cast<int64_t>(dropped.size()), 0};
  const int64_t planned_through = finished_ ? generation_ - 1 : generation_;
  for (int64_t g = 0; g <= planned_through; ++g) drops_.planned += PlannedPrompts(g);
  if (finished_) return Status::Ok();
  NAMM_RETURN_IF_ERROR(MakePlan());
  for (const DroppedPrompt& d : dropped) {
    if (d.generation == generation_) plan_.dropped.emplace(d.task, d.prompt);
  }
  return Status::Ok();
}

int64_t Trainer::PlannedPrompts(int64_t generation) const {
  const ScheduledGeneration at = schedule_.At(generation);
  std::set<std::pair<std::string, int64_t>> prompts;
  for (const std::string& task : spec_.stages[static_cast<std::size_t>(at.stage)].tasks) {
    const int64_t rows = task_rows_.at(task);
    for (int64_t row : sample_prompts(spec_.cmaes.seed, static_cast<uint64_t>(generation), task, rows,
                                      spec_.prompts_per_task)) {
      prompts.emplace(task, row);
    }
    if (at.evaluate_mean) {
      for (int64_t row : sample_prompts(spec_.cmaes.seed, kEvalStream, task, rows,
                                        spec_.eval_prompts > 0 ? spec_.eval_prompts : rows)) {
        prompts.emplace(task, row);
      }
    }
  }
  return static_cast<int64_t>(prompts.size());
}

Status Trainer::MakePlan() {
  GenerationPlan p;
  p.generation = generation_;
  p.schedule = schedule_.At(generation_);
  p.collect_norm_stats = !norm_stats_.has_value();
  if (p.collect_norm_stats && generation_ != 0) {
    return Status::Corruption("run " + std::to_string(run_id_) + " reached generation " +
                              std::to_string(generation_) + " without normalization statistics");
  }
  p.norm_stats = norm_stats_;
  const uint64_t seed = spec_.cmaes.seed;
  const std::vector<std::string>& tasks = spec_.stages[static_cast<std::size_t>(p.schedule.stage)].tasks;
  for (const std::string& task : tasks) {
    const int64_t rows = task_rows_.at(task);
    p.samples[task] = sample_prompts(seed, static_cast<uint64_t>(generation_), task, rows, spec_.prompts_per_task);
    if (p.schedule.evaluate_mean) {
      p.eval_prompts[task] = sample_prompts(seed, kEvalStream, task, rows, spec_.eval_prompts > 0 ? spec_.eval_prompts : rows);
    }
  }
  p.mean = state_.mean;
  for (const auto& [task, prompts] : p.eval_prompts) {
    for (int64_t prompt : prompts) p.units.push_back(WorkUnit{kMeanCandidate, task, prompt});
  }
  if (!p.collect_norm_stats) {
    // The draw index is the run-global generation: after a hand-over rewinds the optimizer's g, the noise is
    // still fresh.
    p.population = ask(params_, state_, static_cast<uint64_t>(generation_));
    for (int64_t k = 0; k < p.population.size; ++k) {
      for (const auto& [task, prompts] : p.samples) {
        for (int64_t prompt : prompts) p.units.push_back(WorkUnit{k, task, prompt});
      }
    }
  }
  std::sort(p.units.begin(), p.units.end());
  NAMM_ASSIGN_OR_RETURN(tasks::ReferenceScores reference, store_.GetReferenceScores(spec_.model.fingerprint));
  std::set<std::pair<std::string, int64_t>> missing;
  for (const WorkUnit& u : p.units) {
    if (!reference.Get(u.task, u.prompt)) missing.emplace(u.task, u.prompt);
  }
  p.missing_references.assign(missing.begin(), missing.end());
  plan_ = std::move(p);
  return Status::Ok();
}

Result<int64_t> Trainer::Record(const std::vector<EvaluationRecord>& results) {
  if (finished_) return Status::FailedPrecondition("run " + std::to_string(run_id_) + " is finished");
  std::vector<EvaluationRecord> kept;
  for (const EvaluationRecord& r : results) {
    const std::string what = "result for candidate " + std::to_string(r.candidate) + ", " + r.task + " prompt " +
                             std::to_string(r.prompt) + " of generation " + std::to_string(r.generation);
    if (r.generation != generation_) {
      return Status::FailedPrecondition(what + ": the run is at generation " + std::to_string(generation_));
    }
    if (!std::binary_search(plan_.units.begin(), plan_.units.end(), WorkUnit{r.candidate, r.task, r.prompt})) {
      return Status::InvalidArgument(what + ": not a unit of the current plan");
    }
    if (plan_.collect_norm_stats && !r.norm_stats) {
      return Status::InvalidArgument(what + ": the statistics phase needs the features' normalization statistics");
    }
    if (plan_.dropped.count({r.task, r.prompt}) == 0) kept.push_back(r);
  }
  return store_.RecordEvaluations(run_id_, kept);
}

Result<DropCounts> Trainer::Drop(const std::string& task, int64_t prompt, const std::string& error) {
  if (finished_) return Status::FailedPrecondition("run " + std::to_string(run_id_) + " is finished");
  const bool planned = std::any_of(plan_.units.begin(), plan_.units.end(),
                                   [&](const WorkUnit& u) { return u.task == task && u.prompt == prompt; });
  if (!planned) {
    return Status::InvalidArgument(task + " prompt " + std::to_string(prompt) + " is not part of generation " +
                                   std::to_string(generation_));
  }
  if (plan_.dropped.count({task, prompt}) > 0) return drops_;
  NAMM_RETURN_IF_ERROR(store_.RecordDroppedPrompt(run_id_, DroppedPrompt{generation_, task, prompt, error, ""}));
  plan_.dropped.emplace(task, prompt);
  ++drops_.dropped;
  return drops_;
}

Result<std::vector<WorkUnit>> Trainer::Missing() const {
  NAMM_ASSIGN_OR_RETURN(std::vector<EvaluationRecord> done, store_.GetEvaluations(run_id_, generation_));
  return MissingFrom(done);
}

std::vector<WorkUnit> Trainer::MissingFrom(const std::vector<EvaluationRecord>& done) const {
  std::set<WorkUnit> recorded;
  for (const EvaluationRecord& e : done) recorded.insert(WorkUnit{e.candidate, e.task, e.prompt});
  std::vector<WorkUnit> missing;
  for (const WorkUnit& u : plan_.units) {
    if (!recorded.count(u) && !plan_.dropped.count({u.task, u.prompt})) missing.push_back(u);
  }
  return missing;
}

Result<AdvanceSummary> Trainer::Advance() {
  if (finished_) return Status::FailedPrecondition("run " + std::to_string(run_id_) + " is finished");
  NAMM_ASSIGN_OR_RETURN(std::vector<EvaluationRecord> done, store_.GetEvaluations(run_id_, generation_));
  const std::vector<WorkUnit> missing = MissingFrom(done);
  if (!missing.empty()) {
    const WorkUnit& u = missing.front();
    return Status::FailedPrecondition(std::to_string(missing.size()) + " units of generation " +
                                      std::to_string(generation_) + " have no result yet (first: candidate " +
                                      std::to_string(u.candidate) + ", " + u.task + " prompt " +
                                      std::to_string(u.prompt) + ")");
  }
  return plan_.collect_norm_stats ? FreezeNormStats(done) : TellAndCommit(done);
}

Result<AdvanceSummary> Trainer::FreezeNormStats(const std::vector<EvaluationRecord>& done) {
  // In (task, prompt) order, whichever worker finished first: the merged statistics do not depend on timing.
  NormStats merged;
  for (const EvaluationRecord& e : done) {
    if (e.candidate == kMeanCandidate && e.norm_stats && !plan_.dropped.count({e.task, e.prompt})) {
      merged = merged.Merge(*e.norm_stats);
    }
  }
  if (merged.count == 0) {
    return Status::FailedPrecondition("the statistics phase of run " + std::to_string(run_id_) +
                                      " saw no features (every evaluation reported an empty count)");
  }
  NAMM_RETURN_IF_ERROR(store_.FreezeNormStats(run_id_, merged));
  norm_stats_ = merged;
  std::set<std::pair<std::string, int64_t>> dropped = std::move(plan_.dropped);  // still generation 0's
  NAMM_RETURN_IF_ERROR(MakePlan());
  plan_.dropped = std::move(dropped);
  AdvanceSummary s;
  s.generation = generation_;
  s.stage = plan_.schedule.stage;
  s.froze_norm_stats = true;
  return s;
}

Result<AdvanceSummary> Trainer::TellAndCommit(const std::vector<EvaluationRecord>& done) {
  const GenerationPlan& p = plan_;
  NAMM_ASSIGN_OR_RETURN(tasks::ReferenceScores reference, store_.GetReferenceScores(spec_.model.fingerprint));

  GenerationCommit c;
  c.run_id = run_id_;
  GenerationRecord& g = c.generation;
  g.generation = generation_;
  g.stage = p.schedule.stage;
  g.cmaes_generation = state_.generation;
  g.draw = p.population.draw;
  g.sigma = state_.sigma;
  g.samples = Without(p.samples, p.dropped);  // what every candidate was scored on
  g.mean = state_.mean;
  if (g.samples.empty()) {
    return Status::FailedPrecondition("every prompt of generation " + std::to_string(generation_) + " was dropped");
  }
  const PromptSample eval_prompts = Without(p.eval_prompts, p.dropped);

  std::vector<double> fitness;
  for (int64_t k = 0; k < p.population.size; ++k) {
    auto f = tasks::normalized_fitness(ScoresOf(done, k, g.samples), reference, spec_.zero_base);
    if (!f.ok()) return f.status().WithContext("fitness of candidate " + std::to_string(k));
    fitness.push_back(f->value);
    c.candidates.push_back(CandidateRecord{k, f->value, TaskScores(*f)});
  }
  if (p.schedule.evaluate_mean && !eval_prompts.empty()) {
    auto f = tasks::normalized_fitness(ScoresOf(done, kMeanCandidate, eval_prompts), reference, spec_.zero_base);
    if (!f.ok()) return f.status().WithContext("evaluation of the mean");
    g.eval_fitness = f->value;
    g.eval_tasks = TaskScores(*f);
  }

  CmaesState next = state_;
  const auto start = std::chrono::steady_clock::now();
  NAMM_RETURN_IF_ERROR(tell(params_, next, p.population, fitness));
  g.tell_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const auto best = std::max_element(fitness.begin(), fitness.end()) - fitness.begin();
  const auto worst = std::min_element(fitness.begin(), fitness.end()) - fitness.begin();
  double sum = 0, sum2 = 0;
  for (double f : fitness) sum += f;
  g.fitness_mean = sum / static_cast<double>(fitness.size());
  for (double f : fitness) sum2 += (f - g.fitness_mean) * (f - g.fitness_mean);
  g.fitness_std = std::sqrt(sum2 / static_cast<double>(fitness.size()));
  g.fitness_best = fitness[static_cast<std::size_t>(best)];
  g.fitness_worst = fitness[static_cast<std::size_t>(worst)];
  g.best_candidate = best;
  g.best_params = p.params_of(best);
  const auto [dmin, dmax] = std::minmax_element(next.eigen.scales.begin(), next.eigen.scales.end());
  g.eigen_min = *dmin * *dmin;
  g.eigen_max = *dmax * *dmax;

  NAMM_ASSIGN_OR_RETURN(std::vector<StageRecord> stages, store_.GetStages(run_id_));
  const StageRecord& stage = stages[static_cast<std::size_t>(g.stage)];
  c.new_stage_best = p.schedule.eval_eligible && g.eval_fitness &&
                     (!stage.best_eval_fitness || *g.eval_fitness > *stage.best_eval_fitness);
  c.next_state = &next;
  c.stage_ends = p.schedule.stage_end;
  if (c.stage_ends && g.stage + 1 < schedule_.stages()) c.next_stage = g.stage + 1;

  c.metrics = {{"fitness_best", g.fitness_best},   {"fitness_mean", g.fitness_mean},
               {"fitness_std", g.fitness_std},     {"fitness_worst", g.fitness_worst},
               {"sigma", next.sigma},              {"eigen_min", g.eigen_min},
               {"eigen_max", g.eigen_max},         {"tell_seconds", g.tell_seconds},
               {"cache_size_mean", MeanCacheSize(done, false)},
               {"prompts_dropped", static_cast<double>(p.dropped.size())}};
  if (g.eval_fitness) {
    c.metrics["eval_fitness"] = *g.eval_fitness;
    c.metrics["eval_cache_size_mean"] = MeanCacheSize(done, true);
    c.metrics["eval_cache_size_final"] = MeanCacheSize(done, true, true);
    for (const auto& [task, s] : g.eval_tasks) {
      c.metrics["eval_raw/" + task] = s.raw;
      c.metrics["eval_normalized/" + task] = s.normalized;
    }
  }
  const auto commit_start = std::chrono::steady_clock::now();
  NAMM_RETURN_IF_ERROR(store_.CommitGeneration(c));

  AdvanceSummary summary;
  summary.generation = generation_;
  summary.stage = g.stage;
  summary.record = g;
  summary.metrics = c.metrics;
  summary.stage_ended = c.stage_ends;
  if (c.stage_ends) {
    // The hand-over happened in the store: continue from what it wrote.
    NAMM_RETURN_IF_ERROR(Load());
  } else {
    state_ = std::move(next);
    ++generation_;
    NAMM_RETURN_IF_ERROR(MakePlan());
    drops_.planned += PlannedPrompts(generation_);
  }
  summary.commit_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - commit_start).count();
  summary.finished = finished_;
  return summary;
}

}  // namespace namm::coordinator
