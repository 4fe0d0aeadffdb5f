// Kills a real process (SIGKILL) while it is inside a generation's commit transaction, and at random instants,
// and checks that the database reopens consistent — the old generation or the new one, never a mix — and that
// the resumed run ends exactly where an uninterrupted one does.
#include <SQLiteCpp/SQLiteCpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <thread>

#include "../process_util.h"
#include "../temp_path.h"
#include "synthetic_run.h"

namespace namm::coordinator {
namespace {

using namm::testing::FreshDatabasePath;

using namm::testing::Child;
using namm::testing::KillAndReap;
using namm::testing::ReadLine;
using namm::testing::Spawn;
using namm::testing::Wait;

// The state an uninterrupted run ends in.
CmaesState UninterruptedFinalState(bool long_run, const CmaesParams** params_out) {
  static std::unique_ptr<Store> stores[2];
  static std::unique_ptr<Trainer> trainers[2];
  std::unique_ptr<Store>& store = stores[long_run];
  std::unique_ptr<Trainer>& trainer = trainers[long_run];
  if (!trainer) {
    store = Store::Open(FreshDatabasePath(long_run ? "crash_reference_long.db" : "crash_reference.db"), OpenMode::kCreate).value();
    const RunSpec spec =
        parse_run_spec(long_run ? testing::SyntheticSpecYaml("synthetic", 40, 30, testing::kFrequentDecompositions) : testing::SyntheticSpecYaml(), "spec")
            .value();
    EXPECT_TRUE(store->ImportReferenceScores("synthetic-model", testing::SyntheticReference(spec.architecture.param_count()),
                                             "test", false).ok());
    trainer = Trainer::Create(*store, spec, testing::SyntheticTaskRows()).value();
    EXPECT_TRUE(testing::DriveRun(*trainer).ok());
  }
  *params_out = &trainer->params();
  return store->GetCheckpoint(1, "latest", 0, trainer->params()).value().state;
}

// Structural consistency of a run after a crash: every generation before the run's counter is complete, nothing
// after it exists, and the latest checkpoint starts exactly the run's next generation.
void ExpectConsistent(const std::string& db, const CmaesParams& params) {
  // Killed before it made the database (a loaded machine's sanitizer build can start that slowly): nothing to
  // check, and the next attempt creates it.
  if (!std::filesystem::exists(db)) return;
  {
    SQLite::Database raw(db, SQLite::OPEN_READONLY);
    EXPECT_EQ(raw.execAndGet("PRAGMA integrity_check").getString(), "ok");
    SQLite::Statement fk(raw, "PRAGMA foreign_key_check");
    EXPECT_FALSE(fk.executeStep()) << "a foreign key is broken";
  }
  auto store = Store::Open(db, OpenMode::kExisting).value();
  const std::vector<RunRecord> runs = store->ListRuns().value();
  if (runs.empty()) return;  // killed before the run was created (on a loaded machine the first kill can be that early)
  const RunRecord& run = runs.front();
  const auto generations = store->GetGenerations(1).value();
  ASSERT_EQ(static_cast<int64_t>(generations.size()), run.generation);
  for (const GenerationRecord& g : generations) EXPECT_EQ(store->GetCandidates(1, g.generation)->size(), 8u);
  EXPECT_TRUE(store->GetCandidates(1, run.generation)->empty());
  EXPECT_TRUE(store->GetMetrics(1, run.generation)->empty());
  auto latest = store->GetCheckpoint(1, "latest", 0, params);
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  EXPECT_EQ(latest->generation, run.generation);
}

TEST(StoreCrash, KilledInsideTheCommitTransactionReopensAtTheOldGeneration) {
  const CmaesParams* params = nullptr;
  const CmaesState expected = UninterruptedFinalState(false, &params);
  const std::string db = FreshDatabasePath("crash_commit.db");

  Child child = Spawn({STORE_CRASH_HELPER, db, "--pause-in-commit", "2"});
  ASSERT_EQ(ReadLine(child.out), "IN_COMMIT 2");
  KillAndReap(child);  // generation 2's rows are written but not committed

  ExpectConsistent(db, *params);
  {
    auto store = Store::Open(db, OpenMode::kExisting).value();
    EXPECT_EQ(store->GetRun(1)->generation, 2);  // the old generation, whole
    EXPECT_EQ(store->GetGenerations(1)->size(), 2u);
    // The results recorded before the commit survive (each recording was its own transaction).
    EXPECT_EQ(store->GetEvaluations(1, 2)->size(), 8u * 4u + 6u);
  }
  Child resume = Spawn({STORE_CRASH_HELPER, db});
  EXPECT_EQ(ReadLine(resume.out), "FINISHED");
  EXPECT_EQ(Wait(resume), 0);
  auto store = Store::Open(db, OpenMode::kExisting).value();
  EXPECT_TRUE(store->GetCheckpoint(1, "latest", 0, *params)->state == expected);
}

TEST(StoreCrash, KilledAtRandomInstantsStillEndsLikeAnUninterruptedRun) {
  const CmaesParams* params = nullptr;
  const CmaesState expected = UninterruptedFinalState(true, &params);
  const std::string db = FreshDatabasePath("crash_random.db");
  std::mt19937 rng(2024);
  int kills = 0;
  for (int attempt = 0; attempt < 12; ++attempt) {
    Child child = Spawn({STORE_CRASH_HELPER, db, "--long"});
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(20, 250)(rng)));
    if (::waitpid(child.pid, nullptr, WNOHANG) != 0) {
      ::close(child.out);
      break;  // it finished before the kill
    }
    KillAndReap(child);
    ++kills;
    ExpectConsistent(db, *params);
  }
  std::printf("killed the run %d times at random instants\n", kills);
  Child last = Spawn({STORE_CRASH_HELPER, db, "--long"});
  EXPECT_EQ(ReadLine(last.out), "FINISHED");
  EXPECT_EQ(Wait(last), 0);
  auto store = Store::Open(db, OpenMode::kExisting).value();
  EXPECT_TRUE(store->GetCheckpoint(1, "latest", 0, *params)->state == expected);
  EXPECT_GE(kills, 3);
}

}  // namespace
}  // namespace namm::coordinator
