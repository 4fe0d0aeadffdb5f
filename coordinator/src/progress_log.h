// The coordinator's log of the progress the store has not taken yet: leases handed out (written before they are
// sent) and ended, and results accepted (written before their report is answered). An append is one write() of a
// few hundred bytes, without fsync: it survives a crash of the coordinator (not a power loss, after which those
// results are computed again), and costs neither a transaction nor a rewrite of B-tree pages per report. The
// run loop stores results in the database in batches; a restarted coordinator reads the log back, stores the
// results it holds and keeps the leases still open for their workers. Truncated once a generation is committed.
//
// File: "NAMMPLOG", a version, then records of (payload length, CRC-32 of the payload, payload). Reading stops at
// the first torn or damaged record (what a crash in the middle of an append leaves).
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

class ProgressLog {
 public:
  // Opens (creating it if missing) and reads the log at `path`.
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
  Status Write(const std::string& bytes);

  const std::string path_;
  const int fd_;
  std::mutex mu_;
  ProgressEntries recovered_;
  int64_t ignored_bytes_ = 0;
};

}  // namespace namm::coordinator
