#include "namm/coordinator/trainer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <set>
#include <tuple>
#include <utility>

#include "dense_linalg.h"
#include "namm/blas_threads.h"
#include "namm/coordinator/checkpoint_codec.h"
#include "namm/coordinator/prompt_sampler.h"
#include "namm/namm_file.h"
#include "namm/tasks/task_variant.h"

namespace namm::coordinator {

namespace {

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

// Whether `e` is one of `candidate`'s evaluations on `prompts`.
bool OfCandidateOn(const EvaluationRecord& e, int64_t candidate, const PromptSample& prompts) {
  if (e.candidate != candidate) return false;
  const auto it = prompts.find(e.task);
  return it != prompts.end() && std::binary_search(it->second.begin(), it->second.end(), e.prompt);
}

// Per-task prompt scores of one candidate on `prompts`, from the generation's evaluations.
tasks::PromptScores ScoresOf(const std::vector<EvaluationRecord>& evaluations, int64_t candidate,
                             const PromptSample& prompts) {
  tasks::PromptScores scores;
  for (const EvaluationRecord& e : evaluations) {
    if (OfCandidateOn(e, candidate, prompts)) scores[e.task][e.prompt] = e.score;
  }
  return scores;
}

// cache_weight (run_spec.h): one candidate's normalized score less cache_weight times its mean relative cache on
// `prompts` (tasks::relative_cache); the score itself when the weight is 0 (the reference's fitness).
double Charged(double normalized, double cache_weight, const std::vector<EvaluationRecord>& evaluations,
               int64_t candidate, const PromptSample& prompts) {
  if (cache_weight == 0) return normalized;
  double sum = 0;
  int64_t count = 0;
  for (const EvaluationRecord& e : evaluations) {
    if (!OfCandidateOn(e, candidate, prompts)) continue;
    sum += tasks::relative_cache(e.cache_size_mean, e.prompt_tokens + e.generated_tokens);
    ++count;
  }
  return normalized - cache_weight * (count > 0 ? sum / static_cast<double>(count) : 0);
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

// fitness: mean_rank (run_spec.h): per candidate, the mean over tasks (weighted by the stage's weights) of its rank
// among the candidates by the task's normalized score, scaled to [0, 1] (0 the worst, 1 the best; ties share their
// mean rank).
std::vector<double> MeanRanks(const std::vector<CandidateRecord>& candidates, const tasks::TaskWeights& weights) {
  std::vector<double> mean(candidates.size(), 0.0);
  if (candidates.size() < 2) return mean;
  const auto scale = static_cast<double>(candidates.size() - 1);
  const std::map<std::string, TaskScore>& tasks = candidates.front().tasks;
  double weight_sum = 0;
  for (const auto& [task, unused] : tasks) {
    const double w = tasks::task_weight(weights, task);
    weight_sum += w;
    for (std::size_t k = 0; k < candidates.size(); ++k) {
      const double mine = candidates[k].tasks.at(task).normalized;
      double below = 0, equal = 0;
      for (const CandidateRecord& other : candidates) {
        const double theirs = other.tasks.at(task).normalized;
        below += theirs < mine ? 1 : 0;
        equal += theirs == mine ? 1 : 0;
      }
      mean[k] += w * (below + (equal - 1) / 2) / scale;
    }
  }
  for (double& m : mean) m /= weight_sum;
  return mean;
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

// Runs `work` on a thread of its own, at a lower scheduling priority (nice 10) when `yielding`: a decomposition
// and the covariance updates then leave the cores to the server's thread at a generation's barrier instead of
// sharing them equally. Not for work the barrier may wait for (the next directions) or that holds the database's
// write lock (snapshots, compaction): a starved low-priority holder would delay the barrier instead.
template <typename Work>
auto InBackground(Work work, bool yielding = false) {
  return std::async(std::launch::async, [work = std::move(work), yielding]() mutable {
    if (yielding) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);  // this thread
    return work();
  });
}

// Generations between snapshots when decompositions are not requested (kEveryGeneration): a resume replays at
// most this many tells, each with its decomposition.
constexpr int64_t kEveryGenerationSnapshotInterval = 25;
// A source snapshot still being written in the background (Trainer::FinishSnapshotWrite resolves it).
constexpr int64_t kSnapshotBeingWritten = -2;

bool LazyFull(const CmaesParams& p) {
  return p.options.covariance == Covariance::kFull && p.options.eigen_schedule == EigenSchedule::kLazy;
}

// Whether two states agree on everything a light checkpoint holds.
bool SameLight(const CmaesState& a, const CmaesState& b) {
  return a.generation == b.generation && a.mean == b.mean && a.sigma == b.sigma && a.path_c == b.path_c &&
         a.path_sigma == b.path_sigma && a.eigen.generation == b.eigen.generation &&
         a.pending_generation == b.pending_generation && a.best_member == b.best_member &&
         a.best_fitness == b.best_fitness && a.best_generation == b.best_generation;
}

// Every field of `s` but the covariance and its backlog (the pending decomposition's copy of C is shared).
CmaesState LightCopy(const CmaesState& s) {
  CmaesState light;
  light.generation = s.generation;
  light.mean = s.mean;
  light.sigma = s.sigma;
  light.path_c = s.path_c;
  light.path_sigma = s.path_sigma;
  light.eigen = s.eigen;
  light.pending_generation = s.pending_generation;
  light.pending_covariance = s.pending_covariance;
  light.best_member = s.best_member;
  light.best_fitness = s.best_fitness;
  light.best_generation = s.best_generation;
  return light;
}

}  // namespace

Trainer::~Trainer() {
  // A prepared snapshot is written before going (a rebuild would write it again otherwise); background work is
  // waited for.
  (void)FinishSnapshotWrite(/*wait=*/true);
  (void)FinishCompaction(/*run_pending=*/true);
  if (covariance_work_.valid()) covariance_work_.wait();
}

const CmaesState& Trainer::settled_state() {
  SettleCovariance();
  return state_;
}

void Trainer::StartCovarianceWork() {
  CollectCovarianceWork(/*wait=*/false);
  if (covariance_work_.valid() || state_.covariance_backlog.empty()) return;
  const int64_t copy_after = state_.pending_covariance ? -1 : state_.pending_generation;
  std::vector<CovarianceUpdate> backlog = std::move(state_.covariance_backlog);
  state_.covariance_backlog.clear();
  const auto holds = [&](int64_t generation) {
    return std::any_of(backlog.begin(), backlog.end(), [&](const CovarianceUpdate& u) { return u.generation == generation; });
  };
  std::promise<std::shared_ptr<const std::vector<double>>> copy, best;
  if (holds(copy_after)) pending_copy_ = copy.get_future().share();
  int64_t copy_before = -1;  // the stage's best start state: C before the update of the tell that followed it
  if (stage_best_copy_ && stage_best_copy_->before >= 0 && holds(stage_best_copy_->before)) {
    copy_before = std::exchange(stage_best_copy_->before, -1);
    best = std::move(stage_best_copy_->promise);
  }
  covariance_work_ = InBackground([params = params_, backlog = std::move(backlog),
                                   covariance = std::move(state_.covariance), copy_before, copy_after,
                                   copy = std::move(copy), best = std::move(best)]() mutable {
    CovarianceCopies copies = apply_covariance_backlog(params, backlog, covariance, copy_before, copy_after);
    copy.set_value(std::move(copies.after));
    if (copy_before >= 0) best.set_value(std::move(copies.before));
    return std::move(covariance);
  }, /*yielding=*/true);
  state_.covariance.clear();
}

void Trainer::CollectCovarianceWork(bool wait) {
  if (!covariance_work_.valid() ||
      (!wait && covariance_work_.wait_for(std::chrono::seconds(0)) != std::future_status::ready)) {
    return;
  }
  // The work applied the oldest updates: the backlog left (newer) stays after them.
  state_.covariance = covariance_work_.get();
  // Its copy of C for the pending decomposition, if it made one, was set before it returned.
  if (pending_copy_.valid() && state_.pending_generation >= 0 && !state_.pending_covariance) {
    state_.pending_covariance = pending_copy_.get();
  }
  pending_copy_ = {};
}

void Trainer::SettleCovariance() {
  CollectCovarianceWork(/*wait=*/true);
  const int64_t copy_before = stage_best_copy_ ? stage_best_copy_->before : -1;
  CovarianceCopies copies = apply_covariance_backlog(params_, state_.covariance_backlog, state_.covariance, copy_before,
                                                     state_.pending_covariance ? -1 : state_.pending_generation);
  state_.covariance_backlog.clear();
  if (copies.after) state_.pending_covariance = std::move(copies.after);
  if (copies.before) {
    stage_best_copy_->before = -1;
    stage_best_copy_->promise.set_value(std::move(copies.before));
  }
}

std::optional<Trainer::SharedCovariance> Trainer::PendingCovariance(bool wait) {
  if (!state_.pending_covariance && pending_copy_.valid()) return pending_copy_;
  if (!state_.pending_covariance) {
    if (!wait) return std::nullopt;
    SettleCovariance();
  }
  std::promise<std::shared_ptr<const std::vector<double>>> ready;
  ready.set_value(state_.pending_covariance);
  return ready.get_future().share();
}

bool WorkUnit::operator<(const WorkUnit& o) const {
  return std::tie(candidate, task, prompt) < std::tie(o.candidate, o.task, o.prompt);
}

std::vector<double> GenerationPlan::params_of(int64_t candidate) const {
  if (candidate == kMeanCandidate) return mean;
  return {population.candidate(candidate), population.candidate(candidate) + population.dimension};
}

Trainer::Trainer(TrainingStore& store, RunSpec spec, CmaesParams params, std::map<std::string, int64_t> task_rows)
    : store_(store),
      spec_(std::move(spec)),
      params_(std::move(params)),
      schedule_(spec_.schedule()),
      task_rows_(std::move(task_rows)) {}

Result<std::unique_ptr<Trainer>> Trainer::Create(TrainingStore& store, const RunSpec& spec,
                                                 const std::map<std::string, int64_t>& task_rows) {
  NAMM_RETURN_IF_ERROR(CheckTaskRows(spec, task_rows));
  NAMM_ASSIGN_OR_RETURN(const int64_t run_id, WriteNewRun(store, spec));
  return Resume(store, run_id, task_rows);
}

Result<int64_t> Trainer::WriteNewRun(TrainingStore& store, const RunSpec& spec) {
  NAMM_ASSIGN_OR_RETURN(CmaesParams params, make_cmaes_params(spec.architecture.param_count(), spec.cmaes));
  std::vector<float> initial = initial_params(spec.architecture);
  NewRun run;
  if (!spec.init.empty()) {
    Result<NammModel> start = read_namm_file(spec.init);
    if (!start.ok()) return start.status().WithContext("namm.init");
    // Statistics of another model's attention would be wrong for this one (export writes the fingerprint).
    const auto fingerprint = start->metadata.find("model_fingerprint");
    if (fingerprint != start->metadata.end() && fingerprint->second != spec.model.fingerprint) {
      return Status::InvalidArgument("namm.init: " + spec.init + " was evolved on model " + fingerprint->second +
                                     "; this run's is " + spec.model.fingerprint);
    }
    // A NAMM without the budget input starts one with it: its embedding at zeros, so the start scores as the file.
    const std::string described = start->architecture.ToJson();
    if (spec.architecture.budget_input && !start->architecture.budget_input) {
      start->architecture.budget_input = true;
      start->params.resize(start->params.size() + kFeatureDim, 0.0f);
    }
    // A dynamic selection's initial threshold is only where a run from zeros starts; the file's theta is its own.
    start->architecture.selection.initial_log_threshold = spec.architecture.selection.initial_log_threshold;
    if (start->architecture.ToJson() != spec.architecture.ToJson()) {
      return Status::InvalidArgument("namm.init: " + spec.init + " is a NAMM of " + described + "; the spec's is " +
                                     spec.architecture.ToJson());
    }
    initial = std::move(start->params);
    if (start->norm_state == NormState::kFrozen) run.norm_stats = start->norm_stats;
  }
  NAMM_ASSIGN_OR_RETURN(CmaesState state,
                        initial_cmaes_state(params, std::vector<double>(initial.begin(), initial.end())));
  run.name = spec.name;
  run.spec_yaml = spec.yaml;
  run.model_fingerprint = spec.model.fingerprint;
  run.stages = StageRecords(spec);
  run.initial_state = &state;
  run.optimizer_revision = kOptimizerRevision;
  return store.CreateRun(run);
}

Result<std::unique_ptr<Trainer>> Trainer::Resume(TrainingStore& store, int64_t run_id,
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

Result<std::vector<SpecDifference>> Trainer::ReviseSpec(TrainingStore& store, int64_t run_id, const RunSpec& given) {
  NAMM_ASSIGN_OR_RETURN(RunRecord run, store.GetRun(run_id));
  if (run.spec_yaml == given.yaml) return std::vector<SpecDifference>{};
  NAMM_ASSIGN_OR_RETURN(RunSpec stored, parse_run_spec(run.spec_yaml, "the spec of run " + std::to_string(run_id)));
  NAMM_RETURN_IF_ERROR(check_spec_revision(stored, given, run.status == "finished"));
  std::vector<SpecDifference> accepted = diff_run_specs(stored, given);
  // A finished run accepts only new locations and layout: its stored spec stays what it ran with.
  if (run.status == "running") NAMM_RETURN_IF_ERROR(store.ReviseRunSpec(run_id, given.yaml, StageRecords(given)));
  return accepted;
}

Status Trainer::Load() {
  NAMM_ASSIGN_OR_RETURN(RunRecord run, store_.GetRun(run_id_));
  if (run.optimizer_revision < 1 || run.optimizer_revision > kOptimizerRevision) {
    return Status::FailedPrecondition("run " + std::to_string(run_id_) + " computes its generations with optimizer "
                                      "revision " + std::to_string(run.optimizer_revision) + "; this build knows 1 to " +
                                      std::to_string(kOptimizerRevision) + " (resume it with a newer build)");
  }
  whitening_ = run.optimizer_revision >= 2 ? Whitening::kWithDirections : Whitening::kAtTell;
  set_blas_threads(run.optimizer_revision >= 2 ? 1 : 0);
  NAMM_ASSIGN_OR_RETURN(CheckpointRecord latest, store_.GetCheckpoint(run_id_, "latest", 0, params_));
  if (latest.generation != run.generation) {
    return Status::Corruption("run " + std::to_string(run_id_) + " is at generation " +
                              std::to_string(run.generation) + " but its latest checkpoint starts generation " +
                              std::to_string(latest.generation));
  }
  generation_ = run.generation;
  finished_ = run.status == "finished";
  norm_stats_ = run.norm_stats;
  NAMM_RETURN_IF_ERROR(store_.DropIncompleteSnapshots(run_id_));
  NAMM_ASSIGN_OR_RETURN(snapshots_, store_.ListSnapshots(run_id_));
  stage_best_.reset();
  stage_best_copy_.reset();
  eigen_applied_.reset();
  if (!latest.state.covariance.empty()) {
    // An older build's run: its latest checkpoint is complete. Continue from it with the eigensystem of its own
    // covariance (the stored one came from an earlier covariance that was not kept), as a new snapshot.
    state_ = std::move(latest.state);
    state_.pending_generation = -1;
    state_.pending_covariance.reset();
    NAMM_RETURN_IF_ERROR(refresh_eigensystem(params_, state_));
    NewSnapshot converted;
    converted.stage = run.stage;
    converted.generation = run.generation;
    converted.eigen_from_self = true;
    converted.state = &state_;
    NAMM_ASSIGN_OR_RETURN(const int64_t id, store_.AddSnapshot(run_id_, converted));
    NAMM_ASSIGN_OR_RETURN(snapshots_, store_.ListSnapshots(run_id_));
    eigen_source_ = id;
    pending_source_ = -1;
  } else if (!finished_) {
    NAMM_ASSIGN_OR_RETURN(Rebuilt rebuilt, Rebuild(run.stage, run.generation));
    if (!SameLight(rebuilt.state, latest.state)) {
      return Status::Corruption("run " + std::to_string(run_id_) + ": the optimizer state rebuilt for generation " +
                                std::to_string(run.generation) + " from its snapshot and tell log differs from the "
                                "stored checkpoint (was the run written with another BLAS, or on another CPU?)");
    }
    state_ = std::move(rebuilt.state);
    eigen_source_ = rebuilt.eigen_source;
    pending_source_ = rebuilt.pending_source;
  } else {
    state_ = std::move(latest.state);  // a finished run: the light state is all anyone reads
  }
  NAMM_ASSIGN_OR_RETURN(std::vector<DroppedPrompt> dropped, store_.GetDroppedPrompts(run_id_));
  drops_ = DropCounts{static_cast<int64_t>(dropped.size()), 0};
  const int64_t planned_through = finished_ ? generation_ - 1 : generation_;
  for (int64_t g = 0; g <= planned_through; ++g) drops_.planned += PlannedPrompts(g);
  if (finished_) return Status::Ok();
  NAMM_RETURN_IF_ERROR(MakePlan());
  for (const DroppedPrompt& d : dropped) {
    if (d.generation == generation_) plan_.dropped.emplace(d.task, d.prompt);
  }
  ForgetDroppedReferences();
  return Status::Ok();
}

void Trainer::ForgetDroppedReferences() {
  std::set<std::pair<std::string, int64_t>> dropped;
  for (const auto& [task, prompt] : plan_.dropped) dropped.emplace(tasks::base_task(task), prompt);
  std::vector<std::pair<std::string, int64_t>>& missing = plan_.missing_references;
  missing.erase(std::remove_if(missing.begin(), missing.end(), [&](const auto& r) { return dropped.count(r) > 0; }),
                missing.end());
}

Result<std::vector<Trainer::Segment>> Trainer::PathTo(int64_t stage, int64_t generation) const {
  NAMM_ASSIGN_OR_RETURN(std::vector<StageRecord> stages, store_.GetStages(run_id_));
  std::vector<Segment> path;
  for (int64_t k = stage, r = generation;; --k) {
    path.insert(path.begin(), Segment{k, schedule_.first_generation(k), r});
    if (k == 0) break;
    // Stage k started from stage k - 1's best start state, or from where stage k - 1 ended.
    const StageRecord& previous = stages.at(static_cast<std::size_t>(k - 1));
    r = previous.best_eval_generation ? *previous.best_eval_generation : schedule_.first_generation(k);
  }
  return path;
}

Result<std::size_t> Trainer::BaseOf(const std::vector<Segment>& path) const {
  for (auto seg = path.rbegin(); seg != path.rend(); ++seg) {
    std::optional<std::size_t> best;
    for (std::size_t i = 0; i < snapshots_.size(); ++i) {
      const SnapshotRecord& snap = snapshots_[i];
      if (snap.stage != seg->stage || snap.generation < seg->first || snap.generation > seg->last) continue;
      if (!best || snap.generation >= snapshots_[*best].generation) best = i;
    }
    if (best) return *best;
  }
  return Status::Corruption("run " + std::to_string(run_id_) + " has no snapshot to rebuild its optimizer state from");
}

Result<Trainer::Rebuilt> Trainer::Rebuild(int64_t stage, int64_t generation) const {
  NAMM_ASSIGN_OR_RETURN(std::vector<Segment> path, PathTo(stage, generation));
  NAMM_ASSIGN_OR_RETURN(const std::size_t base_index, BaseOf(path));
  const SnapshotRecord& listed = snapshots_[base_index];
  NAMM_ASSIGN_OR_RETURN(SnapshotRecord base, store_.GetSnapshot(run_id_, listed.id, params_));
  Rebuilt out;
  out.state = std::move(base.state);
  out.pending_source = out.state.pending_generation >= 0 ? base.id : -1;
  // The eigensystem, from the covariance it came from.
  const auto check = [&](const Eigensystem& eigen, const SnapshotRecord& source) -> Status {
    if (source.eigen_checksum && eigensystem_checksum(eigen) != *source.eigen_checksum) {
      return Status::Corruption("the eigensystem recomputed from snapshot " + std::to_string(source.id) + " of run " +
                                std::to_string(run_id_) + " differs from the one the run used (another BLAS or CPU?)");
    }
    return Status::Ok();
  };
  if (base.eigen_source && *base.eigen_source == base.id) {
    NAMM_RETURN_IF_ERROR(refresh_eigensystem(params_, out.state));
    out.eigen_source = base.id;
  } else if (base.eigen_source) {
    NAMM_ASSIGN_OR_RETURN(SnapshotRecord source, store_.GetSnapshot(run_id_, *base.eigen_source, params_));
    NAMM_ASSIGN_OR_RETURN(Eigensystem eigen, decompose(params_, source.state.generation, source.state.covariance));
    NAMM_RETURN_IF_ERROR(check(eigen, source));
    out.state.eigen = std::move(eigen);
    out.eigen_source = source.id;
  } else if (LazyFull(params_)) {
    out.state.eigen = identity_eigensystem(params_);  // the initial C = I
  } else {
    NAMM_RETURN_IF_ERROR(refresh_eigensystem(params_, out.state));
  }
  if (out.state.eigen.generation != base.state.eigen.generation) {
    return Status::Corruption("snapshot " + std::to_string(base.id) + " of run " + std::to_string(run_id_) +
                              " names an eigensystem of generation " + std::to_string(base.state.eigen.generation) +
                              " but its source holds generation " + std::to_string(out.state.eigen.generation));
  }

  // Replay the tell log from the base along the path.
  NAMM_ASSIGN_OR_RETURN(std::vector<GenerationRecord> generations, store_.GetGenerations(run_id_));
  const auto listed_snapshot = [&](const std::function<bool(const SnapshotRecord&)>& which,
                                   const std::string& what) -> Result<const SnapshotRecord*> {
    for (const SnapshotRecord& snap : snapshots_) {
      if (which(snap)) return &snap;
    }
    return Status::Corruption("run " + std::to_string(run_id_) + " has no snapshot of " + what);
  };
  std::size_t segment = 0;
  while (path[segment].stage != base.stage || base.generation < path[segment].first ||
         base.generation > path[segment].last) {
    ++segment;
  }
  for (int64_t t = base.generation;;) {
    const Segment& seg = path[segment];
    if (t == seg.last) {
      if (segment + 1 == path.size()) break;
      ++segment;  // a hand-over: the state goes on unchanged
      t = path[segment].first;
      continue;
    }
    if (eigen_due(params_, out.state)) {
      NAMM_ASSIGN_OR_RETURN(const SnapshotRecord* source,
                            listed_snapshot([&](const SnapshotRecord& r) { return r.id == out.pending_source; },
                                            "the covariance of a requested decomposition"));
      NAMM_ASSIGN_OR_RETURN(Eigensystem eigen,
                            decompose(params_, out.state.pending_generation, *out.state.pending_covariance));
      NAMM_RETURN_IF_ERROR(check(eigen, *source));
      NAMM_RETURN_IF_ERROR(apply_eigensystem(out.state, std::move(eigen)));
      out.eigen_source = out.pending_source;
      out.pending_source = -1;
    }
    const auto record = std::find_if(generations.begin(), generations.end(),
                                     [&](const GenerationRecord& g) { return g.generation == t; });
    if (record == generations.end() || record->cmaes_generation != out.state.generation) {
      return Status::Corruption("run " + std::to_string(run_id_) + " has no consistent record of generation " +
                                std::to_string(t) + " to replay");
    }
    NAMM_ASSIGN_OR_RETURN(std::vector<CandidateRecord> candidates, store_.GetCandidates(run_id_, t));
    std::vector<double> fitness;
    for (const CandidateRecord& c : candidates) fitness.push_back(c.fitness);
    const int64_t pending_before = out.state.pending_generation, eigen_before = out.state.eigen.generation;
    const Population population = ask(params_, out.state, record->draw, whitening_);
    NAMM_RETURN_IF_ERROR(tell(params_, out.state, population, fitness).WithContext("replaying generation " +
                                                                                   std::to_string(t)));
    ++t;
    if (LazyFull(params_) && SnapshotDue(pending_before, eigen_before, out.state)) {
      int64_t requested = -1;
      for (const SnapshotRecord& r : snapshots_) {
        if (r.stage == seg.stage && r.generation == t) requested = r.id;
      }
      if (requested < 0) {
        // Written in the background, and the coordinator stopped first: write it now.
        NewSnapshot n;
        n.stage = seg.stage;
        n.generation = t;
        n.eigen_from_self = out.state.pending_generation < 0;
        if (!n.eigen_from_self && out.eigen_source >= 0) n.eigen_source = out.eigen_source;
        n.state = &out.state;
        NAMM_ASSIGN_OR_RETURN(requested, store_.AddSnapshot(run_id_, n));
        SnapshotRecord written;
        written.id = requested;
        written.stage = n.stage;
        written.generation = n.generation;
        written.eigen_source = n.eigen_from_self ? std::optional<int64_t>(requested) : n.eigen_source;
        snapshots_.push_back(std::move(written));
      }
      if (out.state.pending_generation >= 0) {
        out.pending_source = requested;
      } else {
        out.eigen_source = requested;  // eigen_delay 0: applied by tell()
      }
    }
  }
  return out;
}

bool Trainer::SnapshotDue(int64_t pending_before, int64_t eigen_before, const CmaesState& after) const {
  if (params_.options.covariance == Covariance::kDiagonal) return true;  // O(N)
  if (!LazyFull(params_)) return after.generation % kEveryGenerationSnapshotInterval == 0;
  // A decomposition was requested (and, with eigen_delay 0, applied) by this tell().
  return (after.pending_generation >= 0 && after.pending_generation != pending_before) ||
         after.eigen.generation != eigen_before;
}

Result<std::vector<int64_t>> Trainer::SnapshotsNeeded(const std::vector<std::pair<int64_t, int64_t>>& positions) const {
  std::set<int64_t> needed;
  for (const auto& [stage, generation] : positions) {
    NAMM_ASSIGN_OR_RETURN(std::vector<Segment> path, PathTo(stage, generation));
    NAMM_ASSIGN_OR_RETURN(const std::size_t base, BaseOf(path));
    needed.insert(snapshots_[base].id);
    if (snapshots_[base].eigen_source) needed.insert(*snapshots_[base].eigen_source);
  }
  needed.erase(0);  // a snapshot not written yet
  return std::vector<int64_t>(needed.begin(), needed.end());
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
  // A requested decomposition is computed in the background (BeginBackgroundWork) and applied when due: its
  // snapshot must be written by then (its id goes with the applied eigensystem's checksum).
  std::optional<Population> ahead;  // this generation's directions, computed in the background
  if (eigen_due(params_, state_)) {
    StartEigenJob(/*wait=*/true);
    NAMM_RETURN_IF_ERROR(FinishSnapshotWrite(/*wait=*/true));
    Result<EigenJobResult> done = eigen_job_.get();
    eigen_job_generation_ = -1;
    if (!done.ok()) return done.status().WithContext("the decomposition of generation " +
                                                     std::to_string(state_.pending_generation));
    NAMM_RETURN_IF_ERROR(apply_eigensystem(state_, std::move(done->eigen)));
    pending_copy_ = {};
    if (pending_source_ >= 0) eigen_applied_ = std::make_pair(pending_source_, done->checksum);
    eigen_source_ = pending_source_;
    pending_source_ = -1;
    ahead = std::move(done->directions);
    if (next_directions_.valid()) next_directions_.get();  // sampled with the old eigensystem
  }
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
    const auto draw = static_cast<uint64_t>(generation_);
    if (next_directions_.valid()) {
      Population directions = next_directions_.get();
      if (next_directions_basis_ == state_.eigen.basis) ahead = std::move(directions);
    }
    // A hand-over (or a resume) may sample another generation or draw than the one computed ahead.
    if (ahead && (ahead->generation != state_.generation || ahead->draw != draw)) ahead.reset();
    if (ahead) {
      place_candidates(state_, &*ahead);
      p.population = std::move(*ahead);
    } else {
      p.population = ask(params_, state_, draw, whitening_);
    }
    // The next generation's directions, while this one runs: they need only the eigensystem, which stays unless
    // a decomposition is applied or a hand-over restores another state (then they are computed again).
    if (LazyFull(params_)) next_directions_request_ = DirectionsRequest{state_.eigen, state_.generation + 1, draw + 1};
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
    if (!reference.Get(u.task, u.prompt)) missing.emplace(tasks::base_task(u.task), u.prompt);  // one per variant
  }
  p.missing_references.assign(missing.begin(), missing.end());
  plan_ = std::move(p);
  return Status::Ok();
}

Result<int64_t> Trainer::Record(const std::vector<EvaluationRecord>& results, Durability durability) {
  NAMM_RETURN_IF_ERROR(broken_);
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
  return store_.RecordEvaluations(run_id_, kept, durability);
}

Result<DropCounts> Trainer::Drop(const std::string& task, int64_t prompt, const std::string& error) {
  NAMM_RETURN_IF_ERROR(broken_);
  if (finished_) return Status::FailedPrecondition("run " + std::to_string(run_id_) + " is finished");
  // Every planned task that reads the prompt: the base task's variants share its prompts and its reference score
  // (a failed reference unit is named by the base task alone), and they pair on the same prompts.
  const std::string base = tasks::base_task(task);
  std::set<std::string> planned;
  for (const WorkUnit& u : plan_.units) {
    if (u.prompt == prompt && tasks::base_task(u.task) == base) planned.insert(u.task);
  }
  if (planned.empty()) {
    return Status::InvalidArgument(task + " prompt " + std::to_string(prompt) + " is not part of generation " +
                                   std::to_string(generation_));
  }
  for (const std::string& t : planned) {
    if (plan_.dropped.count({t, prompt}) > 0) continue;
    NAMM_RETURN_IF_ERROR(store_.RecordDroppedPrompt(run_id_, DroppedPrompt{generation_, t, prompt, error, ""}));
    plan_.dropped.emplace(t, prompt);
    ++drops_.dropped;
  }
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
  NAMM_RETURN_IF_ERROR(broken_);
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
  // The spec gathers them with the full cache (§7.6), which the zero mean keeps under its own selection: a task
  // planned at its own selection ("own" among budgets) is collected from alone, not from its variants whose
  // budgets evict (a task planned at budgets only has nothing else: docs/coordinator.md).
  const auto own_selection = [](const std::string& task) {
    const Result<tasks::TaskVariant> variant = tasks::parse_task_variant(task);
    return variant.ok() && !variant->budget;
  };
  std::set<std::string> own_bases;  // base tasks planned at their own selection
  for (const WorkUnit& u : plan_.units) {
    if (own_selection(u.task)) own_bases.insert(tasks::base_task(u.task));
  }
  NormStats merged;
  for (const EvaluationRecord& e : done) {
    if (e.candidate == kMeanCandidate && e.norm_stats && !plan_.dropped.count({e.task, e.prompt}) &&
        (own_selection(e.task) || own_bases.count(tasks::base_task(e.task)) == 0)) {
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
  ForgetDroppedReferences();
  AdvanceSummary s;
  s.generation = generation_;
  s.stage = plan_.schedule.stage;
  s.froze_norm_stats = true;
  return s;
}

void Trainer::StartDirections() {
  if (!next_directions_request_ || next_directions_.valid()) return;
  next_directions_basis_ = next_directions_request_->eigen.basis;
  next_directions_ = InBackground([params = params_, request = std::move(*next_directions_request_),
                                   whitening = whitening_] {
    return sample_directions(params, request.eigen, request.generation, request.draw, whitening);
  });
  next_directions_request_.reset();
}

void Trainer::StartCompaction() {
  if (!compaction_due_ || compaction_.valid()) return;
  compaction_ = InBackground([store = &store_, run = run_id_, ids = std::move(unneeded_snapshots_)] {
    return store->DropSnapshotsConcurrently(run, ids);
  });
  unneeded_snapshots_.clear();
  compaction_due_ = false;
}

Status Trainer::FinishCompaction(bool run_pending) {
  if (compaction_.valid()) NAMM_RETURN_IF_ERROR(compaction_.get().WithContext("compacting the database"));
  if (!run_pending || !compaction_due_) return Status::Ok();
  StartCompaction();
  return compaction_.get().WithContext("compacting the database");
}

std::optional<int64_t> Trainer::BeginBackgroundWork() {
  const int64_t running = eigen_job_generation_;
  StartDirections();
  StartCompaction();
  StartCovarianceWork();
  StartEigenJob(/*wait=*/false);
  StartSnapshotWrite(/*wait=*/false);
  if (eigen_job_generation_ < 0 || eigen_job_generation_ == running) return std::nullopt;
  return eigen_job_generation_;
}

void Trainer::StartEigenJob(bool wait) {
  if (state_.pending_generation < 0 || eigen_job_generation_ == state_.pending_generation) return;
  const std::optional<SharedCovariance> covariance = PendingCovariance(wait);
  if (!covariance) return;
  eigen_job_generation_ = state_.pending_generation;
  // The generation that applies it, and its draw (the run generation then), barring a hand-over meanwhile.
  const int64_t due = state_.pending_generation + params_.options.eigen_delay;
  const auto due_draw = static_cast<uint64_t>(generation_ + (due - state_.generation));
  eigen_job_ = InBackground([params = params_, generation = state_.pending_generation, covariance = *covariance, due,
                             due_draw, whitening = whitening_]() -> Result<EigenJobResult> {
    EigenJobResult r;
    NAMM_ASSIGN_OR_RETURN(r.eigen, decompose(params, generation, *covariance.get()));
    r.checksum = eigensystem_checksum(r.eigen);
    r.directions = sample_directions(params, r.eigen, due, due_draw, whitening);
    return r;
  }, /*yielding=*/true);
}

void Trainer::StartSnapshotWrite(bool wait) {
  if (!snapshot_write_ || snapshot_write_->id.valid()) return;
  // The request's copy of C is the state's unless a later hand-over replaced the state (then it was kept).
  SharedCovariance covariance;
  if (!snapshot_write_->state.pending_covariance) {
    const std::optional<SharedCovariance> pending = PendingCovariance(wait);
    if (!pending) return;
    covariance = *pending;
  }
  snapshot_write_->id = InBackground([store = &store_, run = run_id_, listed = snapshot_write_->listed,
                                      state = std::move(snapshot_write_->state),
                                      covariance]() mutable -> Result<int64_t> {
    if (!state.pending_covariance) state.pending_covariance = covariance.get();
    state.covariance = *state.pending_covariance;
    NewSnapshot n;
    n.stage = listed.stage;
    n.generation = listed.generation;
    n.eigen_source = listed.eigen_source;
    n.state = &state;
    return store->AddSnapshotConcurrently(run, n);
  });
}

Status Trainer::FinishSnapshotWrite(bool wait) {
  if (!snapshot_write_) return Status::Ok();
  if (!wait && (!snapshot_write_->id.valid() ||
                snapshot_write_->id.wait_for(std::chrono::seconds(0)) != std::future_status::ready)) {
    return Status::Ok();  // not yet: retention keeps the older snapshots meanwhile
  }
  StartSnapshotWrite(/*wait=*/true);
  Result<int64_t> id = snapshot_write_->id.get();
  SnapshotRecord listed = std::move(snapshot_write_->listed);
  snapshot_write_.reset();
  NAMM_RETURN_IF_ERROR(id.status().WithContext("writing the snapshot of generation " +
                                               std::to_string(listed.generation)));
  listed.id = *id;
  snapshots_.push_back(std::move(listed));
  for (int64_t* source : {&pending_source_, &eigen_source_}) {
    if (*source == kSnapshotBeingWritten) *source = *id;
  }
  if (stage_best_) {
    for (int64_t* source : {&stage_best_->pending_source, &stage_best_->eigen_source}) {
      if (*source == kSnapshotBeingWritten) *source = *id;
    }
  }
  return Status::Ok();
}

Result<AdvanceSummary> Trainer::TellAndCommit(const std::vector<EvaluationRecord>& done) {
  NAMM_RETURN_IF_ERROR(CollectBackgroundWork());
  NAMM_ASSIGN_OR_RETURN(Scored scored, Score(done));
  if (scored.commit.new_stage_best) KeepStageBest();
  // tell() in place (a copy of C costs ~50 ms at N = 4172); a tell() that refuses changes nothing. Its O(N^2)
  // covariance update is left to background work (BeginBackgroundWork, or the next tell).
  const int64_t pending_before = state_.pending_generation, eigen_before = state_.eigen.generation;
  const auto start = std::chrono::steady_clock::now();
  NAMM_RETURN_IF_ERROR(tell(params_, state_, plan_.population, scored.fitness, CovarianceTiming::kDeferred));
  scored.commit.generation.tell_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The state has moved on: whatever fails from here leaves the trainer refusing to advance, and a new one
  // resumes from the store, which still holds the generation before.
  Result<AdvanceSummary> summary = CommitTold(scored, done, pending_before, eigen_before);
  if (!summary.ok()) broken_ = summary.status().WithContext("the trainer must be resumed from the store");
  return summary.ok() ? summary : Result<AdvanceSummary>(broken_);
}

Status Trainer::CollectBackgroundWork() {
  // A snapshot written meanwhile joins the list (retention then counts on it).
  NAMM_RETURN_IF_ERROR(FinishSnapshotWrite(/*wait=*/false));
  // The previous tells' covariance updates, if their background work is done (else they go on meanwhile); an
  // update no background work took yet (no server calls BeginBackgroundWork, or the work was busy) starts now.
  StartCovarianceWork();
  // The last compaction's outcome once it is done: a checkpoint under a loaded disk may outlast a generation, and
  // the barrier does not wait for it. Without a server's BeginBackgroundWork, the compaction itself.
  if (!compaction_.valid() || compaction_.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    NAMM_RETURN_IF_ERROR(FinishCompaction(/*run_pending=*/!compaction_.valid()));
  }
  return Status::Ok();
}

Result<Trainer::Scored> Trainer::Score(const std::vector<EvaluationRecord>& done) {
  const GenerationPlan& p = plan_;
  NAMM_ASSIGN_OR_RETURN(tasks::ReferenceScores reference, store_.GetReferenceScores(spec_.model.fingerprint));

  Scored scored;
  GenerationCommit& c = scored.commit;
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

  const tasks::TaskWeights& weights = spec_.stages[static_cast<std::size_t>(g.stage)].weights;
  std::vector<double>& fitness = scored.fitness;
  for (int64_t k = 0; k < p.population.size; ++k) {
    auto f = tasks::normalized_fitness(ScoresOf(done, k, g.samples), reference, spec_.zero_base, weights);
    if (!f.ok()) return f.status().WithContext("fitness of candidate " + std::to_string(k));
    fitness.push_back(Charged(f->value, spec_.cache_weight, done, k, g.samples));
    c.candidates.push_back(CandidateRecord{k, fitness.back(), TaskScores(*f)});
  }
  if (spec_.rank_fitness) {
    fitness = MeanRanks(c.candidates, weights);
    for (std::size_t k = 0; k < fitness.size(); ++k) c.candidates[k].fitness = fitness[k];
  }
  // The mean's evaluation over `prompts`, from `records` (this generation's, or an earlier one's).
  const auto mean_fitness = [&](const std::vector<EvaluationRecord>& records,
                                const PromptSample& prompts) -> Result<std::pair<double, tasks::Fitness>> {
    auto f = tasks::normalized_fitness(ScoresOf(records, kMeanCandidate, prompts), reference, spec_.zero_base, weights);
    if (!f.ok()) return f.status().WithContext("evaluation of the mean");
    const double charged = Charged(f->value, spec_.cache_weight, records, kMeanCandidate, prompts);
    return std::make_pair(charged, std::move(*f));
  };
  if (p.schedule.evaluate_mean && !eval_prompts.empty()) {
    NAMM_ASSIGN_OR_RETURN(auto f, mean_fitness(done, eval_prompts));
    g.eval_fitness = f.first;
    g.eval_tasks = TaskScores(f.second);
  }

  NAMM_ASSIGN_OR_RETURN(scored.stages, store_.GetStages(run_id_));
  const StageRecord& stage = scored.stages[static_cast<std::size_t>(g.stage)];
  const bool eligible = p.schedule.eval_eligible && g.eval_fitness.has_value();
  c.new_stage_best = eligible && (!stage.best_eval_fitness || *g.eval_fitness > *stage.best_eval_fitness);
  if (eligible && stage.best_eval_generation && drops_.dropped > 0) {
    // Evaluations that lost prompts (dropped: they failed on every worker) are compared over the prompts both kept
    // (a stage's evaluations share their prompts, spec §7.5): a mean that keeps more cache fails more on long
    // prompts, and would otherwise win by losing its hardest ones. A run that never dropped a prompt reads nothing.
    const int64_t best = *stage.best_eval_generation;
    NAMM_ASSIGN_OR_RETURN(const std::vector<DroppedPrompt> stored, store_.GetDroppedPrompts(run_id_));
    std::set<std::pair<std::string, int64_t>> lost = p.dropped;
    bool best_lost = false;
    for (const DroppedPrompt& d : stored) {
      if (d.generation == best) best_lost = lost.emplace(d.task, d.prompt).second || best_lost;
    }
    if (eval_prompts != p.eval_prompts || best_lost) {
      const PromptSample common = Without(p.eval_prompts, lost);
      c.new_stage_best = false;
      if (!common.empty()) {
        NAMM_ASSIGN_OR_RETURN(const std::vector<EvaluationRecord> best_records, store_.GetEvaluations(run_id_, best));
        NAMM_ASSIGN_OR_RETURN(const auto now, mean_fitness(done, common));
        NAMM_ASSIGN_OR_RETURN(const auto then, mean_fitness(best_records, common));
        c.new_stage_best = now.first > then.first;
      }
    }
  }
  return scored;
}

void Trainer::KeepStageBest() {
  // This generation's start state is the stage's best: keep it (its covariance copied; the rest is shared).
  // Its covariance is copied by the covariance work, before it applies this generation's update (a copy here
  // would cost ~50 ms at N = 4172).
  const bool defers = defers_covariance_update(params_);  // else tell() updates C at once: copy it here
  const bool earlier_copy_due = stage_best_copy_ && stage_best_copy_->before >= 0;
  if (!defers || earlier_copy_due || (state_.pending_generation >= 0 && !state_.pending_covariance)) {
    SettleCovariance();
  }
  stage_best_copy_.reset();
  if (defers) {
    stage_best_ = Rebuilt{LightCopy(state_), eigen_source_, pending_source_};
    stage_best_copy_.emplace(state_.generation + 1);
  } else {
    stage_best_ = Rebuilt{state_, eigen_source_, pending_source_};
  }
}

Result<AdvanceSummary> Trainer::CommitTold(Scored& scored, const std::vector<EvaluationRecord>& done,
                                          int64_t pending_before, int64_t eigen_before) {
  GenerationCommit& c = scored.commit;
  GenerationRecord& g = c.generation;
  const GenerationPlan& p = plan_;
  const std::vector<double>& fitness = scored.fitness;
  const StageRecord& stage = scored.stages[static_cast<std::size_t>(g.stage)];
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
  const auto [dmin, dmax] = std::minmax_element(state_.eigen.scales.begin(), state_.eigen.scales.end());
  g.eigen_min = *dmin * *dmin;
  g.eigen_max = *dmax * *dmax;

  c.stage_ends = p.schedule.stage_end;
  const bool has_next_stage = g.stage + 1 < schedule_.stages();
  c.finished = c.stage_ends && !has_next_stage;
  c.next_stage = c.stage_ends && has_next_stage ? g.stage + 1 : g.stage;

  // A snapshot of the state after tell(), when a decomposition was requested (see SnapshotDue). A delayed
  // request keeps C aside (pending_covariance): that snapshot is written in the background while the next
  // generation runs, and a rebuild that misses it (a crash meanwhile) writes it again. Others go with the commit.
  // The last generation's always does, with what rebuilding it needs: a finished run keeps its final complete
  // state (`export --latest --format reference` needs its C), nothing else.
  if (c.finished) SettleCovariance();  // C back from the covariance work, every deferred update applied
  const bool snapshot_due = c.finished || SnapshotDue(pending_before, eigen_before, state_);
  const bool background =
      !c.finished && snapshot_due && LazyFull(params_) && state_.pending_generation == state_.generation;
  const bool snapshot = snapshot_due && !background;
  if (snapshot) {
    NewSnapshot n;
    n.stage = g.stage;
    n.generation = generation_ + 1;
    n.state = &state_;
    n.eigen_from_self = !LazyFull(params_) || state_.pending_generation < 0;  // eigen_delay 0: applied
    if (!n.eigen_from_self && eigen_source_ >= 0) n.eigen_source = eigen_source_;
    c.snapshot = n;
    SnapshotRecord listed;  // id 0 until the commit writes it
    listed.stage = n.stage;
    listed.generation = n.generation;
    listed.eigen_source = n.eigen_from_self ? std::optional<int64_t>(0) : n.eigen_source;
    snapshots_.push_back(std::move(listed));
  }
  // The hand-over (spec §7.3): the next stage continues from this stage's best start state, or from where the
  // stage ended if no evaluation was eligible.
  const bool hand_over = c.stage_ends && has_next_stage && (stage.best_eval_fitness || c.new_stage_best);
  // The state is replaced below: what it requested takes its covariance now (a stage end, rare).
  if (hand_over) SettleCovariance();
  if (hand_over && !stage_best_) {  // a resumed run: rebuild it
    NAMM_ASSIGN_OR_RETURN(stage_best_, Rebuild(g.stage, c.new_stage_best ? generation_ : *stage.best_eval_generation));
    stage_best_copy_.reset();
  }
  c.next_state = hand_over ? &stage_best_->state : &state_;
  c.eigen_applied = eigen_applied_;
  c.metrics = {{"fitness_best", g.fitness_best},   {"fitness_mean", g.fitness_mean},
               {"fitness_std", g.fitness_std},     {"fitness_worst", g.fitness_worst},
               {"sigma", g.sigma},                 {"eigen_min", g.eigen_min},
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
  // Snapshots no rebuild will need any more: what the next generation starts from, and the hand-over to come.
  // (Positions in this stage: PathTo() reads the stored stage bests, final for earlier stages only.)
  {
    std::vector<std::pair<int64_t, int64_t>> positions;
    const bool has_best = stage.best_eval_fitness || c.new_stage_best;
    const int64_t best_generation = c.new_stage_best ? generation_ : stage.best_eval_generation.value_or(-1);
    if (!hand_over) positions.emplace_back(g.stage, generation_ + 1);
    if (has_best && !c.finished && (hand_over || !c.stage_ends)) positions.emplace_back(g.stage, best_generation);
    NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> keep, SnapshotsNeeded(positions));
    c.keep_snapshots = std::move(keep);
    // A background snapshot not joined yet (FinishSnapshotWrite above found it running) may complete before
    // this commit deletes: it is named so that it survives (it is the pending decomposition's source).
    if (snapshot_write_) {
      c.snapshot_in_flight = std::make_pair(snapshot_write_->listed.stage, snapshot_write_->listed.generation);
    }
  }

  const auto commit_start = std::chrono::steady_clock::now();
  NAMM_ASSIGN_OR_RETURN(const CommitOutcome outcome, store_.CommitGeneration(c));
  eigen_applied_.reset();
  // The store kept the new snapshot (its id now known) and those asked for.
  for (SnapshotRecord& r : snapshots_) {
    if (r.id == 0) {
      r.id = outcome.snapshot_id;
      if (r.eigen_source && *r.eigen_source == 0) r.eigen_source = r.id;
    }
  }
  const std::vector<int64_t>& kept = *c.keep_snapshots;
  snapshots_.erase(std::remove_if(snapshots_.begin(), snapshots_.end(),
                                  [&](const SnapshotRecord& r) {
                                    return r.id != outcome.snapshot_id &&
                                           std::find(kept.begin(), kept.end(), r.id) == kept.end();
                                  }),
                   snapshots_.end());
  if (snapshot) {
    // The state after tell() refers to the new snapshot for what it requested.
    if (c.snapshot->eigen_from_self) {
      eigen_source_ = outcome.snapshot_id;
    } else {
      pending_source_ = outcome.snapshot_id;
    }
  }

  if (background) {
    SnapshotRecord listed;
    listed.stage = g.stage;
    listed.generation = generation_ + 1;
    if (eigen_source_ >= 0) listed.eigen_source = eigen_source_;
    CmaesState light = LightCopy(state_);  // the covariance is the pending one, copied on the writing thread
    light.eigen = Eigensystem{state_.eigen.generation, nullptr, {}};
    pending_source_ = kSnapshotBeingWritten;
    snapshot_write_.emplace();
    snapshot_write_->listed = listed;
    snapshot_write_->state = std::move(light);  // BeginBackgroundWork() writes it
  }

  // Deleting unneeded snapshots and copying the WAL into the database take tens of ms: BeginBackgroundWork. After
  // every commit, so that the WAL stays small while the trainer's connection never checkpoints itself.
  unneeded_snapshots_.insert(unneeded_snapshots_.end(), outcome.unneeded_snapshots.begin(),
                             outcome.unneeded_snapshots.end());
  compaction_due_ = true;
  if (c.finished) NAMM_RETURN_IF_ERROR(FinishCompaction(/*run_pending=*/true));

  AdvanceSummary summary;
  summary.generation = generation_;
  summary.stage = g.stage;
  summary.record = g;
  summary.metrics = c.metrics;
  summary.stage_ended = c.stage_ends;
  ++generation_;
  if (hand_over) {
    state_ = std::move(stage_best_->state);
    // SettleCovariance() above took the copy of its covariance, if the covariance work had not.
    if (stage_best_copy_) state_.covariance = *stage_best_copy_->covariance.get();
    eigen_source_ = stage_best_->eigen_source;
    pending_source_ = stage_best_->pending_source;
  }
  if (c.stage_ends) {
    stage_best_.reset();
    stage_best_copy_.reset();
  }
  finished_ = c.finished;
  if (!finished_) {
    NAMM_RETURN_IF_ERROR(MakePlan());
    drops_.planned += PlannedPrompts(generation_);
  }
  summary.commit_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - commit_start).count();
  summary.finished = finished_;
  return summary;
}

}  // namespace namm::coordinator
