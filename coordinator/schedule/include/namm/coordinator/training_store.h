// What the trainer needs from storage, in its own terms: the records of a run and the calls that read and write
// them. The trainer depends on this interface only; the SQLite store (store.h) implements it, and is the only
// code that knows how the records are kept. The store stores what it is given; what to store (which state comes
// next, when a stage hands over, which snapshots to keep) is the trainer's decision.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "namm/coordinator/cma_es.h"
#include "namm/norm_stats.h"
#include "namm/status.h"
#include "namm/tasks/normalized_score.h"

namespace namm::coordinator {

// A prompt of a task, as rows of the task's data file.
using PromptSample = std::map<std::string, std::vector<int64_t>>;  // task -> row indices

struct RunRecord {
  int64_t id = 0;
  std::string name;
  std::string created_at;  // ISO 8601, UTC
  std::string spec_yaml;   // the run spec as given
  int64_t dimension = 0;
  std::string model_fingerprint;
  std::string status;      // "running" | "finished"
  int64_t stage = 0;       // the stage the next generation belongs to (the last one when finished)
  int64_t generation = 0;  // the next generation to run (run-global, never rewinds)
  std::optional<NormStats> norm_stats;  // frozen normalization statistics, once collected
  int64_t optimizer_revision = 1;       // how its generations are computed (trainer.h, kOptimizerRevision)
};

struct StageRecord {
  int64_t stage = 0;
  std::vector<std::string> tasks;
  int64_t generations = 0;                     // planned
  std::optional<int64_t> start_generation;     // run generation of its first generation, once started
  std::optional<int64_t> end_generation;       // one past its last, once finished
  std::optional<double> best_eval_fitness;     // best evaluation of the mean eligible for hand-over
  std::optional<int64_t> best_eval_generation;
};

struct EvaluationRecord {
  int64_t generation = 0;
  int64_t candidate = 0;  // 0..lambda-1, or kMeanCandidate for an evaluation of the mean
  std::string task;
  int64_t prompt = 0;     // row index
  double score = 0;       // in [0, 1]
  double cache_size_mean = 0;   // mean KV-cache size over the run (tokens per layer)
  int64_t cache_size_final = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  std::string worker;
  double duration_seconds = 0;
  std::optional<NormStats> norm_stats;  // features seen, when the evaluation collected statistics
};
constexpr int64_t kMeanCandidate = -1;

struct TaskScore {
  double raw = 0;         // mean score over the prompts, in [0, 1]
  double normalized = 0;  // divided by the base model's mean on the same prompts
};

struct CandidateRecord {
  int64_t candidate = 0;
  double fitness = 0;
  std::map<std::string, TaskScore> tasks;
};

struct GenerationRecord {
  int64_t generation = 0;        // run-global
  int64_t stage = 0;
  int64_t cmaes_generation = 0;  // the optimizer's g when sampled
  uint64_t draw = 0;             // the noise block the population came from
  double sigma = 0;              // the step size the population was sampled with
  double fitness_best = 0, fitness_mean = 0, fitness_std = 0, fitness_worst = 0;
  int64_t best_candidate = 0;
  PromptSample samples;          // the prompts every candidate was scored on
  std::optional<double> eval_fitness;               // evaluation of the mean, if this generation had one
  std::map<std::string, TaskScore> eval_tasks;
  double eigen_min = 0, eigen_max = 0;              // of C (D^2), after tell()
  double tell_seconds = 0;
  std::string completed_at;
  // Loaded by GetGeneration() only:
  std::vector<double> mean;         // the mean the population was sampled around
  std::vector<double> best_params;  // the generation's best candidate
};

// A checkpoint: the optimizer state a generation starts from, light (every vector, not the covariance, not the
// eigensystem: see SnapshotRecord), plus the frozen normalization statistics. The latest one, and each stage's
// best, are what status and export read; the trainer rebuilds the complete state from snapshots.
struct CheckpointRecord {
  std::string role;          // "latest" | "stage_best"
  int64_t stage = 0;
  int64_t generation = 0;    // the run generation that starts from this state
  std::optional<double> eval_fitness;
  CmaesState state;          // light: covariance and eigensystem empty (complete in an older build's rows)
  std::optional<NormStats> norm_stats;
  uint32_t checksum = 0;     // the CRC-32 the state record carries (also checked on load)
  std::string created_at;
};

// A snapshot: the complete optimizer state, covariance included, that starts run generation `generation` of stage
// `stage` (a generation that ends a stage is followed by two states: the stage's own, and the next stage's start
// after the hand-over). The eigensystem is not stored (139 MB at N = 4172): it is a function of the covariance of
// snapshot `eigen_source` (none: the initial identity). Written when a decomposition is requested (and at the
// run's start); with the tell log (each generation's draw and fitness) they rebuild any later state.
struct SnapshotRecord {
  int64_t id = 0;
  int64_t stage = 0;
  int64_t generation = 0;
  std::optional<int64_t> eigen_source;
  std::optional<uint32_t> eigen_checksum;  // CRC of the eigensystem of this snapshot's covariance, once computed
  int64_t bytes = 0;                       // of the stored record
  CmaesState state;                        // GetSnapshot() only; eigensystem empty but for its generation
};

struct NewSnapshot {
  int64_t stage = 0;
  int64_t generation = 0;
  std::optional<int64_t> eigen_source;
  bool eigen_from_self = false;       // the state's eigensystem is that of its own covariance (overrides the above)
  const CmaesState* state = nullptr;  // complete, covariance included
};

enum class Durability {
  kSynced,          // on disk when the call returns
  kWithNextCommit,  // on disk when the next generation commit returns
};

struct NewRun {
  std::string name;
  std::string spec_yaml;
  std::string model_fingerprint;
  std::vector<StageRecord> stages;  // stage numbers 0.., tasks and planned generations
  const CmaesState* initial_state = nullptr;  // becomes the first snapshot and the latest checkpoint
  int64_t optimizer_revision = 1;
  // Frozen from the start (a run that begins from a NAMM file's statistics), else collected by generation 0.
  std::optional<NormStats> norm_stats;
};

// Everything one generation's tell() changes. The store writes what it is given: which state comes next (after a
// stage's hand-over too) is the trainer's decision.
struct GenerationCommit {
  int64_t run_id = 0;
  GenerationRecord generation;  // with mean and best_params
  std::vector<CandidateRecord> candidates;
  // The evaluation of the mean (the generation's start state) beat the stage's best: the start state becomes
  // the stage's best checkpoint.
  bool new_stage_best = false;
  bool stage_ends = false;      // the stage's last generation
  // The state the next generation starts from (stored light), in stage next_stage; or the run's final state.
  const CmaesState* next_state = nullptr;
  int64_t next_stage = 0;
  bool finished = false;
  std::optional<NewSnapshot> snapshot;                    // written with the commit
  std::optional<std::pair<int64_t, uint32_t>> eigen_applied;  // (snapshot id, CRC of its covariance's eigensystem)
  // When set, the run's other complete snapshots (but the new one) are unneeded: the commit returns them.
  std::optional<std::vector<int64_t>> keep_snapshots;
  // (stage, generation) of a snapshot another connection is writing (AddSnapshotConcurrently): never unneeded
  // here, not even if it completes between the trainer's last look and this commit.
  std::optional<std::pair<int64_t, int64_t>> snapshot_in_flight;
  std::map<std::string, double> metrics;
};

// A prompt a generation gave up on: it failed on too many workers, so it left the generation for every
// candidate (and the mean), which keeps the ranking fair.
struct CommitOutcome {
  int64_t snapshot_id = 0;                  // the snapshot written with the commit (0: none)
  std::vector<int64_t> unneeded_snapshots;  // with keep_snapshots: for DropSnapshots()
};

struct DroppedPrompt {
  int64_t generation = 0;
  std::string task;
  int64_t prompt = 0;
  std::string error;       // the last worker's error
  std::string dropped_at;  // ISO 8601, UTC (filled by the store)
};

// The trainer's view of the store. Every call that writes is one durable transaction: after a crash, all of it
// or none of it is there. Not thread-safe, except AddSnapshotConcurrently.
class TrainingStore {
 public:
  virtual ~TrainingStore() = default;

