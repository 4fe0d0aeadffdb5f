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
//
// Contention: a call that meets a transient error (another connection holds a lock it needs: SQLITE_BUSY,
// SQLITE_LOCKED, or a WAL race, SQLITE_PROTOCOL) rolls its transaction back and tries again, with backoff, for as
// long as it takes; StoreOptions::on_wait hears of each such wait. Errors that can pass (an I/O error, a full disk
// that is freed, a process out of file descriptors: SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN) are retried the
// same way for up to StoreOptions::io_error_patience, then returned. Permanent errors (corruption, a foreign file,
// a constraint) are returned at once, their SQLite error named. The database's write lock is never held while
// waiting for another of this process's connections, and checkpoints never wait for readers (docs/coordinator.md,
// "The store under contention" and "Transient I/O errors").
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "namm/coordinator/cma_es.h"
#include "namm/coordinator/training_store.h"
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
constexpr int kStoreSchemaVersion = 4;

enum class OpenMode {
  kCreate,    // create the file if missing, migrate an older schema
  kExisting,  // the file must exist; migrate an older schema
  kReadOnly,  // the file must exist at the current schema version; nothing is written
};

// A wait for the database: a call that met a transient error and is trying again.
struct StoreWait {
  std::string what;     // the call ("recording evaluations")
  double seconds = 0;   // since its first failed attempt
  int64_t retries = 0;  // failed attempts so far
  std::string error;    // the last transient error, e.g. "database is locked (SQLITE_BUSY)"
  bool ended = false;   // the wait is over; else it is still waiting
  bool succeeded = false;  // (ended) the call went through; else it then failed for good
};

struct StoreOptions {
  // Migrate no further than this version (tests build old databases with it).
  int target_schema_version = kStoreSchemaVersion;
  // Called inside CommitGeneration()'s transaction just before COMMIT. Crash tests kill the process there.
  std::function<void()> before_commit;
  // Hears of waits for the database, on the waiting thread: after each failed attempt while one lasts (at most
  // every backoff_max), and once when it ends. Connections this store opens for background work use it too.
  std::function<void(const StoreWait&)> on_wait;
  // Sleep between attempts after a transient error: doubling from backoff_initial up to backoff_max.
  std::chrono::milliseconds backoff_initial{10}, backoff_max{1000};
  // The trainer's connection leaves checkpoints (copying the WAL into the database) to Checkpoint() on another
  // connection, so that its commits never pay for them (SQLite's automatic checkpoint runs in the committing call).
  bool checkpoint_elsewhere = false;
  // How long a call retries SQLITE_IOERR, SQLITE_FULL and SQLITE_CANTOPEN before returning them (0: at once). Not
  // for Open(), whose first connection fails at once (a missing directory, a file that is not readable), only for
  // the calls after it and the connections the store opens for background work.
  std::chrono::seconds io_error_patience{0};
};

// The work recorded for one generation, from its evaluations.
struct GenerationActivity {
  int64_t generation = 0;
  int64_t evaluations = 0;    // results recorded, one per (candidate or the mean) x task x prompt
  int64_t workers = 0;        // distinct workers that reported them
  double worker_seconds = 0;  // their summed durations
};

struct ReferenceImport {
  int64_t added = 0, unchanged = 0, replaced = 0;
};

// Implements the trainer's TrainingStore, and what status, export, reports and the server read besides.
class Store final : public TrainingStore {
 public:
  static Result<std::unique_ptr<Store>> Open(const std::string& path, OpenMode mode, StoreOptions options = {});
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const std::string& path() const { return path_; }
  int schema_version() const;

  // Takes this process's lock on run `run_id` of the database file: an open-file-description lock on one byte of
  // the file (far past SQLite's lock bytes), so that the file's identity decides, not the path naming it (a
  // symbolic or hard link finds the same lock). Held until the store is destroyed, or the process ends however it
  // ends. FailedPrecondition when another process (or another Store of this one) holds it. Local file systems
  // only, as SQLite's WAL mode is (docs/coordinator.md, "One coordinator per run").
  Status LockRun(int64_t run_id);

  // Runs. CreateRun writes the run, its stages and the initial state as its latest checkpoint.
  Result<int64_t> CreateRun(const NewRun& run) override;
  Result<RunRecord> GetRun(int64_t run_id) const override;
  Result<std::vector<RunRecord>> ListRuns() const;
  Result<std::vector<StageRecord>> GetStages(int64_t run_id) const override;
  // Replaces a running run's spec by one that only extends its stages (spec_revision.h decides which): `stages`
  // must repeat the stored ones, the last possibly longer, then possibly more.
  Status ReviseRunSpec(int64_t run_id, const std::string& spec_yaml, const std::vector<StageRecord>& stages) override;
  // Freezes the run's normalization statistics (once; a different second value is refused).
  Status FreezeNormStats(int64_t run_id, const NormStats& stats) override;

  // Evaluations are idempotent per (generation, candidate, task, prompt): the first result wins. Returns how
  // many of `records` were new.
  Result<int64_t> RecordEvaluations(int64_t run_id, const std::vector<EvaluationRecord>& records,
                                    Durability durability = Durability::kSynced) override;
  Result<std::vector<EvaluationRecord>> GetEvaluations(int64_t run_id, int64_t generation) const override;
  // Per (task, prompt) evaluated so far: the tokens a worker ran through the model (prompt + generated; the
  // largest reported), what leases are balanced by once known.
  Result<std::map<std::pair<std::string, int64_t>, int64_t>> GetPromptTokens(int64_t run_id) const;

