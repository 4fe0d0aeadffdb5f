// The coordinator's log of the progress the store has not taken yet: leases handed out (written before they are
// sent) and ended, and results accepted (written before their report is answered). An append is one write() of a
// few hundred bytes, without fsync: it survives a crash of the coordinator (not a power loss, after which those
// results are computed again), and costs neither a transaction nor a rewrite of B-tree pages per report. The
// run loop stores results in the database in batches; a restarted coordinator reads the log back, stores the
// results it holds and keeps the leases still open for their workers. Truncated once a generation is committed.
//
// One coordinator per run: Store::LockRun() decides, by the database file's identity; Open() also takes an
// exclusive lock on the log (flock; the kernel releases it when the process ends, however it ends) and writes who
// holds it into the header, so that a second coordinator of the same run is refused at once with the first one's
// pid and host instead of truncating its log.
//
// File: "NAMMPLOG", a version (2), the holder (128 bytes: "pid P on HOST since TIME", zero-padded; version 1,
// written by older builds, has none), then records of (payload length, CRC-32 of the payload, payload). Reading
// stops at the first torn or damaged record (what a crash in the middle of an append leaves).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "namm/coordinator/store.h"
#include "namm/status.h"

namespace namm::coordinator {

// A base-model (full cache) score computed by a worker.
struct ReferenceResult {
  std::string task;
  int64_t prompt = 0;
  double score = 0;
};

// Leases handed out to the worker named `worker`, and (LeaseRecord) what a restarted coordinator keeps for it.
struct LeaseRecord {
  uint64_t id = 0;
  int64_t generation = 0;
  std::string worker;
  bool reference = false;
  int64_t candidate = 0;
  std::string task;
  std::vector<int64_t> prompts;
};

struct ProgressEntries {
  std::vector<LeaseRecord> leases_issued;
  std::vector<uint64_t> leases_ended;
  std::vector<EvaluationRecord> evaluations;
  std::vector<ReferenceResult> references;

  bool empty() const {
    return leases_issued.empty() && leases_ended.empty() && evaluations.empty() && references.empty();
  }
};

// The progress log of run `run_id` of the database at `db`: beside the file `db` names after symbolic links.
std::string progress_log_path(const std::string& db, int64_t run_id);
// Who holds the progress log at `path`, as its header names them ("pid P on HOST since TIME"; "" when unknown).
std::string progress_log_holder(const std::string& path);

class ProgressLog {
 public:
  // Takes the lock on the log at `path` (creating it if missing) and reads it. FailedPrecondition, naming the
  // holder, when another process holds it.
  static Result<std::unique_ptr<ProgressLog>> Open(const std::string& path);
  ~ProgressLog();
  ProgressLog(const ProgressLog&) = delete;
  ProgressLog& operator=(const ProgressLog&) = delete;

  const std::string& path() const { return path_; }
  // What the log held when opened: every result, and the leases issued and not ended (in leases_issued).
  const ProgressEntries& recovered() const { return recovered_; }
  // Bytes of a torn or damaged tail that Open() ignored.
  int64_t ignored_bytes() const { return ignored_bytes_; }

  // Appends `entries` as one write(). Thread-safe.
  Status Append(const ProgressEntries& entries);
  // Empties the log, then appends `keep` (leases that must survive another restart). Thread-safe.
  Status Reset(const std::vector<LeaseRecord>& keep = {});

 private:
  ProgressLog(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  // Writes `bytes` at end_ (mu_ held, or before the log is shared).
  Status Write(const std::string& bytes);
  // Replaces the whole file by `bytes` (mu_ held, or before the log is shared).
  Status Rewrite(const std::string& bytes);

  const std::string path_;
  const int fd_;
  std::mutex mu_;
  uint64_t end_ = 0;    // where the next record goes (no O_APPEND: the header's holder is written in place)
  std::string holder_;  // this process, as the header names it (kHolderBytes, zero-padded)
  ProgressEntries recovered_;
  int64_t ignored_bytes_ = 0;
};

}  // namespace namm::coordinator
