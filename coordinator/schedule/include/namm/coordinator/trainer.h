// The training loop of a run (spec §7), independent of how evaluations are computed: it plans each
// generation's work (candidates x sampled prompts, and evaluations of the mean), accepts results, turns them
// into normalized fitness, runs tell(), and commits everything to the store in one transaction. The
// distribution layer hands the planned units to workers; tests hand them to a function.
//
// Life of a run:
//  - generation 0 of stage 0 starts with a phase that only evaluates the zero mean on the evaluation prompts
//    and collects feature-normalization statistics (spec §3.5, §7.6); Advance() merges them in (task, prompt)
//    order and freezes them for the rest of the run;
//  - every generation then evaluates the population on freshly sampled prompts (and the mean when the schedule
//    says so); Advance() tells and commits;
//  - a stage's last generation hands over: the next stage continues from the stage's best checkpoint.
// All of it is a pure function of the spec and the recorded evaluations, so a resumed run plans exactly the work
// an uninterrupted one would have.
//
// Storage is bounded: a generation commits its summary, its candidates' fitness (the tell log: with the draw
// index, enough to replay tell()) and a light checkpoint (every vector, no covariance), about 200 KB at N = 4172.
// The covariance (70 MB there) is stored in a snapshot only when a decomposition is requested (every ~126
// generations) and the eigensystem (139 MB) never: it is recomputed from the covariance it came from. Resuming
// rebuilds the complete state from the latest snapshot on the run's lineage (hand-overs included) by replaying
// the tell log, and checks the result against the stored light checkpoint and eigensystem checksums. A requested
// decomposition (cmaes.eigen_delay > 0) runs on a background thread and is applied eigen_delay generations later.
//
// The generation barrier (last result to the next generation's first lease) holds only O(lambda N) work: with
// eigen_delay > 0, tell()'s covariance update, the next directions, decompositions, snapshots, the deletion of
// unneeded snapshots and the WAL checkpoint run on background threads that BeginBackgroundWork() starts once the
// phase's work is out (docs/coordinator.md, "Off the generation barrier").
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "namm/coordinator/cma_es.h"
#include "namm/coordinator/run_spec.h"
#include "namm/coordinator/spec_revision.h"
#include "namm/coordinator/stage_schedule.h"
#include "namm/coordinator/training_store.h"

namespace namm::coordinator {

// How a run computes its generations, stored with the run so that a newer build resumes it bit for bit:
//  1: BLAS with the library's threads (one per core), and tell() whitens the ranked draws with one N x N
//     product (Whitening::kAtTell);
//  2: BLAS single-threaded (results independent of the host's cores; set_blas_threads (namm/blas_threads.h)), and the whitened
//     directions sampled with the candidates, off the generation barrier (kWithDirections).
// New runs take the latest. The BLAS setting is the process's: a coordinator trains one run.
constexpr int64_t kOptimizerRevision = 2;

struct WorkUnit {
  int64_t candidate = 0;  // or kMeanCandidate
  std::string task;
  int64_t prompt = 0;
  bool operator<(const WorkUnit& o) const;
};

struct GenerationPlan {
  int64_t generation = 0;
  ScheduledGeneration schedule;
  bool collect_norm_stats = false;   // the first phase of the run: the mean only, collecting statistics
  PromptSample samples;              // per task: what every candidate runs
  PromptSample eval_prompts;         // per task: what the mean runs (empty without an evaluation)
  Population population;             // the candidates (x in float64)
  std::vector<double> mean;          // the mean, i.e. the solution evaluated
  std::optional<NormStats> norm_stats;  // frozen statistics every unit runs with (none while collecting)
  std::vector<WorkUnit> units;       // all the phase's units, sorted
  // Prompts with no base-model reference score for the run's model (base tasks: a variant's is its base's):
  // Advance() fails until they are imported.
  std::vector<std::pair<std::string, int64_t>> missing_references;
  // (task, prompt) pairs the generation gave up on (Trainer::Drop): no unit of them is waited for, recorded or
  // scored, for any candidate.
  std::set<std::pair<std::string, int64_t>> dropped;