  // Writes the run, its stages and the initial state (the first snapshot, and the latest checkpoint).
  virtual Result<int64_t> CreateRun(const NewRun& run) = 0;
  virtual Result<RunRecord> GetRun(int64_t run_id) const = 0;
  virtual Result<std::vector<StageRecord>> GetStages(int64_t run_id) const = 0;
  // Replaces a running run's spec by one that only extends its stages: `stages` repeats the stored ones, the
  // last possibly longer, then possibly more.
  virtual Status ReviseRunSpec(int64_t run_id, const std::string& spec_yaml, const std::vector<StageRecord>& stages) = 0;
  // Freezes the run's normalization statistics (once; a different second value is refused).
  virtual Status FreezeNormStats(int64_t run_id, const NormStats& stats) = 0;

  // Idempotent per (generation, candidate, task, prompt): the first result wins. Returns how many were new.
  // kWithNextCommit: returns without waiting for the disk; the records are durable once the next generation
  // commit returns (a crash of the process loses nothing, a power loss before that commit loses them, as it
  // loses the progress log's). For the last results of a generation, whose commit follows at once.
  virtual Result<int64_t> RecordEvaluations(int64_t run_id, const std::vector<EvaluationRecord>& records,
                                            Durability durability = Durability::kSynced) = 0;
  virtual Result<std::vector<EvaluationRecord>> GetEvaluations(int64_t run_id, int64_t generation) const = 0;
  // Idempotent per (generation, task, prompt); refused for a generation other than the run's current one.
  virtual Status RecordDroppedPrompt(int64_t run_id, const DroppedPrompt& dropped) = 0;
  // In (generation, task, prompt) order.
  virtual Result<std::vector<DroppedPrompt>> GetDroppedPrompts(int64_t run_id) const = 0;