  // Idempotent per (generation, task, prompt); refused for a generation other than the run's current one.
  Status RecordDroppedPrompt(int64_t run_id, const DroppedPrompt& dropped) override;
  // In (generation, task, prompt) order.
  Result<std::vector<DroppedPrompt>> GetDroppedPrompts(int64_t run_id) const override;

  // Increments and returns the run's lease epoch: each coordinator start numbers its leases from epoch << 32, so
  // that they never collide with the leases an earlier one handed out.
  Result<int64_t> NextLeaseEpoch(int64_t run_id);

  // Returns the id of the snapshot written with it (0: none).
  Result<CommitOutcome> CommitGeneration(const GenerationCommit& commit) override;
  // Summaries, in generation order, without the parameter vectors.
  Result<std::vector<GenerationRecord>> GetGenerations(int64_t run_id) const override;
  Result<GenerationRecord> GetGeneration(int64_t run_id, int64_t generation) const;
  Result<std::vector<CandidateRecord>> GetCandidates(int64_t run_id, int64_t generation) const override;

  // role "latest" ignores `stage`. `params` checks the state's shape. Light, except an older build's rows.
  Result<CheckpointRecord> GetCheckpoint(int64_t run_id, const std::string& role, int64_t stage,
                                         const CmaesParams& params) const override;
  // (role, stage, generation, eval fitness) of the run's checkpoints, without loading them.
  Result<std::vector<CheckpointRecord>> ListCheckpoints(int64_t run_id) const;
  // The run's snapshots without their states, by (stage, generation); and one of them with its state.
  Result<std::vector<SnapshotRecord>> ListSnapshots(int64_t run_id) const override;
  Result<SnapshotRecord> GetSnapshot(int64_t run_id, int64_t id, const CmaesParams& params) const override;
  // A snapshot outside a generation's commit (written in the background, or converting an older build's run),
  // in several transactions (a part each) so that other connections' commits interleave; listed only once
  // complete. Returns its id.
  Result<int64_t> AddSnapshot(int64_t run_id, const NewSnapshot& snapshot) override;
  // Opens the file again (kExisting) and writes the snapshot there.
  Result<int64_t> AddSnapshotConcurrently(int64_t run_id, const NewSnapshot& snapshot) const override;
  // Removes what an AddSnapshot() cut off by a crash left (call when no snapshot is being written).
  Status DropIncompleteSnapshots(int64_t run_id) override;
  // Deletes the listed complete snapshots, then Checkpoint().
  Status DropSnapshots(int64_t run_id, const std::vector<int64_t>& ids);
  // Opens the file again (kExisting) and drops them there.
  Status DropSnapshotsConcurrently(int64_t run_id, const std::vector<int64_t>& ids) const override;
  // Copies what the WAL holds into the database as far as no reader still needs it (a passive checkpoint: it
  // never takes the write lock and never waits for a reader). The WAL is then reused from its start by the next
  // commit and cut back to 64 MB (journal_size_limit).
  Status Checkpoint();

  Result<std::map<std::string, double>> GetMetrics(int64_t run_id, int64_t generation) const;
  // Per generation with evaluations, in generation order.
  Result<std::vector<GenerationActivity>> GetGenerationActivity(int64_t run_id) const;

  // Base-model reference scores per (model fingerprint, task, prompt). An import that would change a stored
  // score is refused as a whole (naming the first conflict) unless `replace`.
  Result<ReferenceImport> ImportReferenceScores(const std::string& model_fingerprint,
                                                const tasks::ReferenceScores& scores, const std::string& source,
                                                bool replace);
  Result<tasks::ReferenceScores> GetReferenceScores(const std::string& model_fingerprint) const override;

 private:
  Store(std::string path, std::unique_ptr<SQLite::Database> db, StoreOptions options);
  // One run, or every run in id order.
  Result<std::vector<RunRecord>> ReadRuns(std::optional<int64_t> run_id) const;
  // Runs `body` (one transaction, or reads) again after each transient error until it goes through (store.cpp);
  // called inside another call's transaction, once: that call's guard retries the whole transaction.
  template <typename F>
  auto Guard(const std::string& what, F&& body) const -> decltype(body());
  // The rows of `sql` (its parameters: `ids`, in order), each made by `row(statement)` (a T or a Result<T>), read
  // under Guard() (store.cpp).
  template <typename T, typename Row>
  Result<std::vector<T>> Rows(const std::string& what, const std::string& sql, std::initializer_list<int64_t> ids,
                              Row row) const;
  // A connection to the file at `path`, opened (SQLite errors that can pass retried for `patience`) and migrated.
  static Result<std::unique_ptr<Store>> Connect(const std::string& path, OpenMode mode, StoreOptions options,
                                                std::chrono::seconds patience);
  // Another connection to the file, for a background thread.
  Result<std::unique_ptr<Store>> OpenAnother() const;
  std::string path_;
  std::unique_ptr<SQLite::Database> db_;
  StoreOptions options_;
  int run_lock_fd_ = -1;  // LockRun()'s descriptor of the file; closed after db_ (closing it drops SQLite's locks)
};

}  // namespace namm::coordinator