  // The parameters a unit runs with.
  std::vector<double> params_of(int64_t candidate) const;
};

struct AdvanceSummary {
  int64_t generation = 0;
  int64_t stage = 0;
  bool froze_norm_stats = false;     // this call ended the statistics phase (no tell)
  GenerationRecord record;           // the committed generation (when !froze_norm_stats)
  std::map<std::string, double> metrics;  // what was stored in the metrics table with it
  double commit_seconds = 0;         // the store's transaction for the generation, plus the next plan
  bool stage_ended = false;
  bool finished = false;
};

// Prompts dropped and prompts planned over the run so far (the current generation included); each generation
// counts its distinct (task, prompt) pairs once.
struct DropCounts {
  int64_t dropped = 0;
  int64_t planned = 0;
  double share() const { return planned > 0 ? static_cast<double>(dropped) / static_cast<double>(planned) : 0.0; }
};

class Trainer {
 public:
  ~Trainer();
  // Starts a new run of `spec` in `store`. `task_rows`: the number of prompts (rows) of every task of the spec.
  static Result<std::unique_ptr<Trainer>> Create(TrainingStore& store, const RunSpec& spec,
                                                 const std::map<std::string, int64_t>& task_rows);
  // Only writes a new run of `spec` to `store` (its stages and initial state); Resume() continues it.
  static Result<int64_t> WriteNewRun(TrainingStore& store, const RunSpec& spec);
  // Continues run `run_id` from its latest checkpoint.
  static Result<std::unique_ptr<Trainer>> Resume(TrainingStore& store, int64_t run_id,
                                                 const std::map<std::string, int64_t>& task_rows);
  // Stores `given` as run `run_id`'s spec when it differs from the stored one only in ways that leave the
  // trajectory alone (spec_revision.h); otherwise the error lists what changed. Returns the accepted differences.
  static Result<std::vector<SpecDifference>> ReviseSpec(TrainingStore& store, int64_t run_id, const RunSpec& given);

  int64_t run_id() const { return run_id_; }
  bool finished() const { return finished_; }
  const RunSpec& spec() const { return spec_; }
  const CmaesParams& params() const { return params_; }
  // The optimizer state the current generation starts from (its due decomposition applied). Its covariance may
  // lag: earlier tells' updates are applied in the background (covariance_backlog, or held by that work).
  const CmaesState& state() const { return state_; }
  // The same with the covariance complete: waits for the background update and applies the backlog.
  const CmaesState& settled_state();
  const GenerationPlan& plan() const { return plan_; }

  // Stores results of the current phase (the first one for a unit wins). Refuses units outside the plan,
  // another generation, and statistics-phase results without statistics; skips results of dropped prompts.
  // Returns how many were new. `durability`: see TrainingStore::RecordEvaluations.
  Result<int64_t> Record(const std::vector<EvaluationRecord>& results, Durability durability = Durability::kSynced);
  // Gives up on `prompt` of `task` for the current generation (it failed on too many workers): stored with
  // `error`, then no candidate's unit of it is waited for or scored. The prompt leaves every variant of the
  // task's base task with it (they share its prompts and reference score, and pair on them); `task` may name the
  // base task alone (a reference unit's). Idempotent.
  Result<DropCounts> Drop(const std::string& task, int64_t prompt, const std::string& error);
  const DropCounts& drop_counts() const { return drops_; }
  // The plan's units with no recorded result yet.
  Result<std::vector<WorkUnit>> Missing() const;
  // Ends the current phase once every unit has a result: freezes the statistics, or tells and commits the
  // generation and plans the next one.
  Result<AdvanceSummary> Advance();
  // Starts what can run while the phase's units are computed: the last tell's covariance update, a requested
  // decomposition and its snapshot. A server calls it once the phase's work is handed out; without it they run
  // when needed. Returns the generation whose covariance is being decomposed from now on, if this call started
  // that.
  std::optional<int64_t> BeginBackgroundWork();

