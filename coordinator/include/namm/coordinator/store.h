// The coordinator's SQLite store: the only code that speaks SQL.
//
// One database file holds any number of training runs: their specs, stages, per-generation summaries, every
// evaluation (candidate x task x prompt), base-model reference scores, checkpoints of the optimizer state and
// metric time series. The file is in WAL mode with foreign keys on; its application_id marks it as a namm
// database and its user_version is the schema version, upgraded in place by forward migrations. A database from
// a newer build or from another application is refused before anything is written to it.
//
// Durability: every public call that writes is one transaction, so a crash at any instant leaves either all or
// none of it. In particular CommitGeneration() writes everything a generation's tell() changes (the generation,
// its candidates, the new optimizer state, stage progress, metrics) at once. Every transaction is synced to disk.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "namm/coordinator/cma_es.h"
#include "namm/norm_stats.h"
#include "namm/status.h"
#include "namm/tasks/normalized_score.h"

namespace SQLite {
class Database;
}

namespace namm::coordinator {

// "NAMM" in ASCII, the value of PRAGMA application_id in every namm database.
constexpr int32_t kStoreApplicationId = 0x4E414D4D;
// The schema version this build writes (PRAGMA user_version).
constexpr int kStoreSchemaVersion = 3;

enum class OpenMode {
  kCreate,    // create the file if missing, migrate an older schema
  kExisting,  // the file must exist; migrate an older schema
  kReadOnly,  // the file must exist at the current schema version; nothing is written
};

struct StoreOptions {
  // Migrate no further than this version (tests build old databases with it).
  int target_schema_version = kStoreSchemaVersion;
  // Called inside CommitGeneration()'s transaction just before COMMIT. Crash tests kill the process there.
  std::function<void()> before_commit;

};

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

struct NewRun {
  std::string name;
  std::string spec_yaml;
  std::string model_fingerprint;
  std::vector<StageRecord> stages;  // stage numbers 0.., tasks and planned generations
  const CmaesState* initial_state = nullptr;  // becomes the first snapshot and the latest checkpoint
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
  // When set, the run's snapshots other than these (and the new one) are deleted.
  std::optional<std::vector<int64_t>> keep_snapshots;
  std::map<std::string, double> metrics;
};

// The work recorded for one generation, from its evaluations.
struct GenerationActivity {
  int64_t generation = 0;
  int64_t evaluations = 0;    // results recorded, one per (candidate or the mean) x task x prompt
  int64_t workers = 0;        // distinct workers that reported them
  double worker_seconds = 0;  // their summed durations
};

// A prompt a generation gave up on: it failed on too many workers, so it left the generation for every
// candidate (and the mean), which keeps the ranking fair.
struct DroppedPrompt {
  int64_t generation = 0;
  std::string task;
  int64_t prompt = 0;
  std::string error;       // the last worker's error
  std::string dropped_at;  // ISO 8601, UTC (filled by the store)
};

struct ReferenceImport {
  int64_t added = 0, unchanged = 0, replaced = 0;
};

class Store {
 public:
  static Result<std::unique_ptr<Store>> Open(const std::string& path, OpenMode mode, StoreOptions options = {});
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const std::string& path() const { return path_; }
  int schema_version() const;

  // Runs. CreateRun writes the run, its stages and the initial state as its latest checkpoint.
  Result<int64_t> CreateRun(const NewRun& run);
  Result<RunRecord> GetRun(int64_t run_id) const;
  Result<std::vector<RunRecord>> ListRuns() const;
  Result<std::vector<StageRecord>> GetStages(int64_t run_id) const;
  // Replaces a running run's spec by one that only extends its stages (spec_revision.h decides which): `stages`
  // must repeat the stored ones, the last possibly longer, then possibly more.
  Status ReviseRunSpec(int64_t run_id, const std::string& spec_yaml, const std::vector<StageRecord>& stages);
  // Freezes the run's normalization statistics (once; a different second value is refused).
  Status FreezeNormStats(int64_t run_id, const NormStats& stats);