  // Everything one generation's tell() changes, at once.
  virtual Result<CommitOutcome> CommitGeneration(const GenerationCommit& commit) = 0;
  // Summaries, in generation order, without the parameter vectors.
  virtual Result<std::vector<GenerationRecord>> GetGenerations(int64_t run_id) const = 0;
  virtual Result<std::vector<CandidateRecord>> GetCandidates(int64_t run_id, int64_t generation) const = 0;
  // role "latest" ignores `stage`. `params` checks the state's shape.
  virtual Result<CheckpointRecord> GetCheckpoint(int64_t run_id, const std::string& role, int64_t stage,
                                                 const CmaesParams& params) const = 0;

  // The run's snapshots without their states, by (stage, generation); and one of them with its state.
  virtual Result<std::vector<SnapshotRecord>> ListSnapshots(int64_t run_id) const = 0;
  virtual Result<SnapshotRecord> GetSnapshot(int64_t run_id, int64_t id, const CmaesParams& params) const = 0;
  // A snapshot outside a generation's commit, listed only once complete. Returns its id.
  virtual Result<int64_t> AddSnapshot(int64_t run_id, const NewSnapshot& snapshot) = 0;
  // The same, written on a connection of its own: safe to call from another thread while this object goes on
  // committing generations (the trainer writes a decomposition's covariance so, while the next generation runs).
  virtual Result<int64_t> AddSnapshotConcurrently(int64_t run_id, const NewSnapshot& snapshot) const = 0;
  // Removes what an AddSnapshot() cut off by a crash left (call when no snapshot is being written).
  virtual Status DropIncompleteSnapshots(int64_t run_id) = 0;
  // Deletes these (complete) snapshots and copies the write-ahead log into the database, giving its space back:
  // what a written or deleted snapshot leaves behind. Tens of milliseconds at N = 4172 (a 70 MB snapshot), so
  // the trainer calls it off the generation barrier, on a connection of its own (safe from another thread).
  virtual Status DropSnapshotsConcurrently(int64_t run_id, const std::vector<int64_t>& ids) const = 0;

  // Base-model scores per (task, prompt) for the model with this fingerprint.
  virtual Result<tasks::ReferenceScores> GetReferenceScores(const std::string& model_fingerprint) const = 0;
};

}  // namespace namm::coordinator