 private:
  Trainer(TrainingStore& store, RunSpec spec, CmaesParams params, std::map<std::string, int64_t> task_rows);
  Status Load();      // state, progress and plan from the store
  // Applies a due decomposition (from the background job when it has one), then plans the generation.
  Status MakePlan();
  // Takes the dropped prompts (plan_.dropped, by base task) out of plan_.missing_references: a reference that
  // failed everywhere would only fail again.
  void ForgetDroppedReferences();

  // A complete optimizer state and the snapshots its eigensystem and pending decomposition come from (-1: none).
  struct Rebuilt {
    CmaesState state;
    int64_t eigen_source = -1, pending_source = -1;
  };
  // Tells of run generations [first, last) of `stage`; the state reached continues the next segment.
  struct Segment {
    int64_t stage = 0, first = 0, last = 0;
  };
  // The segments whose tells lead from the run's start to the state that starts run generation `generation` of
  // `stage` (through the hand-overs of earlier stages).
  Result<std::vector<Segment>> PathTo(int64_t stage, int64_t generation) const;
  // The latest snapshot on `path` (an index into snapshots_).
  Result<std::size_t> BaseOf(const std::vector<Segment>& path) const;
  // The complete state that starts run generation `generation` of `stage`, from a snapshot and the tell log.
  Result<Rebuilt> Rebuild(int64_t stage, int64_t generation) const;
  // The snapshots a rebuild of each position needs (the base and its eigensystem's source).
  Result<std::vector<int64_t>> SnapshotsNeeded(const std::vector<std::pair<int64_t, int64_t>>& positions) const;
  // Takes the written snapshot's id into the list and the sources waiting for it; with `wait`, writes or waits
  // for it, else only when it is done.
  Status FinishSnapshotWrite(bool wait);
  // The two start only once the pending covariance can be had (PendingCovariance); with `wait`, at once.
  void StartEigenJob(bool wait);
  void StartSnapshotWrite(bool wait);
  // Hands state_'s covariance and its backlog to a background thread that applies the backlog (unless the
  // previous such work still runs: the backlog then waits for the next call).
  void StartCovarianceWork();
  // Takes the covariance back from background work that is done (with `wait`, waits for it).
  void CollectCovarianceWork(bool wait);
  // Waits for that work and applies what is left of the backlog: state_.covariance is complete.
  void SettleCovariance();
  using SharedCovariance = std::shared_future<std::shared_ptr<const std::vector<double>>>;
  // The pending decomposition's copy of C: at hand, or to come from background work. Otherwise, with `wait`,
  // settles the covariance now; without, none.
  std::optional<SharedCovariance> PendingCovariance(bool wait);
  // Whether a snapshot of the state after this generation's tell() is due (the state before it had these
  // pending and eigensystem generations).
  bool SnapshotDue(int64_t pending_before, int64_t eigen_before, const CmaesState& after) const;
  // The distinct (task, prompt) pairs generation `generation` plans (its samples and evaluation prompts).
  int64_t PlannedPrompts(int64_t generation) const;
  std::vector<WorkUnit> MissingFrom(const std::vector<EvaluationRecord>& done) const;
  // `done`: the generation's recorded evaluations.
  Result<AdvanceSummary> FreezeNormStats(const std::vector<EvaluationRecord>& done);
  // tell() and the commit of the generation; its steps below, each with what it may change.
  Result<AdvanceSummary> TellAndCommit(const std::vector<EvaluationRecord>& done);
  // Joins the background work that is done (a written snapshot, the covariance updates, the compaction), and
  // starts what is due; the barrier waits for none of it.
  Status CollectBackgroundWork();
  // What the generation's results make of it, before tell(): the commit's records (the candidates' fitness, the
  // mean's evaluation) and whether its start state is the stage's best. Changes nothing.
  struct Scored {
    GenerationCommit commit;
    std::vector<double> fitness;
    std::vector<StageRecord> stages;
  };
  Result<Scored> Score(const std::vector<EvaluationRecord>& done);
  // Keeps the generation's start state as the stage's best (before tell() moves it on).
  void KeepStageBest();
  // After tell(): the snapshot and retention decisions, the hand-over, the commit, the next plan. Any error
  // leaves the trainer broken (TellAndCommit).
  Result<AdvanceSummary> CommitTold(Scored& scored, const std::vector<EvaluationRecord>& done, int64_t pending_before,
                                    int64_t eigen_before);

