#include "namm/coordinator/progress_log.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "../file_size_limit.h"
#include "../temp_path.h"
#include "namm/file_util.h"

namespace namm::coordinator {
namespace {

LeaseRecord Lease(uint64_t id, std::vector<int64_t> prompts) {
  return LeaseRecord{id, 3, "host-a", false, 5, "t/a", std::move(prompts)};
}

EvaluationRecord Result(int64_t prompt, bool with_stats) {
  EvaluationRecord e;
  e.generation = 3;
  e.candidate = 5;
  e.task = "t/a";
  e.prompt = prompt;
  e.score = 0.25 + 0.01 * static_cast<double>(prompt);
  e.cache_size_mean = 100.5;
  e.cache_size_final = 90;
  e.prompt_tokens = 1000;
  e.generated_tokens = 7;
  e.worker = "host-a";
  e.duration_seconds = 0.5;
  if (with_stats) {
    NormStats s;
    s.count = 12;
    s.mean.fill(0.5);
    s.var.fill(2.0);
    e.norm_stats = s;
  }
  return e;
}

TEST(ProgressLog, ReadsBackResultsAndTheLeasesStillOpenAndSurvivesATornTail) {
  const std::string path = namm::testing::TempPath("progress_log");
  std::filesystem::remove(path);
  {
    auto log = ProgressLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status().ToString();
    EXPECT_TRUE((*log)->recovered().empty());
    ProgressEntries a;
    a.leases_issued = {Lease(1, {0, 1}), Lease(2, {2})};
    ASSERT_TRUE((*log)->Append(a).ok());
    ProgressEntries b;
    b.leases_ended = {1};
    b.evaluations = {Result(0, false), Result(1, true)};
    b.references = {{"t/a", 9, 0.75}};
    ASSERT_TRUE((*log)->Append(b).ok());
  }
  const auto whole = std::filesystem::file_size(path);
  {
    auto log = ProgressLog::Open(path);
    ASSERT_TRUE(log.ok());
    const ProgressEntries& r = (*log)->recovered();
    ASSERT_EQ(r.leases_issued.size(), 1u) << "lease 1 ended";
    EXPECT_EQ(r.leases_issued[0].id, 2u);
    EXPECT_EQ(r.leases_issued[0].prompts, std::vector<int64_t>{2});
    ASSERT_EQ(r.evaluations.size(), 2u);
    EXPECT_EQ(r.evaluations[1].score, Result(1, true).score);
    EXPECT_EQ(r.evaluations[1].worker, "host-a");
    ASSERT_TRUE(r.evaluations[1].norm_stats.has_value());
    EXPECT_EQ(r.evaluations[1].norm_stats->var[3], 2.0);
    EXPECT_FALSE(r.evaluations[0].norm_stats.has_value());
    ASSERT_EQ(r.references.size(), 1u);
    EXPECT_EQ(r.references[0].score, 0.75);
    EXPECT_EQ((*log)->ignored_bytes(), 0);
  }
  // A crash in the middle of an append leaves a torn record: it and only it is lost, and cut off.
  std::filesystem::resize_file(path, whole - 5);
  {
    auto log = ProgressLog::Open(path);
    ASSERT_TRUE(log.ok());
    EXPECT_GT((*log)->ignored_bytes(), 0);
    EXPECT_EQ((*log)->recovered().evaluations.size(), 2u);
    EXPECT_TRUE((*log)->recovered().references.empty()) << "the torn last record";
    // Reset keeps only what it is given.
    ASSERT_TRUE((*log)->Reset({Lease(7, {4})}).ok());
  }
  auto log = ProgressLog::Open(path);
  ASSERT_TRUE(log.ok());
  ASSERT_EQ((*log)->recovered().leases_issued.size(), 1u);
  EXPECT_EQ((*log)->recovered().leases_issued[0].id, 7u);
  EXPECT_TRUE((*log)->recovered().evaluations.empty());
}

TEST(ProgressLog, RefusesAFileThatIsNotOne) {
  const std::string path = namm::testing::TempPath("not_a_progress_log");
  ASSERT_TRUE(write_file_atomically(path, {"hello, this is not a log"}).ok());
  auto log = ProgressLog::Open(path);
  ASSERT_FALSE(log.ok());
  EXPECT_NE(log.status().message().find("not a namm progress log"), std::string::npos);
  EXPECT_EQ(*read_file(path), "hello, this is not a log") << "left untouched";
}

}  // namespace
}  // namespace namm::coordinator

