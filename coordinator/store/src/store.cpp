#include "namm/coordinator/store.h"

#include <SQLiteCpp/SQLiteCpp.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sqlite3.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "byte_codec.h"
#include "namm/coordinator/checkpoint_codec.h"

namespace namm::coordinator {

namespace {

using nlohmann::json;

// Migration k takes the schema from version k to k + 1. Never edit a shipped migration: add one.
const char* const kMigrations[] = {
    // 0 -> 1: runs, stages, generations, candidates, evaluations, reference scores, checkpoints.
    R"sql(
CREATE TABLE runs(
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  created_at TEXT NOT NULL,
  spec_yaml TEXT NOT NULL,
  dimension INTEGER NOT NULL CHECK(dimension > 0),
  model_fingerprint TEXT NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('running', 'finished')),
  stage INTEGER NOT NULL,
  generation INTEGER NOT NULL CHECK(generation >= 0),
  norm_stats BLOB
);
CREATE TABLE stages(
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  stage INTEGER NOT NULL CHECK(stage >= 0),
  tasks TEXT NOT NULL,
  generations INTEGER NOT NULL CHECK(generations > 0),
  start_generation INTEGER,
  end_generation INTEGER,
  best_eval_fitness REAL,
  best_eval_generation INTEGER,
  PRIMARY KEY(run_id, stage)
);
CREATE TABLE generations(
  run_id INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  stage INTEGER NOT NULL,
  cmaes_generation INTEGER NOT NULL,
  draw INTEGER NOT NULL,
  sigma REAL NOT NULL,
  fitness_best REAL NOT NULL,
  fitness_mean REAL NOT NULL,
  fitness_std REAL NOT NULL,
  fitness_worst REAL NOT NULL,
  best_candidate INTEGER NOT NULL,
  samples TEXT NOT NULL,
  eval_fitness REAL,
  eval_tasks TEXT,
  mean BLOB NOT NULL,
  best_params BLOB NOT NULL,
  eigen_min REAL NOT NULL,
  eigen_max REAL NOT NULL,
  tell_seconds REAL NOT NULL,
  completed_at TEXT NOT NULL,
  PRIMARY KEY(run_id, generation),
  FOREIGN KEY(run_id, stage) REFERENCES stages(run_id, stage) ON DELETE CASCADE
);
CREATE TABLE candidates(
  run_id INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  candidate INTEGER NOT NULL CHECK(candidate >= 0),
  fitness REAL NOT NULL,
  tasks TEXT NOT NULL,
  PRIMARY KEY(run_id, generation, candidate),
  FOREIGN KEY(run_id, generation) REFERENCES generations(run_id, generation) ON DELETE CASCADE
);
CREATE TABLE evaluations(
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  generation INTEGER NOT NULL,
  candidate INTEGER NOT NULL CHECK(candidate >= -1),
  task TEXT NOT NULL,
  prompt INTEGER NOT NULL CHECK(prompt >= 0),
  score REAL NOT NULL CHECK(score >= 0 AND score <= 1),
  cache_size_mean REAL NOT NULL,
  cache_size_final INTEGER NOT NULL,
  prompt_tokens INTEGER NOT NULL,
  generated_tokens INTEGER NOT NULL,
  worker TEXT NOT NULL,
  duration_seconds REAL NOT NULL,
  norm_stats BLOB,
  recorded_at TEXT NOT NULL,
  PRIMARY KEY(run_id, generation, candidate, task, prompt)
);
CREATE TABLE reference_scores(
  model_fingerprint TEXT NOT NULL,
  task TEXT NOT NULL,
  prompt INTEGER NOT NULL CHECK(prompt >= 0),
  score REAL NOT NULL CHECK(score >= 0 AND score <= 1),
  source TEXT NOT NULL,
  recorded_at TEXT NOT NULL,
  PRIMARY KEY(model_fingerprint, task, prompt)
);
CREATE TABLE decompositions(
  id INTEGER PRIMARY KEY,
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  cmaes_generation INTEGER NOT NULL,
  record BLOB NOT NULL
);
CREATE TABLE checkpoints(
  id INTEGER PRIMARY KEY,
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  role TEXT NOT NULL CHECK(role IN ('latest', 'stage_best')),
  stage INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  eval_fitness REAL,
  state BLOB NOT NULL,
  checksum INTEGER NOT NULL,
  decomposition_id INTEGER NOT NULL REFERENCES decompositions(id),
  norm_stats BLOB,
  created_at TEXT NOT NULL
);
CREATE UNIQUE INDEX one_latest_checkpoint ON checkpoints(run_id) WHERE role = 'latest';
CREATE UNIQUE INDEX one_best_checkpoint_per_stage ON checkpoints(run_id, stage) WHERE role = 'stage_best';
)sql",
    // 1 -> 2: metric time series, and evaluations by worker (for per-worker accounting).
    R"sql(
CREATE TABLE metrics(
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  generation INTEGER NOT NULL,
  name TEXT NOT NULL,
  value REAL NOT NULL,
  PRIMARY KEY(run_id, generation, name)
);
CREATE INDEX evaluations_by_worker ON evaluations(run_id, worker);
)sql",
    // 2 -> 3: prompts a generation gave up on (they failed on too many workers), lease numbering, snapshots and
    // light checkpoints.
    R"sql(
CREATE TABLE dropped_prompts(
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  generation INTEGER NOT NULL CHECK(generation >= 0),
  task TEXT NOT NULL,
  prompt INTEGER NOT NULL CHECK(prompt >= 0),
  error TEXT NOT NULL,
  dropped_at TEXT NOT NULL,
  PRIMARY KEY(run_id, generation, task, prompt)
);
-- Each coordinator start numbers its leases from lease_epoch << 32.
ALTER TABLE runs ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0;
-- Snapshots: the complete optimizer state (covariance included, eigensystem not: a function of the covariance of
-- eigen_source) that starts run generation `generation` of stage `stage`. With the generations' tell log they
-- rebuild any later state. The record is stored in parts, so that a snapshot written in the background holds the
-- database's write lock a part at a time; `complete` once every part is there.
CREATE TABLE snapshots(
  id INTEGER PRIMARY KEY,
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  stage INTEGER NOT NULL CHECK(stage >= 0),
  generation INTEGER NOT NULL CHECK(generation >= 0),
  eigen_source INTEGER,
  eigen_checksum INTEGER,
  bytes INTEGER NOT NULL,
  checksum INTEGER NOT NULL,
  complete INTEGER NOT NULL CHECK(complete IN (0, 1)),
  created_at TEXT NOT NULL
);
CREATE TABLE snapshot_parts(
  snapshot_id INTEGER NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
  part INTEGER NOT NULL,
  bytes BLOB NOT NULL,
  PRIMARY KEY(snapshot_id, part)
);
-- Checkpoints become light (every vector, no covariance): decomposition_id is kept for rows of older builds.
CREATE TABLE checkpoints_v3(
  id INTEGER PRIMARY KEY,
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
  role TEXT NOT NULL CHECK(role IN ('latest', 'stage_best')),
  stage INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  eval_fitness REAL,
  state BLOB NOT NULL,
  checksum INTEGER NOT NULL,
  decomposition_id INTEGER REFERENCES decompositions(id),
  norm_stats BLOB,
  created_at TEXT NOT NULL
);
INSERT INTO checkpoints_v3 SELECT id, run_id, role, stage, generation, eval_fitness, state, checksum,
  decomposition_id, norm_stats, created_at FROM checkpoints;
DROP TABLE checkpoints;
ALTER TABLE checkpoints_v3 RENAME TO checkpoints;
CREATE UNIQUE INDEX one_latest_checkpoint ON checkpoints(run_id) WHERE role = 'latest';
CREATE UNIQUE INDEX one_best_checkpoint_per_stage ON checkpoints(run_id, stage) WHERE role = 'stage_best';
)sql",
    // 3 -> 4: the optimizer revision a run computes its generations with (trainer.h); older builds' runs are 1.
    R"sql(
ALTER TABLE runs ADD COLUMN optimizer_revision INTEGER NOT NULL DEFAULT 1;
)sql",
};
static_assert(std::size(kMigrations) == kStoreSchemaVersion);

// While alive (and `active`), this connection's commits append to the WAL without fsync (synchronous = NORMAL);
// the next FULL commit's fsync of the WAL takes them to disk with its own frames. A crash of the process loses
// nothing; a power loss before that commit loses them.
class UnsyncedCommits {
 public:
  UnsyncedCommits(SQLite::Database& db, bool active) : db_(db), active_(active) {
    if (active_) db_.exec("PRAGMA synchronous = NORMAL");
  }
  // Not through SQLiteCpp, which throws: a destructor must not. Outside a transaction (it is destroyed after
  // the caller's) the pragma only sets a flag of the connection and does not fail.
  ~UnsyncedCommits() {
    if (active_) (void)sqlite3_exec(db_.getHandle(), "PRAGMA synchronous = FULL", nullptr, nullptr, nullptr);
  }
  UnsyncedCommits(const UnsyncedCommits&) = delete;
  UnsyncedCommits& operator=(const UnsyncedCommits&) = delete;