  TrainingStore& store_;
  RunSpec spec_;
  CmaesParams params_;
  Whitening whitening_ = Whitening::kAtTell;  // from the run's optimizer revision
  StageSchedule schedule_;
  std::map<std::string, int64_t> task_rows_;
  int64_t run_id_ = 0;
  int64_t generation_ = 0;
  bool finished_ = false;
  std::optional<NormStats> norm_stats_;
  CmaesState state_;
  int64_t eigen_source_ = -1, pending_source_ = -1;  // snapshots of state_'s eigensystem and pending decomposition
  // The current stage's best start state, for its hand-over (rebuilt when a resumed run reaches the hand-over).
  std::optional<Rebuilt> stage_best_;
  // That state's covariance when stage_best_ was taken light: copied by whoever applies the update of generation
  // `before` (-1 once someone has it to copy), right before applying it.
  struct StageBestCopy {
    // (A constructor rather than default member initializers: clang cannot emplace those into the optional below.)
    explicit StageBestCopy(int64_t copy_before) : before(copy_before), covariance(promise.get_future().share()) {}
    int64_t before;  // -1 once copied
    std::promise<std::shared_ptr<const std::vector<double>>> promise;
    std::shared_future<std::shared_ptr<const std::vector<double>>> covariance;
  };
  std::optional<StageBestCopy> stage_best_copy_;
  // The run's, without states (a rebuild adds one it had to write again, hence mutable).
  mutable std::vector<SnapshotRecord> snapshots_;
  // The snapshot of a delayed decomposition request, written on its own connection while the next generation
  // runs; its id resolves kSnapshotBeingWritten sources (FinishSnapshotWrite).
  struct SnapshotWrite {
    std::future<Result<int64_t>> id;  // once started
    SnapshotRecord listed;
    CmaesState state;                 // light, with the pending covariance shared once at hand
  };
  std::optional<SnapshotWrite> snapshot_write_;
  // state_'s covariance while a background thread applies the backlog it took (tell() defers its update).
  std::future<std::vector<double>> covariance_work_;
  // The pending decomposition's copy of C, from that work (valid while state_.pending_covariance is unset).
  SharedCovariance pending_copy_;
  // The background decomposition of state_'s pending covariance, and the directions of the generation that
  // will apply it (sampled with it, so that that generation does not wait for a lambda x N x N product).
  struct EigenJobResult {
    Eigensystem eigen;
    uint32_t checksum = 0;
    Population directions;
  };
  std::future<Result<EigenJobResult>> eigen_job_;
  int64_t eigen_job_generation_ = -1;
  std::optional<std::pair<int64_t, uint32_t>> eigen_applied_;  // recorded with the next commit
  // The next generation's draws and directions, computed while this one runs (started by BeginBackgroundWork,
  // after the phase's work is out), with the eigensystem they used (taken only if the next generation samples
  // with the same one).
  struct DirectionsRequest {
    Eigensystem eigen;
    int64_t generation = 0;
    uint64_t draw = 0;
  };
  std::optional<DirectionsRequest> next_directions_request_;
  // Snapshots the commits found unneeded, deleted (and the WAL checkpointed) on a connection of its own.
  std::vector<int64_t> unneeded_snapshots_;
  bool compaction_due_ = false;
  std::future<Status> compaction_;
  void StartCompaction();
  // Waits for a running compaction; with `run_pending`, also runs one that is due.
  Status FinishCompaction(bool run_pending);
  std::future<Population> next_directions_;
  std::shared_ptr<const std::vector<double>> next_directions_basis_;
  void StartDirections();
  GenerationPlan plan_;
  DropCounts drops_;
  Status broken_;  // set when a commit failed after tell() changed the state
};

}  // namespace namm::coordinator