namespace namm::coordinator {
namespace {

// One coordinator per run: the log's lock is held while it is open, and whoever else opens it (another process,
// or here another opening) is told who holds it; it is free again once the holder closes it (or dies).
TEST(ProgressLog, OnlyOneHolderAtATimeAndTheOthersAreToldWho) {
  const std::string path = namm::testing::TempPath("progress_log_lock");
  std::filesystem::remove(path);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  {
    auto first = ProgressLog::Open(path);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    ProgressEntries a;
    a.leases_issued = {Lease(3, {1})};
    ASSERT_TRUE((*first)->Append(a).ok());
    auto second = ProgressLog::Open(path);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), Status::Code::kFailedPrecondition);
    EXPECT_NE(second.status().message().find("another coordinator serves this run (pid " +
                                             std::to_string(::getpid()) + " on " + host + " since 20"),
              std::string::npos)
        << second.status().ToString();
    ASSERT_TRUE((*first)->Append(a).ok()) << "the holder's log is untouched";
  }
  auto again = ProgressLog::Open(path);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->recovered().leases_issued.size(), 1u);
}

// A log an older build wrote (version 1: no holder in its header) is read, and rewritten as version 2.
TEST(ProgressLog, ReadsAnOlderBuildsLog) {
  const std::string path = namm::testing::TempPath("progress_log_v1");
  std::filesystem::remove(path);
  {
    auto log = ProgressLog::Open(path);
    ASSERT_TRUE(log.ok());
    ProgressEntries e;
    e.evaluations = {Result(4, false)};
    ASSERT_TRUE((*log)->Append(e).ok());
  }
  // The same records behind a version 1 header.
  const std::string v2 = *read_file(path);
  std::string v1 = v2.substr(0, 8);
  const uint32_t one = 1;
  v1.append(reinterpret_cast<const char*>(&one), sizeof one);
  v1 += v2.substr(8 + 4 + 128);
  ASSERT_TRUE(write_file_atomically(path, {v1}).ok());
  auto log = ProgressLog::Open(path);
  ASSERT_TRUE(log.ok()) << log.status().ToString();
  ASSERT_EQ((*log)->recovered().evaluations.size(), 1u);
  EXPECT_EQ((*log)->recovered().evaluations[0].prompt, 4);
  ASSERT_TRUE((*log)->Reset().ok());
  EXPECT_EQ(read_file(path)->size(), 8u + 4 + 128) << "version 2, holder, no records";
}

}  // namespace
}  // namespace namm::coordinator

namespace namm::coordinator {
namespace {

// An append the disk cannot take whole (the write stops part-way: a file size limit, FileSizeLimit, where this
// test once mounted a 256 KB tmpfs as root) leaves no torn record behind: appends that succeed once there is room
// again are read back after a restart.
TEST(ProgressLog, AFailedAppendLeavesNoTornRecordBeforeLaterOnes) {
  const std::string path = namm::testing::TempPath("progress_log_full.progress");
  std::filesystem::remove(path);
  int64_t acknowledged = 0;
  {
    auto log = ProgressLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status().ToString();
    ProgressEntries e;
    for (int64_t p = 0; p < 20; ++p) e.evaluations.push_back(Result(p, true));
    Status failed;
    {
      namm::testing::FileSizeLimit full(64 << 10);
      while (failed.ok()) {
        failed = (*log)->Append(e);
        if (failed.ok()) acknowledged += 20;
      }
    }
    EXPECT_NE(failed.message().find("File too large"), std::string::npos) << failed.ToString();
    EXPECT_GT(acknowledged, 0);
    EXPECT_LE(std::filesystem::file_size(path), uintmax_t{64} << 10) << "the torn record was cut";
    ASSERT_TRUE((*log)->Append(e).ok());
    acknowledged += 20;
  }
  auto reopened = ProgressLog::Open(path);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_EQ((*reopened)->ignored_bytes(), 0) << "no torn record";
  EXPECT_EQ(static_cast<int64_t>((*reopened)->recovered().evaluations.size()), acknowledged);
}

// A Reset() that empties the log and then cannot write its header leaves the log empty; the next append that can
// writes the header first, so that a restart reads it (it found no header and refused the file as not a log).
TEST(ProgressLog, AnAppendAfterAFailedResetWritesTheHeaderFirst) {
  const std::string path = namm::testing::TempPath("progress_log_reset.progress");
  std::filesystem::remove(path);
  ProgressEntries e;
  for (int64_t p = 0; p < 3; ++p) e.evaluations.push_back(Result(p, true));
  {
    auto log = ProgressLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status().ToString();
    ASSERT_TRUE((*log)->Append(e).ok());
    {
      namm::testing::FileSizeLimit full(16);  // not even the header fits
      EXPECT_FALSE((*log)->Reset().ok());
    }
    ASSERT_TRUE((*log)->Append(e).ok());
  }
  auto reopened = ProgressLog::Open(path);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_EQ((*reopened)->ignored_bytes(), 0);
  EXPECT_EQ((*reopened)->recovered().evaluations.size(), 3u) << "the records after the reset only";
}

}  // namespace
}  // namespace namm::coordinator