 private:
  SQLite::Database& db_;
  bool active_;
};

// SQLite busy handler, for short waits inside one attempt (a snapshot part being written by another connection):
// 1 to retry, 0 to give up (SQLITE_BUSY, which Guard() then retries with backoff). 2,000 retries of 0.5 ms: at
// least 1 s.
int RetryLockedDatabase(int attempts) {
  if (attempts >= 2000) return 0;
  std::this_thread::sleep_for(std::chrono::microseconds(500));
  return 1;
}

// Whether SQLite's error goes away by itself: a lock another connection holds (SQLITE_BUSY, SQLITE_LOCKED) or a
// race on the WAL's index (SQLITE_PROTOCOL). Disk full, I/O errors, corruption, a foreign file, a constraint: not.
bool Transient(const SQLite::Exception& e) {
  const int code = e.getErrorCode() & 0xff;
  return code == SQLITE_BUSY || code == SQLITE_LOCKED || code == SQLITE_PROTOCOL;
}

// Whether SQLite's error may pass if waited for: an I/O error (EIO on one write, a disk that comes back), a full
// disk that is freed, a file that cannot be opened now (a process out of descriptors: EMFILE). SQLite rolls the
// transaction back on each, so that trying it again is safe. Corruption, a foreign file, a constraint: never.
bool CanPass(const SQLite::Exception& e) {
  const int code = e.getErrorCode() & 0xff;
  return code == SQLITE_IOERR || code == SQLITE_FULL || code == SQLITE_CANTOPEN;
}

// SQLite's message with the name of its code, e.g. "database or disk is full (SQLITE_FULL)".
std::string Described(const SQLite::Exception& e) {
  static const std::map<int, const char*> kNames = {
      {SQLITE_ERROR, "SQLITE_ERROR"},       {SQLITE_PERM, "SQLITE_PERM"},       {SQLITE_BUSY, "SQLITE_BUSY"},
      {SQLITE_LOCKED, "SQLITE_LOCKED"},     {SQLITE_NOMEM, "SQLITE_NOMEM"},     {SQLITE_READONLY, "SQLITE_READONLY"},
      {SQLITE_IOERR, "SQLITE_IOERR"},       {SQLITE_CORRUPT, "SQLITE_CORRUPT"}, {SQLITE_FULL, "SQLITE_FULL"},
      {SQLITE_CANTOPEN, "SQLITE_CANTOPEN"}, {SQLITE_PROTOCOL, "SQLITE_PROTOCOL"},
      {SQLITE_CONSTRAINT, "SQLITE_CONSTRAINT"}, {SQLITE_NOTADB, "SQLITE_NOTADB"}};
  const auto name = kNames.find(e.getErrorCode() & 0xff);
  return name == kNames.end() ? std::string(e.what()) : std::string(e.what()) + " (" + name->second + ")";
}

// SQLite opens a file read-only, without an error, when opening it for writing fails for any reason but a
// directory (EMFILE included): the database file (sqlite3_db_readonly() tells) or, at its first read, the
// write-ahead log or its shared memory (only a write tells). Such a connection fails every write and checkpoint
// (SQLITE_READONLY, or EBADF on the file) for as long as it lives, so a connection meant to write is one that
// can: one that cannot is a file that cannot be opened now, waited for as such. (A background connection met
// each under EMFILE: one retried its checkpoint on the read-only descriptor until its patience ran out, the
// other stopped the run at once with SQLITE_READONLY.)
[[noreturn]] void ThrowOpenedReadOnly() {
  throw SQLite::Exception("unable to open the database file, its write-ahead log or shared memory for writing (their "
                          "permissions, or the process out of file descriptors): SQLite opened it read-only",
                          SQLITE_CANTOPEN);
}

// Whether a write transaction can begin (and at once roll back) on `db`; false on SQLITE_READONLY.
bool CanWrite(SQLite::Database& db) {
  try {
    db.exec("BEGIN IMMEDIATE");
  } catch (const SQLite::Exception& e) {
    if ((e.getErrorCode() & 0xff) == SQLITE_READONLY) return false;
    throw;
  }
  db.exec("ROLLBACK");
  return true;
}

// One call's wait for the database: from its first transient error until it goes through. Tells
// StoreOptions::on_wait after each failed attempt and when it ends.
class Wait {
 public:
  // Copies what it needs of `options`: a call may move them (Open() hands them to the new Store).
  Wait(std::string what, const StoreOptions& options)
      : what_(std::move(what)),
        on_wait_(options.on_wait),
        backoff_max_(options.backoff_max),
        backoff_(std::max(options.backoff_initial, std::chrono::milliseconds(1))) {}
  ~Wait() { End(false); }
  Wait(const Wait&) = delete;
  Wait& operator=(const Wait&) = delete;