  // Evaluations are idempotent per (generation, candidate, task, prompt): the first result wins. Returns how
  // many of `records` were new.
  Result<int64_t> RecordEvaluations(int64_t run_id, const std::vector<EvaluationRecord>& records);
  Result<std::vector<EvaluationRecord>> GetEvaluations(int64_t run_id, int64_t generation) const;
  // Per (task, prompt) evaluated so far: the tokens a worker ran through the model (prompt + generated; the
  // largest reported), what leases are balanced by once known.
  Result<std::map<std::pair<std::string, int64_t>, int64_t>> GetPromptTokens(int64_t run_id) const;

  // Idempotent per (generation, task, prompt); refused for a generation other than the run's current one.
  Status RecordDroppedPrompt(int64_t run_id, const DroppedPrompt& dropped);
  // In (generation, task, prompt) order.
  Result<std::vector<DroppedPrompt>> GetDroppedPrompts(int64_t run_id) const;

  // Increments and returns the run's lease epoch: each coordinator start numbers its leases from epoch << 32, so
  // that they never collide with the leases an earlier one handed out.
  Result<int64_t> NextLeaseEpoch(int64_t run_id);

  // Returns the id of the snapshot written with it (0: none).
  Result<int64_t> CommitGeneration(const GenerationCommit& commit);
  // Summaries, in generation order, without the parameter vectors.
  Result<std::vector<GenerationRecord>> GetGenerations(int64_t run_id) const;
  Result<GenerationRecord> GetGeneration(int64_t run_id, int64_t generation) const;
  Result<std::vector<CandidateRecord>> GetCandidates(int64_t run_id, int64_t generation) const;

  // role "latest" ignores `stage`. `params` checks the state's shape. Light, except an older build's rows.
  Result<CheckpointRecord> GetCheckpoint(int64_t run_id, const std::string& role, int64_t stage,
                                         const CmaesParams& params) const;
  // (role, stage, generation, eval fitness) of the run's checkpoints, without loading them.
  Result<std::vector<CheckpointRecord>> ListCheckpoints(int64_t run_id) const;
  // The run's snapshots without their states, by (stage, generation); and one of them with its state.
  Result<std::vector<SnapshotRecord>> ListSnapshots(int64_t run_id) const;
  Result<SnapshotRecord> GetSnapshot(int64_t run_id, int64_t id, const CmaesParams& params) const;
  // A snapshot outside a generation's commit (written in the background, or converting an older build's run),
  // in several transactions (a part each) so that other connections' commits interleave; listed only once
  // complete. Returns its id.
  Result<int64_t> AddSnapshot(int64_t run_id, const NewSnapshot& snapshot);
  // Removes what an AddSnapshot() cut off by a crash left (call when no snapshot is being written).
  Status DropIncompleteSnapshots(int64_t run_id);

  Result<std::map<std::string, double>> GetMetrics(int64_t run_id, int64_t generation) const;
  // Per generation with evaluations, in generation order.
  Result<std::vector<GenerationActivity>> GetGenerationActivity(int64_t run_id) const;

  // Base-model reference scores per (model fingerprint, task, prompt). An import that would change a stored
  // score is refused as a whole (naming the first conflict) unless `replace`.
  Result<ReferenceImport> ImportReferenceScores(const std::string& model_fingerprint,
                                                const tasks::ReferenceScores& scores, const std::string& source,
                                                bool replace);
  Result<tasks::ReferenceScores> GetReferenceScores(const std::string& model_fingerprint) const;

 private:
  Store(std::string path, std::unique_ptr<SQLite::Database> db, StoreOptions options);
  // One run, or every run in id order.
  Result<std::vector<RunRecord>> ReadRuns(std::optional<int64_t> run_id) const;
  std::string path_;
  std::unique_ptr<SQLite::Database> db_;
  StoreOptions options_;
};

}  // namespace namm::coordinator
