#include "namm/coordinator/progress_log.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

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