  // After a transient error: sleeps for the backoff, then the caller tries again.
  void Retry(const std::string& error) {
    if (retries_++ == 0) start_ = std::chrono::steady_clock::now();
    error_ = error;
    Tell(false, false);
    std::this_thread::sleep_for(backoff_);
    backoff_ = std::min(backoff_ * 2, backoff_max_);
  }
  // Seconds since the first failed attempt (0 before one).
  double seconds() const {
    return retries_ == 0 ? 0.0 : std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  // The call went through (else it failed for good, or its body returned an error).
  void End(bool succeeded) {
    if (retries_ > 0 && !ended_) Tell(true, succeeded);
    ended_ = true;
  }

 private:
  // Never throws (the destructor tells too): a failing observer only misses a report.
  void Tell(bool ended, bool succeeded) const noexcept {
    if (!on_wait_) return;
    try {
      StoreWait w;
      w.what = what_;
      w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      w.retries = retries_;
      w.error = error_;
      w.ended = ended;
      w.succeeded = succeeded;
      on_wait_(w);
    } catch (...) {
    }
  }

  const std::string what_;
  const std::function<void(const StoreWait&)> on_wait_;
  const std::chrono::milliseconds backoff_max_;
  std::chrono::milliseconds backoff_;
  std::chrono::steady_clock::time_point start_;
  int64_t retries_ = 0;
  std::string error_;
  bool ended_ = false;
};

std::string NowUtc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

std::string_view BlobOf(const SQLite::Column& c) {
  return {static_cast<const char*>(c.getBlob()), static_cast<std::size_t>(c.getBytes())};
}

void BindBlob(SQLite::Statement& q, int index, const std::string& bytes) {
  q.bindNoCopy(index, static_cast<const void*>(bytes.data()), static_cast<int>(bytes.size()));
}

void BindDoubles(SQLite::Statement& q, int index, const std::vector<double>& values) {
  q.bindNoCopy(index, static_cast<const void*>(values.data()), static_cast<int>(values.size() * sizeof(double)));
}

std::vector<double> DoublesOf(const SQLite::Column& c) {
  std::vector<double> v(static_cast<std::size_t>(c.getBytes()) / sizeof(double));
  if (!v.empty()) std::memcpy(v.data(), c.getBlob(), v.size() * sizeof(double));
  return v;
}

void BindOptional(SQLite::Statement& q, int index, const std::optional<double>& v) {
  if (v) {
    q.bind(index, *v);
  } else {
    q.bind(index);
  }
}

std::optional<double> OptionalDouble(const SQLite::Column& c) {
  if (c.isNull()) return std::nullopt;
  return c.getDouble();
}
std::optional<int64_t> OptionalInt(const SQLite::Column& c) {
  if (c.isNull()) return std::nullopt;
  return c.getInt64();
}

json TaskScoresJson(const std::map<std::string, TaskScore>& tasks) {
  json j = json::object();
  for (const auto& [task, s] : tasks) j[task] = {{"raw", s.raw}, {"normalized", s.normalized}};
  return j;
}
std::map<std::string, TaskScore> TaskScoresOf(const std::string& text) {
  std::map<std::string, TaskScore> tasks;
  if (text.empty()) return tasks;
  const json parsed = json::parse(text);
  for (const auto& [task, s] : parsed.items()) {
    tasks[task] = TaskScore{s.at("raw").get<double>(), s.at("normalized").get<double>()};
  }
  return tasks;
}

Result<std::optional<NormStats>> NormStatsOf(const SQLite::Column& c, const std::string& what) {
  if (c.isNull()) return std::optional<NormStats>();
  NAMM_ASSIGN_OR_RETURN(NormStats stats, decode_norm_stats(BlobOf(c), what));
  return std::optional<NormStats>(stats);
}

// Runs `body`, again after a transient error (its transaction rolled back) for as long as it takes and after an
// error that can pass for up to `patience`, and turns SQLite's other exceptions into a Status naming `what`, the
// file and the error. `body` must be one transaction (or reads): what a failed attempt did is gone when it runs
// again.
template <typename F>
auto GuardCall(const std::string& path, const StoreOptions& options, std::chrono::seconds patience,
               const std::string& what, F&& body) -> decltype(body()) {
  Wait wait(what, options);
  while (true) {
    try {
      auto result = body();
      wait.End(result.ok());
      return result;
    } catch (const SQLite::Exception& e) {
      const bool wait_more = CanPass(e) && wait.seconds() < static_cast<double>(patience.count());
      if (!Transient(e) && !wait_more) {
        const std::string waited = wait.seconds() > 0 ? " (after " + std::to_string(static_cast<int64_t>(
                                                                          wait.seconds())) + " s of retries)"
                                                      : "";
        return Status::IOError(what + " failed on " + path + ": " + Described(e) + waited);
      }
      wait.Retry(Described(e));
    } catch (const json::exception& e) {
      return Status::Corruption(what + ": malformed JSON in " + path + ": " + e.what());
    }
  }
}

// Writes `state` (light: without its covariance) as the run's latest checkpoint.
void WriteLatest(SQLite::Database& db, int64_t run_id, int64_t stage, int64_t generation, const CmaesState& state,
                 const std::optional<NormStats>& norm) {
  const std::string record = encode_cmaes_state(state, /*with_covariance=*/false);
  SQLite::Statement drop(db, "DELETE FROM checkpoints WHERE run_id = ? AND role = 'latest'");
  drop.bind(1, run_id);
  drop.exec();
  SQLite::Statement insert(db,
                           "INSERT INTO checkpoints(run_id, role, stage, generation, eval_fitness, state, checksum, "
                           "decomposition_id, norm_stats, created_at) VALUES(?, 'latest', ?, ?, NULL, ?, ?, NULL, ?, ?)");
  insert.bind(1, run_id);
  insert.bind(2, stage);
  insert.bind(3, generation);
  BindBlob(insert, 4, record);
  insert.bind(5, static_cast<int64_t>(record_checksum(record)));
  const std::string norm_record = norm ? encode_norm_stats(*norm) : std::string();
  if (norm) {
    BindBlob(insert, 6, norm_record);
  } else {
    insert.bind(6);
  }
  insert.bind(7, NowUtc());
  insert.exec();
}

// A snapshot's row as SnapshotOf() reads it.
constexpr const char* kSnapshotColumns = "SELECT id, stage, generation, eigen_source, eigen_checksum, bytes";

SnapshotRecord SnapshotOf(SQLite::Statement& q) {
  SnapshotRecord r;
  r.id = q.getColumn(0).getInt64();
  r.stage = q.getColumn(1).getInt64();
  r.generation = q.getColumn(2).getInt64();
  r.eigen_source = OptionalInt(q.getColumn(3));
  if (!q.getColumn(4).isNull()) r.eigen_checksum = static_cast<uint32_t>(q.getColumn(4).getInt64());
  r.bytes = q.getColumn(5).getInt64();
  return r;
}

// A snapshot record goes in parts of this size (a part is a transaction when written in the background).
constexpr std::size_t kSnapshotPartBytes = 4u << 20;

// The snapshot's row (not yet complete); returns its id.
int64_t InsertSnapshotRow(SQLite::Database& db, int64_t run_id, const NewSnapshot& snapshot, const std::string& record) {
  SQLite::Statement insert(db,
                           "INSERT INTO snapshots(run_id, stage, generation, eigen_source, bytes, checksum, complete, "
                           "created_at) VALUES(?, ?, ?, ?, ?, ?, 0, ?)");
  insert.bind(1, run_id);
  insert.bind(2, snapshot.stage);
  insert.bind(3, snapshot.generation);
  if (snapshot.eigen_source) {
    insert.bind(4, *snapshot.eigen_source);
  } else {
    insert.bind(4);
  }
  insert.bind(5, static_cast<int64_t>(record.size()));
  insert.bind(6, static_cast<int64_t>(record_checksum(record)));
  insert.bind(7, NowUtc());
  insert.exec();
  const int64_t id = db.getLastInsertRowid();
  if (snapshot.eigen_from_self) {
    SQLite::Statement self(db, "UPDATE snapshots SET eigen_source = id WHERE id = ?");
    self.bind(1, id);
    self.exec();
  }
  return id;
}

void InsertSnapshotPart(SQLite::Database& db, int64_t id, const std::string& record, std::size_t part) {
  const std::size_t at = part * kSnapshotPartBytes;
  SQLite::Statement insert(db, "INSERT INTO snapshot_parts(snapshot_id, part, bytes) VALUES(?, ?, ?)");
  insert.bind(1, id);
  insert.bind(2, static_cast<int64_t>(part));
  insert.bindNoCopy(3, static_cast<const void*>(record.data() + at),
                    static_cast<int>(std::min(kSnapshotPartBytes, record.size() - at)));
  insert.exec();
}

void CompleteSnapshot(SQLite::Database& db, int64_t id) {
  SQLite::Statement done(db, "UPDATE snapshots SET complete = 1 WHERE id = ?");
  done.bind(1, id);
  done.exec();
}

std::size_t SnapshotParts(const std::string& record) {
  return (record.size() + kSnapshotPartBytes - 1) / kSnapshotPartBytes;
}

// A whole snapshot inside the caller's transaction.
int64_t WriteSnapshot(SQLite::Database& db, int64_t run_id, const NewSnapshot& snapshot) {
  const std::string record = encode_cmaes_state(*snapshot.state, /*with_covariance=*/true);
  const int64_t id = InsertSnapshotRow(db, run_id, snapshot, record);
  for (std::size_t part = 0; part < SnapshotParts(record); ++part) InsertSnapshotPart(db, id, record, part);
  CompleteSnapshot(db, id);
  return id;
}

void DropUnreferencedDecompositions(SQLite::Database& db, int64_t run_id) {
  SQLite::Statement q(db,
                      "DELETE FROM decompositions WHERE run_id = ? AND id NOT IN "
                      "(SELECT decomposition_id FROM checkpoints WHERE run_id = ?)");
  q.bind(1, run_id);
  q.bind(2, run_id);
  q.exec();
}

Status CheckFinite(const std::string& what, double value) {
  if (!std::isfinite(value)) return Status::InvalidArgument(what + " is not finite");
  return Status::Ok();
}

// Reads application_id, user_version and whether there are tables, without writing anything.
struct FileIdentity {
  int32_t application_id = 0;
  int user_version = 0;
  bool has_tables = false;
};

Result<FileIdentity> Identify(const std::string& path) {
  try {
    SQLite::Database db(path, SQLite::OPEN_READONLY);
    // Another process's lock is waited for as the store waits for it (Connect).
    sqlite3_busy_handler(db.getHandle(), [](void*, int attempts) { return RetryLockedDatabase(attempts); }, nullptr);
    FileIdentity id;
    id.application_id = db.execAndGet("PRAGMA application_id").getInt();
    id.user_version = db.execAndGet("PRAGMA user_version").getInt();
    id.has_tables = db.execAndGet("SELECT count(*) FROM sqlite_master").getInt() > 0;
    return id;
  } catch (const SQLite::Exception& e) {
    // What the file is not is only known when SQLite could read it.
    switch (e.getErrorCode() & 0xff) {
      case SQLITE_BUSY:
      case SQLITE_LOCKED:
        return Status::FailedPrecondition(path + " is locked by another process (the file was not modified): "
                                   "try again when it is done");
      case SQLITE_CANTOPEN:
      case SQLITE_READONLY:
        return Status::FailedPrecondition(
            "cannot open " + path + ": " + e.what() + " (a database in WAL mode needs its -wal and -shm files "
            "beside it, which SQLite creates on first use: the folder must be writable, or they must exist)");
      default:
        return Status::InvalidArgument(path + " is not a readable SQLite database: " + e.what());
    }
  }
}

// Every digit of a double (std::to_string's six decimals show two different scores as one).
std::string Exact(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

char HexDigit(int v) { return "0123456789abcdef"[v & 15]; }
std::string Hex32(int32_t v) {
  std::string s = "0x";
  for (int shift = 28; shift >= 0; shift -= 4) s += HexDigit(static_cast<int>(static_cast<uint32_t>(v) >> shift));
  return s;
}

}  // namespace

Store::Store(std::string path, std::unique_ptr<SQLite::Database> db, StoreOptions options)
    : path_(std::move(path)), db_(std::move(db)), options_(std::move(options)) {}

Store::~Store() {
  db_.reset();
  if (run_lock_fd_ >= 0) ::close(run_lock_fd_);
}

template <typename F>
auto Store::Guard(const std::string& what, F&& body) const -> decltype(body()) {
  // Inside a transaction (a revision reading the run it revises), an error rolls that whole transaction back:
  // retrying only this part would go on in autocommit, each later write committed alone. The transaction's own
  // guard runs it again from its start.
  if (sqlite3_get_autocommit(db_->getHandle()) == 0) return body();
  return GuardCall(path_, options_, options_.io_error_patience, what, std::forward<F>(body));
}

template <typename T, typename Row>
Result<std::vector<T>> Store::Rows(const std::string& what, const std::string& sql, std::initializer_list<int64_t> ids,
                                   Row row) const {
  return Guard(what, [&]() -> Result<std::vector<T>> {
    SQLite::Statement q(*db_, sql);
    int k = 1;
    for (int64_t id : ids) q.bind(k++, id);
    std::vector<T> out;
    while (q.executeStep()) {
      Result<T> made = row(q);
      if (!made.ok()) return made.status();
      out.push_back(std::move(made).value());
    }
    return out;
  });
}

Result<std::unique_ptr<Store>> Store::Open(const std::string& path, OpenMode mode, StoreOptions options) {
  if (options.target_schema_version < 1 || options.target_schema_version > kStoreSchemaVersion) {
    return Status::InvalidArgument("schema version " + std::to_string(options.target_schema_version) +
                                   " is not one this build can create");
  }
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  if (!exists && mode != OpenMode::kCreate) return Status::NotFound("no database at " + path);
  if (exists && std::filesystem::file_size(path, ec) > 0) {
    NAMM_ASSIGN_OR_RETURN(FileIdentity id, Identify(path));
    if (id.application_id != kStoreApplicationId && (id.application_id != 0 || id.has_tables)) {
      return Status::InvalidArgument(path + " belongs to another application (SQLite application_id " +
                                     Hex32(id.application_id) + ", namm uses " + Hex32(kStoreApplicationId) +
                                     "); refusing to open it");
    }
    if (id.user_version > kStoreSchemaVersion) {
      return Status::FailedPrecondition(path + " has schema version " + std::to_string(id.user_version) +
                                        ", newer than this build's " + std::to_string(kStoreSchemaVersion) +
                                        "; use a newer namm-coordinator (the file was not modified)");
    }
    if (mode == OpenMode::kReadOnly && id.user_version != kStoreSchemaVersion) {
      return Status::FailedPrecondition(path + " has schema version " + std::to_string(id.user_version) +
                                        "; open it once with a writing command to migrate it to " +
                                        std::to_string(kStoreSchemaVersion));
    }
  } else if (mode == OpenMode::kReadOnly) {
    return Status::NotFound(path + " is empty, not a namm database");
  }
  return Connect(path, mode, std::move(options), std::chrono::seconds(0));
}

Result<std::unique_ptr<Store>> Store::Connect(const std::string& path, OpenMode mode, StoreOptions options,
                                              std::chrono::seconds patience) {
  return GuardCall(path, options, patience, "opening the database", [&]() -> Result<std::unique_ptr<Store>> {
    const int flags = mode == OpenMode::kReadOnly ? SQLite::OPEN_READONLY
                                                  : SQLite::OPEN_READWRITE | SQLite::OPEN_CREATE;
    auto db = std::make_unique<SQLite::Database>(path, flags);
    if (mode != OpenMode::kReadOnly && sqlite3_db_readonly(db->getHandle(), "main") == 1) ThrowOpenedReadOnly();
    // Waiting for another connection's write lock (a snapshot part being written in the background): retry every
    // 0.5 ms for up to 10 s. SQLite's own busy timeout backs off to sleeps of 25-100 ms, which a generation's
    // commit waiting behind a 4 MB part then paid in full.
    sqlite3_busy_handler(db->getHandle(), [](void*, int attempts) { return RetryLockedDatabase(attempts); }, nullptr);
    db->exec("PRAGMA foreign_keys = ON");
    if (mode != OpenMode::kReadOnly) {
      db->exec("PRAGMA journal_mode = WAL");
      // FULL: a commit is durable once CommitGeneration() returns, even across a power loss.
      db->exec("PRAGMA synchronous = FULL");
      // A snapshot passes through the WAL; do not keep a WAL of its size around afterwards.
      db->exec("PRAGMA journal_size_limit = 67108864");
      // Debian's SQLite zeroes freed pages: deleting a 70 MB snapshot would write 70 MB more. They only ever hold
      // this file's own data.
      db->exec("PRAGMA secure_delete = OFF");
      if (options.checkpoint_elsewhere) db->exec("PRAGMA wal_autocheckpoint = 0");
      if (!CanWrite(*db)) ThrowOpenedReadOnly();
      int version = db->execAndGet("PRAGMA user_version").getInt();
      for (; version < options.target_schema_version; ++version) {
        SQLite::Transaction tx(*db, SQLite::TransactionBehavior::IMMEDIATE);
        db->exec(kMigrations[version]);
        db->exec("PRAGMA application_id = " + std::to_string(kStoreApplicationId));
        db->exec("PRAGMA user_version = " + std::to_string(version + 1));
        tx.commit();
      }
    }
    return std::unique_ptr<Store>(new Store(path, std::move(db), std::move(options)));
  });
}

int Store::schema_version() const { return db_->execAndGet("PRAGMA user_version").getInt(); }

namespace {

void InsertStage(SQLite::Database& db, int64_t run_id, int64_t k, const StageRecord& s) {
  SQLite::Statement insert(db, "INSERT INTO stages(run_id, stage, tasks, generations) VALUES(?, ?, ?, ?)");
  insert.bind(1, run_id);
  insert.bind(2, k);
  insert.bind(3, json(s.tasks).dump());
  insert.bind(4, s.generations);
  insert.exec();
}

}  // namespace

Result<int64_t> Store::CreateRun(const NewRun& run) {
  if (run.initial_state == nullptr) return Status::InvalidArgument("a new run needs an initial optimizer state");
  if (run.stages.empty()) return Status::InvalidArgument("a run needs at least one stage");
  if (run.optimizer_revision < 1) return Status::InvalidArgument("a run needs an optimizer revision >= 1");
  return Guard("creating run '" + run.name + "'", [&]() -> Result<int64_t> {
    SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
    // Runs are found by name (serve resumes the one it names): two of one name would be one too many.
    SQLite::Statement same(*db_, "SELECT id FROM runs WHERE name = ?");
    same.bind(1, run.name);
    if (same.executeStep()) {
      return Status::FailedPrecondition(path_ + " already holds a run named '" + run.name + "' (run " +
                                        std::to_string(same.getColumn(0).getInt64()) + ")");
    }
    same.reset();
    SQLite::Statement insert(*db_,
                             "INSERT INTO runs(name, created_at, spec_yaml, dimension, model_fingerprint, status, "
                             "stage, generation, optimizer_revision, norm_stats) VALUES(?, ?, ?, ?, ?, 'running', 0, "
                             "0, ?, ?)");
    insert.bind(1, run.name);
    insert.bind(2, NowUtc());
    insert.bind(3, run.spec_yaml);
    insert.bind(4, static_cast<int64_t>(run.initial_state->mean.size()));
    insert.bind(5, run.model_fingerprint);
    insert.bind(6, run.optimizer_revision);
    const std::string norm_record = run.norm_stats ? encode_norm_stats(*run.norm_stats) : std::string();
    if (run.norm_stats) {
      BindBlob(insert, 7, norm_record);  // bound, not copied: alive until exec
    } else {
      insert.bind(7);
    }
    insert.exec();
    const int64_t id = db_->getLastInsertRowid();
    for (std::size_t k = 0; k < run.stages.size(); ++k) InsertStage(*db_, id, static_cast<int64_t>(k), run.stages[k]);
    WriteLatest(*db_, id, 0, 0, *run.initial_state, run.norm_stats);
    NewSnapshot initial;
    initial.state = run.initial_state;
    WriteSnapshot(*db_, id, initial);
    tx.commit();
    return id;
  });
}

Result<RunRecord> Store::GetRun(int64_t run_id) const {
  NAMM_ASSIGN_OR_RETURN(std::vector<RunRecord> runs, ReadRuns(run_id));
  if (runs.empty()) return Status::NotFound("no run " + std::to_string(run_id) + " in " + path_);
  return std::move(runs.front());
}

Result<std::vector<RunRecord>> Store::ListRuns() const { return ReadRuns(std::nullopt); }

Result<std::vector<RunRecord>> Store::ReadRuns(std::optional<int64_t> run_id) const {
  return Guard("reading runs", [&]() -> Result<std::vector<RunRecord>> {
    SQLite::Statement q(*db_,
                        std::string("SELECT id, name, created_at, spec_yaml, dimension, model_fingerprint, status, "
                                    "stage, generation, norm_stats, optimizer_revision FROM runs") +
                            (run_id ? " WHERE id = ?" : " ORDER BY id"));
    if (run_id) q.bind(1, *run_id);
    std::vector<RunRecord> runs;
    while (q.executeStep()) {
      RunRecord r;
      r.id = q.getColumn(0).getInt64();
      r.name = q.getColumn(1).getString();
      r.created_at = q.getColumn(2).getString();
      r.spec_yaml = q.getColumn(3).getString();
      r.dimension = q.getColumn(4).getInt64();
      r.model_fingerprint = q.getColumn(5).getString();
      r.status = q.getColumn(6).getString();
      r.stage = q.getColumn(7).getInt64();
      r.generation = q.getColumn(8).getInt64();
      r.optimizer_revision = q.getColumn(10).getInt64();
      NAMM_ASSIGN_OR_RETURN(r.norm_stats,
                            NormStatsOf(q.getColumn(9), "normalization statistics of run " + std::to_string(r.id)));
      runs.push_back(std::move(r));
    }
    return runs;
  });
}

Status Store::ReviseRunSpec(int64_t run_id, const std::string& spec_yaml, const std::vector<StageRecord>& stages) {
  return Guard("revising the spec of run " + std::to_string(run_id), [&]() -> Status {
    SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
    NAMM_ASSIGN_OR_RETURN(RunRecord run, GetRun(run_id));
    if (run.status != "running") return Status::FailedPrecondition("run " + std::to_string(run_id) + " is finished");
    NAMM_ASSIGN_OR_RETURN(std::vector<StageRecord> old, GetStages(run_id));
    // Which revisions are allowed is spec_revision's decision; the store only keeps its rows whole.
    if (stages.size() < old.size()) return Status::InvalidArgument("a revised spec cannot remove stages");
    for (std::size_t k = 0; k < stages.size(); ++k) {
      if (k >= old.size()) {
        InsertStage(*db_, run_id, static_cast<int64_t>(k), stages[k]);
        continue;
      }
      SQLite::Statement update(*db_, "UPDATE stages SET generations = ? WHERE run_id = ? AND stage = ?");
      update.bind(1, stages[k].generations);
      update.bind(2, run_id);
      update.bind(3, static_cast<int64_t>(k));
      update.exec();
    }
    SQLite::Statement revise(*db_, "UPDATE runs SET spec_yaml = ? WHERE id = ?");
    revise.bind(1, spec_yaml);
    revise.bind(2, run_id);
    revise.exec();
    tx.commit();
    return Status::Ok();
  });
}

Result<std::vector<StageRecord>> Store::GetStages(int64_t run_id) const {
  NAMM_ASSIGN_OR_RETURN(
      std::vector<StageRecord> stages,
      Rows<StageRecord>("reading stages",
                        "SELECT stage, tasks, generations, start_generation, end_generation, best_eval_fitness, "
                        "best_eval_generation FROM stages WHERE run_id = ? ORDER BY stage",
                        {run_id}, [](SQLite::Statement& q) {
                          StageRecord s;
                          s.stage = q.getColumn(0).getInt64();
                          s.tasks = json::parse(q.getColumn(1).getString()).get<std::vector<std::string>>();
                          s.generations = q.getColumn(2).getInt64();
                          s.start_generation = OptionalInt(q.getColumn(3));
                          s.end_generation = OptionalInt(q.getColumn(4));
                          s.best_eval_fitness = OptionalDouble(q.getColumn(5));
                          s.best_eval_generation = OptionalInt(q.getColumn(6));
                          return s;
                        }));
  if (stages.empty()) {
    NAMM_ASSIGN_OR_RETURN(const std::vector<RunRecord> runs, ReadRuns(run_id));
    if (!runs.empty()) {
      return Status::Corruption("run " + std::to_string(run_id) + " in " + path_ + " has no stages: the database is inconsistent");
    }
    return Status::NotFound("no run " + std::to_string(run_id) + " in " + path_);
  }
  return stages;
}

Status Store::FreezeNormStats(int64_t run_id, const NormStats& stats) {
  NAMM_ASSIGN_OR_RETURN(RunRecord run, GetRun(run_id));
  const std::string record = encode_norm_stats(stats);
  if (run.norm_stats) {
    if (encode_norm_stats(*run.norm_stats) == record) return Status::Ok();
    return Status::FailedPrecondition("run " + std::to_string(run_id) +
                                      " already has frozen normalization statistics; they never change");
  }
  return Guard("freezing normalization statistics", [&]() -> Status {
    SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
    SQLite::Statement q(*db_, "UPDATE runs SET norm_stats = ? WHERE id = ? AND norm_stats IS NULL");
    BindBlob(q, 1, record);
    q.bind(2, run_id);
    q.exec();
    // The latest checkpoint carries them from now on, like every later one.
    SQLite::Statement c(*db_, "UPDATE checkpoints SET norm_stats = ? WHERE run_id = ? AND role = 'latest'");
    BindBlob(c, 1, record);
    c.bind(2, run_id);
    c.exec();
    tx.commit();
    return Status::Ok();
  });
}

Result<int64_t> Store::RecordEvaluations(int64_t run_id, const std::vector<EvaluationRecord>& records,
                                         Durability durability) {
  for (const EvaluationRecord& e : records) {
    const std::string what = "evaluation (generation " + std::to_string(e.generation) + ", candidate " +
                             std::to_string(e.candidate) + ", " + e.task + " prompt " + std::to_string(e.prompt) + ")";
    if (!(e.score >= 0 && e.score <= 1)) return Status::InvalidArgument(what + ": score outside [0, 1]");
    NAMM_RETURN_IF_ERROR(CheckFinite(what + ": cache size", e.cache_size_mean));
    NAMM_RETURN_IF_ERROR(CheckFinite(what + ": duration", e.duration_seconds));
    if (e.candidate < kMeanCandidate || e.prompt < 0 || e.task.empty()) {
      return Status::InvalidArgument(what + ": bad candidate, prompt or task");
    }
  }
  return Guard("recording evaluations", [&]() -> Result<int64_t> {
    const UnsyncedCommits unsynced(*db_, durability == Durability::kWithNextCommit);
    SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
    SQLite::Statement q(*db_,
                        "INSERT OR IGNORE INTO evaluations(run_id, generation, candidate, task, prompt, score, "
                        "cache_size_mean, cache_size_final, prompt_tokens, generated_tokens, worker, "
                        "duration_seconds, norm_stats, recorded_at) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
    const std::string now = NowUtc();
    int64_t added = 0;
    for (const EvaluationRecord& e : records) {
      q.reset();
      q.bind(1, run_id);
      q.bind(2, e.generation);
      q.bind(3, e.candidate);
      q.bind(4, e.task);
      q.bind(5, e.prompt);
      q.bind(6, e.score);
      q.bind(7, e.cache_size_mean);
      q.bind(8, e.cache_size_final);
      q.bind(9, e.prompt_tokens);
      q.bind(10, e.generated_tokens);
      q.bind(11, e.worker);
      q.bind(12, e.duration_seconds);
      const std::string norm = e.norm_stats ? encode_norm_stats(*e.norm_stats) : std::string();
      if (e.norm_stats) {
        BindBlob(q, 13, norm);
      } else {
        q.bind(13);
      }
      q.bind(14, now);
      added += q.exec();
    }
    tx.commit();
    return added;
  });
}

Result<std::vector<EvaluationRecord>> Store::GetEvaluations(int64_t run_id, int64_t generation) const {
  return Rows<EvaluationRecord>(
      "reading evaluations",
      "SELECT candidate, task, prompt, score, cache_size_mean, cache_size_final, prompt_tokens, generated_tokens, "
      "worker, duration_seconds, norm_stats FROM evaluations WHERE run_id = ? AND generation = ? "
      "ORDER BY candidate, task, prompt",
      {run_id, generation}, [&](SQLite::Statement& q) -> Result<EvaluationRecord> {
        EvaluationRecord e;
        e.generation = generation;
        e.candidate = q.getColumn(0).getInt64();
        e.task = q.getColumn(1).getString();
        e.prompt = q.getColumn(2).getInt64();
        e.score = q.getColumn(3).getDouble();
        e.cache_size_mean = q.getColumn(4).getDouble();
        e.cache_size_final = q.getColumn(5).getInt64();
        e.prompt_tokens = q.getColumn(6).getInt64();
        e.generated_tokens = q.getColumn(7).getInt64();
        e.worker = q.getColumn(8).getString();
        e.duration_seconds = q.getColumn(9).getDouble();
        NAMM_ASSIGN_OR_RETURN(e.norm_stats, NormStatsOf(q.getColumn(10), "normalization statistics of an evaluation"));
        return e;
      });
}

Result<std::map<std::pair<std::string, int64_t>, int64_t>> Store::GetPromptTokens(int64_t run_id) const {
  return Guard("reading prompt token counts", [&]() -> Result<std::map<std::pair<std::string, int64_t>, int64_t>> {
    SQLite::Statement q(*db_, "SELECT task, prompt, MAX(prompt_tokens + generated_tokens) FROM evaluations "
                              "WHERE run_id = ? GROUP BY task, prompt");
    q.bind(1, run_id);
    std::map<std::pair<std::string, int64_t>, int64_t> out;
    while (q.executeStep()) out[{q.getColumn(0).getString(), q.getColumn(1).getInt64()}] = q.getColumn(2).getInt64();
    return out;
  });
}

Status Store::RecordDroppedPrompt(int64_t run_id, const DroppedPrompt& d) {
  NAMM_ASSIGN_OR_RETURN(RunRecord run, GetRun(run_id));
  if (run.status != "running" || d.generation != run.generation) {
    return Status::FailedPrecondition("run " + std::to_string(run_id) + " is " +
                                      (run.status == "running" ? "at generation " + std::to_string(run.generation)
                                                               : std::string("finished")) +
                                      "; refusing to drop a prompt of generation " + std::to_string(d.generation));
  }
  if (d.task.empty() || d.prompt < 0) return Status::InvalidArgument("a dropped prompt needs a task and a row >= 0");
  return Guard("recording a dropped prompt", [&]() -> Status {
    SQLite::Statement q(*db_,
                        "INSERT OR IGNORE INTO dropped_prompts(run_id, generation, task, prompt, error, dropped_at) "
                        "VALUES(?, ?, ?, ?, ?, ?)");
    q.bind(1, run_id);
    q.bind(2, d.generation);
    q.bind(3, d.task);
    q.bind(4, d.prompt);
    q.bind(5, d.error);
    q.bind(6, NowUtc());
    q.exec();
    return Status::Ok();
  });
}

Result<std::vector<DroppedPrompt>> Store::GetDroppedPrompts(int64_t run_id) const {
  return Rows<DroppedPrompt>("reading dropped prompts",
                             "SELECT generation, task, prompt, error, dropped_at FROM dropped_prompts "
                             "WHERE run_id = ? ORDER BY generation, task, prompt",
                             {run_id}, [](SQLite::Statement& q) {
                               return DroppedPrompt{q.getColumn(0).getInt64(), q.getColumn(1).getString(),
                                                    q.getColumn(2).getInt64(), q.getColumn(3).getString(),
                                                    q.getColumn(4).getString()};
                             });
}

Result<int64_t> Store::NextLeaseEpoch(int64_t run_id) {
  return Guard("numbering leases", [&]() -> Result<int64_t> {
    SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
    SQLite::Statement bump(*db_, "UPDATE runs SET lease_epoch = lease_epoch + 1 WHERE id = ?");
    bump.bind(1, run_id);
    if (bump.exec() != 1) return Status::NotFound("no run " + std::to_string(run_id));
    SQLite::Statement q(*db_, "SELECT lease_epoch FROM runs WHERE id = ?");
    q.bind(1, run_id);
    q.executeStep();
    const int64_t epoch = q.getColumn(0).getInt64();
    tx.commit();
    return epoch;
  });
}

Result<CommitOutcome> Store::CommitGeneration(const GenerationCommit& c) {
  const GenerationRecord& g = c.generation;
  if (c.next_state == nullptr) return Status::InvalidArgument("a commit needs the next state");
  if (c.snapshot && c.snapshot->state == nullptr) return Status::InvalidArgument("a snapshot needs its state");
  NAMM_ASSIGN_OR_RETURN(RunRecord run, GetRun(c.run_id));
  if (run.status != "running") return Status::FailedPrecondition("run " + std::to_string(c.run_id) + " is finished");
  if (g.generation != run.generation || g.stage != run.stage) {
    return Status::FailedPrecondition("run " + std::to_string(c.run_id) + " is at generation " +
                                      std::to_string(run.generation) + " of stage " + std::to_string(run.stage) +
                                      "; refusing a commit of generation " + std::to_string(g.generation) +
                                      " of stage " + std::to_string(g.stage));
  }
  return Guard("committing generation " + std::to_string(g.generation), [&]() -> Result<CommitOutcome> {
    int64_t snapshot_id = 0;
    SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
    SQLite::Statement gen(*db_,
                          "INSERT INTO generations(run_id, generation, stage, cmaes_generation, draw, sigma, "
                          "fitness_best, fitness_mean, fitness_std, fitness_worst, best_candidate, samples, "
                          "eval_fitness, eval_tasks, mean, best_params, eigen_min, eigen_max, tell_seconds, "
                          "completed_at) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
    gen.bind(1, c.run_id);
    gen.bind(2, g.generation);
    gen.bind(3, g.stage);
    gen.bind(4, g.cmaes_generation);
    gen.bind(5, static_cast<int64_t>(g.draw));
    gen.bind(6, g.sigma);
    gen.bind(7, g.fitness_best);
    gen.bind(8, g.fitness_mean);
    gen.bind(9, g.fitness_std);
    gen.bind(10, g.fitness_worst);
    gen.bind(11, g.best_candidate);
    gen.bind(12, json(g.samples).dump());
    BindOptional(gen, 13, g.eval_fitness);
    if (g.eval_fitness) {
      gen.bind(14, TaskScoresJson(g.eval_tasks).dump());
    } else {
      gen.bind(14);
    }
    BindDoubles(gen, 15, g.mean);
    BindDoubles(gen, 16, g.best_params);
    gen.bind(17, g.eigen_min);
    gen.bind(18, g.eigen_max);
    gen.bind(19, g.tell_seconds);
    gen.bind(20, NowUtc());
    gen.exec();

    SQLite::Statement cand(*db_, "INSERT INTO candidates(run_id, generation, candidate, fitness, tasks) "
                                 "VALUES(?, ?, ?, ?, ?)");
    for (const CandidateRecord& k : c.candidates) {
      cand.reset();
      cand.bind(1, c.run_id);
      cand.bind(2, g.generation);
      cand.bind(3, k.candidate);
      cand.bind(4, k.fitness);
      cand.bind(5, TaskScoresJson(k.tasks).dump());
      cand.exec();
    }

    if (c.new_stage_best) {
      if (!g.eval_fitness) return Status::InvalidArgument("a new stage best needs an evaluation fitness");
      SQLite::Statement best(*db_, "UPDATE stages SET best_eval_fitness = ?, best_eval_generation = ? "
                                   "WHERE run_id = ? AND stage = ?");
      best.bind(1, *g.eval_fitness);
      best.bind(2, g.generation);
      best.bind(3, c.run_id);
      best.bind(4, g.stage);
      best.exec();
      // The generation's start state (the current latest checkpoint) is the state whose mean was evaluated.
      SQLite::Statement drop(*db_, "DELETE FROM checkpoints WHERE run_id = ? AND role = 'stage_best' AND stage = ?");
      drop.bind(1, c.run_id);
      drop.bind(2, g.stage);
      drop.exec();
      SQLite::Statement copy(*db_,
                             "INSERT INTO checkpoints(run_id, role, stage, generation, eval_fitness, state, checksum, "
                             "decomposition_id, norm_stats, created_at) SELECT run_id, 'stage_best', stage, "
                             "generation, ?, state, checksum, decomposition_id, norm_stats, ? FROM checkpoints "
                             "WHERE run_id = ? AND role = 'latest'");
      copy.bind(1, *g.eval_fitness);
      copy.bind(2, NowUtc());
      copy.bind(3, c.run_id);
      copy.exec();
    }
    SQLite::Statement start(*db_, "UPDATE stages SET start_generation = ? WHERE run_id = ? AND stage = ? AND "
                                  "start_generation IS NULL");
    start.bind(1, g.generation);
    start.bind(2, c.run_id);
    start.bind(3, g.stage);
    start.exec();

    const int64_t next_generation = g.generation + 1;
    if (c.stage_ends) {
      SQLite::Statement end(*db_, "UPDATE stages SET end_generation = ? WHERE run_id = ? AND stage = ?");
      end.bind(1, next_generation);
      end.bind(2, c.run_id);
      end.bind(3, g.stage);
      end.exec();
    }
    WriteLatest(*db_, c.run_id, c.next_stage, next_generation, *c.next_state, run.norm_stats);
    if (c.snapshot) snapshot_id = WriteSnapshot(*db_, c.run_id, *c.snapshot);
    if (c.eigen_applied) {
      SQLite::Statement applied(*db_, "UPDATE snapshots SET eigen_checksum = ? WHERE run_id = ? AND id = ?");
      applied.bind(1, static_cast<int64_t>(c.eigen_applied->second));
      applied.bind(2, c.run_id);
      applied.bind(3, c.eigen_applied->first);
      applied.exec();
    }
    CommitOutcome outcome;
    if (c.keep_snapshots) {
      std::string keep = std::to_string(snapshot_id);
      for (int64_t id : *c.keep_snapshots) keep += "," + std::to_string(id);
      // (Incomplete ones are being written by another connection, or were cut off: DropIncompleteSnapshots().)
      SQLite::Statement unneeded(*db_, "SELECT id FROM snapshots WHERE run_id = ? AND complete = 1 AND id NOT IN (" +
                                           keep + ") AND NOT (stage = ? AND generation = ?) ORDER BY id");
      unneeded.bind(1, c.run_id);
      unneeded.bind(2, c.snapshot_in_flight ? c.snapshot_in_flight->first : int64_t{-1});
      unneeded.bind(3, c.snapshot_in_flight ? c.snapshot_in_flight->second : int64_t{-1});
      while (unneeded.executeStep()) outcome.unneeded_snapshots.push_back(unneeded.getColumn(0).getInt64());
    }
    DropUnreferencedDecompositions(*db_, c.run_id);

    SQLite::Statement progress(*db_, "UPDATE runs SET stage = ?, generation = ?, status = ? WHERE id = ?");
    progress.bind(1, c.next_stage);
    progress.bind(2, next_generation);
    progress.bind(3, c.finished ? "finished" : "running");
    progress.bind(4, c.run_id);
    progress.exec();

    SQLite::Statement metric(*db_, "INSERT INTO metrics(run_id, generation, name, value) VALUES(?, ?, ?, ?)");
    for (const auto& [name, value] : c.metrics) {
      if (!std::isfinite(value)) continue;  // a metric with no value this generation (e.g. no evaluation)
      metric.reset();
      metric.bind(1, c.run_id);
      metric.bind(2, g.generation);
      metric.bind(3, name);
      metric.bind(4, value);
      metric.exec();
    }
    if (options_.before_commit) options_.before_commit();
    tx.commit();
    outcome.snapshot_id = snapshot_id;
    return outcome;
  });
}

namespace {

GenerationRecord GenerationOf(SQLite::Statement& q) {
  GenerationRecord g;
  g.generation = q.getColumn(0).getInt64();
  g.stage = q.getColumn(1).getInt64();
  g.cmaes_generation = q.getColumn(2).getInt64();
  g.draw = static_cast<uint64_t>(q.getColumn(3).getInt64());
  g.sigma = q.getColumn(4).getDouble();
  g.fitness_best = q.getColumn(5).getDouble();
  g.fitness_mean = q.getColumn(6).getDouble();
  g.fitness_std = q.getColumn(7).getDouble();
  g.fitness_worst = q.getColumn(8).getDouble();
  g.best_candidate = q.getColumn(9).getInt64();
  g.samples = json::parse(q.getColumn(10).getString()).get<PromptSample>();
  g.eval_fitness = OptionalDouble(q.getColumn(11));
  if (!q.getColumn(12).isNull()) g.eval_tasks = TaskScoresOf(q.getColumn(12).getString());
  g.eigen_min = q.getColumn(13).getDouble();
  g.eigen_max = q.getColumn(14).getDouble();
  g.tell_seconds = q.getColumn(15).getDouble();
  g.completed_at = q.getColumn(16).getString();
  return g;
}

constexpr const char* kGenerationColumns =
    "generation, stage, cmaes_generation, draw, sigma, fitness_best, fitness_mean, fitness_std, fitness_worst, "
    "best_candidate, samples, eval_fitness, eval_tasks, eigen_min, eigen_max, tell_seconds, completed_at";

}  // namespace

Result<std::vector<GenerationRecord>> Store::GetGenerations(int64_t run_id) const {
  return Rows<GenerationRecord>("reading generations",
                                 std::string("SELECT ") + kGenerationColumns +
                                     " FROM generations WHERE run_id = ? ORDER BY generation",
                                 {run_id}, [](SQLite::Statement& q) { return GenerationOf(q); });
}

Result<GenerationRecord> Store::GetGeneration(int64_t run_id, int64_t generation) const {
  return Guard("reading generation " + std::to_string(generation), [&]() -> Result<GenerationRecord> {
    SQLite::Statement q(*db_, std::string("SELECT ") + kGenerationColumns +
                                  ", mean, best_params FROM generations WHERE run_id = ? AND generation = ?");
    q.bind(1, run_id);
    q.bind(2, generation);
    if (!q.executeStep()) {
      return Status::NotFound("run " + std::to_string(run_id) + " has no completed generation " +
                              std::to_string(generation));
    }
    GenerationRecord g = GenerationOf(q);
    g.mean = DoublesOf(q.getColumn(17));
    g.best_params = DoublesOf(q.getColumn(18));
    return g;
  });
}

Result<std::vector<CandidateRecord>> Store::GetCandidates(int64_t run_id, int64_t generation) const {
  return Rows<CandidateRecord>(
      "reading candidates",
      "SELECT candidate, fitness, tasks FROM candidates WHERE run_id = ? AND generation = ? ORDER BY candidate",
      {run_id, generation}, [](SQLite::Statement& q) {
        return CandidateRecord{q.getColumn(0).getInt64(), q.getColumn(1).getDouble(),
                               TaskScoresOf(q.getColumn(2).getString())};
      });
}

Result<CheckpointRecord> Store::GetCheckpoint(int64_t run_id, const std::string& role, int64_t stage,
                                              const CmaesParams& params) const {
  const std::string what = "the " + role + " checkpoint of run " + std::to_string(run_id) +
                           (role == "latest" ? "" : " stage " + std::to_string(stage));
  return Guard("reading " + what, [&]() -> Result<CheckpointRecord> {
    SQLite::Statement q(*db_,
                        "SELECT c.stage, c.generation, c.eval_fitness, c.state, c.checksum, c.norm_stats, "
                        "c.created_at, d.record FROM checkpoints c LEFT JOIN decompositions d ON d.id = "
                        "c.decomposition_id WHERE c.run_id = ? AND c.role = ? AND (c.role = 'latest' OR c.stage = ?)");
    q.bind(1, run_id);
    q.bind(2, role);
    q.bind(3, stage);
    if (!q.executeStep()) return Status::NotFound(what + " does not exist");
    CheckpointRecord c;
    c.role = role;
    c.stage = q.getColumn(0).getInt64();
    c.generation = q.getColumn(1).getInt64();
    c.eval_fitness = OptionalDouble(q.getColumn(2));
    const std::string_view state = BlobOf(q.getColumn(3));
    c.checksum = static_cast<uint32_t>(q.getColumn(4).getInt64());
    if (record_checksum(state) != c.checksum) return Status::Corruption(what + " does not match its stored checksum");
    bool has_covariance = false;
    NAMM_ASSIGN_OR_RETURN(c.state, decode_cmaes_state(state, params, what, &has_covariance));
    NAMM_ASSIGN_OR_RETURN(c.norm_stats, NormStatsOf(q.getColumn(5), what + " (normalization statistics)"));
    c.created_at = q.getColumn(6).getString();
    if (!has_covariance) return c;  // light
    // An older build's complete checkpoint, with its stored eigensystem.
    if (q.getColumn(7).isNull()) return Status::Corruption(what + " holds a covariance but no eigensystem");
    NAMM_ASSIGN_OR_RETURN(Eigensystem eigen, decode_eigensystem(BlobOf(q.getColumn(7)), params, what + " (eigensystem)"));
    if (eigen.generation != c.state.eigen.generation) {
      return Status::Corruption(what + " refers to the eigensystem of generation " +
                                std::to_string(c.state.eigen.generation) + " but holds that of " +
                                std::to_string(eigen.generation));
    }
    c.state.eigen = std::move(eigen);
    return c;
  });
}

Result<std::vector<CheckpointRecord>> Store::ListCheckpoints(int64_t run_id) const {
  return Rows<CheckpointRecord>("listing checkpoints",
                                 "SELECT role, stage, generation, eval_fitness, checksum, created_at FROM checkpoints "
                                 "WHERE run_id = ? ORDER BY role, stage",
                                 {run_id}, [](SQLite::Statement& q) {
                                   CheckpointRecord c;
                                   c.role = q.getColumn(0).getString();
                                   c.stage = q.getColumn(1).getInt64();
                                   c.generation = q.getColumn(2).getInt64();
                                   c.eval_fitness = OptionalDouble(q.getColumn(3));
                                   c.checksum = static_cast<uint32_t>(q.getColumn(4).getInt64());
                                   c.created_at = q.getColumn(5).getString();
                                   return c;
                                 });
}

Result<std::vector<SnapshotRecord>> Store::ListSnapshots(int64_t run_id) const {
  return Rows<SnapshotRecord>(
      "listing snapshots",
      std::string(kSnapshotColumns) + " FROM snapshots WHERE run_id = ? AND complete = 1 ORDER BY stage, generation, id",
      {run_id}, [](SQLite::Statement& q) { return SnapshotOf(q); });
}

Result<SnapshotRecord> Store::GetSnapshot(int64_t run_id, int64_t id, const CmaesParams& params) const {
  const std::string what = "snapshot " + std::to_string(id) + " of run " + std::to_string(run_id);
  return Guard("reading " + what, [&]() -> Result<SnapshotRecord> {
    SQLite::Statement q(*db_, std::string(kSnapshotColumns) +
                                  ", checksum FROM snapshots WHERE run_id = ? AND id = ? AND complete = 1");
    q.bind(1, run_id);
    q.bind(2, id);
    if (!q.executeStep()) return Status::NotFound(what + " does not exist");
    SnapshotRecord r = SnapshotOf(q);
    const auto checksum = static_cast<uint32_t>(q.getColumn(6).getInt64());
    // The stored length is checked against the parts before it sizes anything.
    SQLite::Statement size(*db_, "SELECT TOTAL(length(bytes)) FROM snapshot_parts WHERE snapshot_id = ?");
    size.bind(1, id);
    size.executeStep();
    if (static_cast<double>(r.bytes) != size.getColumn(0).getDouble()) {
      return Status::Corruption(what + " says it holds " + std::to_string(r.bytes) + " bytes but its parts hold " +
                                std::to_string(static_cast<int64_t>(size.getColumn(0).getDouble())));
    }
    std::string record;
    record.reserve(static_cast<std::size_t>(r.bytes));
    SQLite::Statement parts(*db_, "SELECT bytes FROM snapshot_parts WHERE snapshot_id = ? ORDER BY part");
    parts.bind(1, id);
    while (parts.executeStep()) record += BlobOf(parts.getColumn(0));
    const std::string_view state = record;
    if (static_cast<int64_t>(state.size()) != r.bytes || record_checksum(state) != checksum) {
      return Status::Corruption(what + " does not match its stored size and checksum");
    }
    bool has_covariance = false;
    NAMM_ASSIGN_OR_RETURN(r.state, decode_cmaes_state(state, params, what, &has_covariance));
    if (!has_covariance) return Status::Corruption(what + " has no covariance");
    return r;
  });
}

Status Store::DropIncompleteSnapshots(int64_t run_id) {
  return Guard("removing incomplete snapshots", [&]() -> Status {
    SQLite::Statement q(*db_, "DELETE FROM snapshots WHERE run_id = ? AND complete = 0");
    q.bind(1, run_id);
    q.exec();
    return Status::Ok();
  });
}

Status Store::DropSnapshots(int64_t run_id, const std::vector<int64_t>& ids) {
  if (!ids.empty()) {
    NAMM_RETURN_IF_ERROR(Guard("dropping unneeded snapshots", [&]() -> Status {
      SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
      SQLite::Statement q(*db_, "DELETE FROM snapshots WHERE run_id = ? AND id = ? AND complete = 1");
      for (int64_t id : ids) {
        q.reset();
        q.bind(1, run_id);
        q.bind(2, id);
        q.exec();
      }
      tx.commit();
      return Status::Ok();
    }));
  }
  return Checkpoint();
}

Status Store::Checkpoint() {
  // PASSIVE: TRUNCATE (what this did before) holds the write lock while it waits for every reader and while it
  // copies and syncs the whole WAL, so that under a loaded disk the trainer's commits waited past SQLite's busy
  // timeout and the run stopped ("database is locked").
  return Guard("checkpointing the write-ahead log", [&]() -> Status {
    db_->exec("PRAGMA wal_checkpoint(PASSIVE)");
    return Status::Ok();
  });
}

// A connection of its own for background work, with this one's options (the trainer's is not thread-safe).
Result<std::unique_ptr<Store>> Store::OpenAnother() const {
  StoreOptions options = options_;
  options.before_commit = nullptr;
  options.checkpoint_elsewhere = true;  // the trainer's compaction checkpoints
  // The file was checked when this connection opened it; a background connection that meets EMFILE or EIO waits.
  return Connect(path_, OpenMode::kExisting, std::move(options), options_.io_error_patience);
}

Status Store::LockRun(int64_t run_id) {
  if (run_id < 0) return Status::InvalidArgument("no run " + std::to_string(run_id));
  if (run_lock_fd_ < 0) {
    run_lock_fd_ = ::open(path_.c_str(), O_RDWR | O_CLOEXEC);
    if (run_lock_fd_ < 0) return Status::IOError("cannot open " + path_ + " to lock run " + std::to_string(run_id) +
                                                 ": " + std::strerror(errno));
  }
  // One byte per run at 2^62 + run id: beyond any file's end and SQLite's own lock bytes (at 2^30).
  struct flock lock = {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = (off_t{1} << 62) + static_cast<off_t>(run_id);
  lock.l_len = 1;
  if (::fcntl(run_lock_fd_, F_OFD_SETLK, &lock) == 0) return Status::Ok();
  const int error = errno;
  if (error != EAGAIN && error != EACCES) {
    return Status::IOError("cannot lock run " + std::to_string(run_id) + " of " + path_ + ": " + std::strerror(error));
  }
  struct stat st = {};
  const std::string identity = ::fstat(run_lock_fd_, &st) == 0 ? "device " + std::to_string(st.st_dev) + ", inode " +
                                                                     std::to_string(st.st_ino)
                                                               : "its identity unknown";
  return Status::FailedPrecondition("another coordinator holds the lock on run " + std::to_string(run_id) + " of " +
                                    path_ + " (the database file by any path naming it: " + identity + ")");
}

Status Store::DropSnapshotsConcurrently(int64_t run_id, const std::vector<int64_t>& ids) const {
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<Store> connection, OpenAnother());
  return connection->DropSnapshots(run_id, ids);
}

Result<int64_t> Store::AddSnapshotConcurrently(int64_t run_id, const NewSnapshot& snapshot) const {
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<Store> connection, OpenAnother());
  return connection->AddSnapshot(run_id, snapshot);
}

Result<int64_t> Store::AddSnapshot(int64_t run_id, const NewSnapshot& snapshot) {
  if (snapshot.state == nullptr) return Status::InvalidArgument("a snapshot needs its state");
  const std::string record = encode_cmaes_state(*snapshot.state, /*with_covariance=*/true);
  // A part per transaction: another connection's commits wait for a part, not for the whole record. The parts
  // are committed without fsync (the write lock is held for the copy into the WAL, not for the disk) and the
  // WAL is synced after each outside any lock, so that another connection's next fsync finds at most one
  // part's pages to write; the FULL commit that completes the snapshot makes it durable. Each transaction is
  // retried on its own after a transient error.
  const std::string what = "writing a snapshot";
  const auto transaction = [&](bool synced, const std::function<void()>& body) -> Status {
    return Guard(what, [&]() -> Status {
      const UnsyncedCommits unsynced(*db_, !synced);
      SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
      body();
      tx.commit();
      return Status::Ok();
    });
  };
  int64_t id = 0;
  NAMM_RETURN_IF_ERROR(transaction(false, [&] { id = InsertSnapshotRow(*db_, run_id, snapshot, record); }));
  const int wal = ::open((path_ + "-wal").c_str(), O_RDONLY | O_CLOEXEC);
  const struct CloseOnExit {
    int fd;
    ~CloseOnExit() {
      if (fd >= 0) ::close(fd);
    }
  } close_wal{wal};
  for (std::size_t part = 0; part < SnapshotParts(record); ++part) {
    NAMM_RETURN_IF_ERROR(transaction(false, [&] { InsertSnapshotPart(*db_, id, record, part); }));
    if (wal >= 0) (void)::fdatasync(wal);
  }
  NAMM_RETURN_IF_ERROR(transaction(true, [&] { CompleteSnapshot(*db_, id); }));
  return id;
}

Result<std::map<std::string, double>> Store::GetMetrics(int64_t run_id, int64_t generation) const {
  return Guard("reading metrics", [&]() -> Result<std::map<std::string, double>> {
    SQLite::Statement q(*db_, "SELECT name, value FROM metrics WHERE run_id = ? AND generation = ?");
    q.bind(1, run_id);
    q.bind(2, generation);
    std::map<std::string, double> out;
    while (q.executeStep()) out[q.getColumn(0).getString()] = q.getColumn(1).getDouble();
    return out;
  });
}

Result<std::vector<GenerationActivity>> Store::GetGenerationActivity(int64_t run_id) const {
  return Rows<GenerationActivity>("reading generation activity",
                                   "SELECT generation, COUNT(*), COUNT(DISTINCT worker), TOTAL(duration_seconds) "
                                   "FROM evaluations WHERE run_id = ? GROUP BY generation ORDER BY generation",
                                   {run_id}, [](SQLite::Statement& q) {
                                     return GenerationActivity{q.getColumn(0).getInt64(), q.getColumn(1).getInt64(),
                                                               q.getColumn(2).getInt64(), q.getColumn(3).getDouble()};
                                   });
}

Result<ReferenceImport> Store::ImportReferenceScores(const std::string& fingerprint,
                                                     const tasks::ReferenceScores& scores, const std::string& source,
                                                     bool replace) {
  if (fingerprint.empty()) return Status::InvalidArgument("reference scores need a model fingerprint");
  return Guard("importing reference scores", [&]() -> Result<ReferenceImport> {
    SQLite::Transaction tx(*db_, SQLite::TransactionBehavior::IMMEDIATE);
    SQLite::Statement get(*db_, "SELECT score FROM reference_scores WHERE model_fingerprint = ? AND task = ? AND "
                                "prompt = ?");
    SQLite::Statement put(*db_,
                          "INSERT OR REPLACE INTO reference_scores(model_fingerprint, task, prompt, score, source, "
                          "recorded_at) VALUES(?, ?, ?, ?, ?, ?)");
    const std::string now = NowUtc();
    ReferenceImport summary;
    for (const auto& [task, rows] : scores.scores()) {
      for (const auto& [row, score] : rows) {
        get.reset();
        get.bind(1, fingerprint);
        get.bind(2, task);
        get.bind(3, row);
        if (get.executeStep()) {
          const double stored = get.getColumn(0).getDouble();
          if (stored == score) {
            ++summary.unchanged;
            continue;
          }
          if (!replace) {
            return Status::FailedPrecondition(
                "the database already holds reference score " + Exact(stored) + " for " + task + " prompt " +
                std::to_string(row) + " of model " + fingerprint + " and the import says " + Exact(score) +
                "; nothing was imported (pass --replace to overwrite)");
          }
          ++summary.replaced;
        } else {
          ++summary.added;
        }
        put.reset();
        put.bind(1, fingerprint);
        put.bind(2, task);
        put.bind(3, row);
        put.bind(4, score);
        put.bind(5, source);
        put.bind(6, now);
        put.exec();
      }
    }
    tx.commit();
    return summary;
  });
}

Result<tasks::ReferenceScores> Store::GetReferenceScores(const std::string& fingerprint) const {
  return Guard("reading reference scores", [&]() -> Result<tasks::ReferenceScores> {
    SQLite::Statement q(*db_, "SELECT task, prompt, score FROM reference_scores WHERE model_fingerprint = ?");
    q.bind(1, fingerprint);
    tasks::ReferenceScores out;
    while (q.executeStep()) {
      NAMM_RETURN_IF_ERROR(out.Set(q.getColumn(0).getString(), q.getColumn(1).getInt64(), q.getColumn(2).getDouble()));
    }
    return out;
  });
}

}  // namespace namm::coordinator
