#include "namm/coordinator/store.h"

#include <SQLiteCpp/SQLiteCpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "../file_size_limit.h"
#include "../temp_path.h"
#include "byte_codec.h"
#include "namm/coordinator/checkpoint_codec.h"
#include "namm/file_util.h"

namespace namm::coordinator {
namespace {

using namm::testing::TempPath;

using namm::testing::FreshDatabasePath;

std::string Bytes(const std::string& path) { return *read_file(path); }

CmaesParams SmallParams(Covariance covariance = Covariance::kFull) {
  CmaesOptions o;
  o.population = 6;
  o.covariance = covariance;
  return *make_cmaes_params(9, o);
}

// A state after a few generations, so that every field holds something non-trivial.
CmaesState EvolvedState(const CmaesParams& p) {
  CmaesState s = *initial_cmaes_state(p, std::vector<double>(static_cast<std::size_t>(p.dimension), 0.25));
  for (int g = 0; g < 5; ++g) {
    const Population pop = ask(p, s, static_cast<uint64_t>(g));
    std::vector<double> fit;
    for (int64_t k = 0; k < pop.size; ++k) fit.push_back(-pop.candidate(k)[0] * pop.candidate(k)[1] - k);
    EXPECT_TRUE(tell(p, s, pop, fit).ok());
  }
  return s;
}

NewRun OneStageRun(const CmaesState& state) {
  NewRun run;
  run.name = "r";
  run.spec_yaml = "name: r";
  run.model_fingerprint = "m";
  StageRecord stage;
  stage.tasks = {"t/a"};
  stage.generations = 3;
  run.stages = {stage};
  run.initial_state = &state;
  return run;
}

TEST(CheckpointCodec, RoundTripsFullAndDiagonalStatesBitForBit) {
  for (Covariance cov : {Covariance::kFull, Covariance::kDiagonal}) {
    const CmaesParams p = SmallParams(cov);
    const CmaesState s = EvolvedState(p);
    auto back = decode_cmaes_state(encode_cmaes_state(s), p, "state");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    auto eigen = decode_eigensystem(encode_eigensystem(s.eigen), p, "eigen");
    ASSERT_TRUE(eigen.ok()) << eigen.status().ToString();
    back->eigen = *eigen;
    EXPECT_TRUE(*back == s);
  }
}

TEST(CheckpointCodec, RefusesDamagedForeignAndMismatchedRecords) {
  const CmaesParams p = SmallParams();
  std::string record = encode_cmaes_state(EvolvedState(p));
  std::string flipped = record;
  flipped[40] = static_cast<char>(flipped[40] ^ 1);
  auto bad = decode_cmaes_state(flipped, p, "checkpoint 3");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Status::Code::kCorruption);
  EXPECT_NE(bad.status().message().find("checkpoint 3 is corrupt: its CRC-32"), std::string::npos)
      << bad.status().message();
  EXPECT_FALSE(decode_cmaes_state(record.substr(0, record.size() - 9), p, "x").ok());
  EXPECT_FALSE(decode_cmaes_state(encode_norm_stats(NormStats{}), p, "x").ok());  // another record kind
  auto wrong_dim = decode_cmaes_state(record, SmallParams(Covariance::kDiagonal), "x");
  ASSERT_FALSE(wrong_dim.ok());
  EXPECT_NE(wrong_dim.status().message().find("full-covariance state of dimension 9"), std::string::npos);
}

TEST(Store, MigratesAnOlderSchemaForwardKeepingItsData) {
  const std::string path = FreshDatabasePath("old.db");
  const CmaesParams p = SmallParams();
  const CmaesState s = EvolvedState(p);
  {
    StoreOptions v1;
    v1.target_schema_version = 1;
    auto store = Store::Open(path, OpenMode::kCreate, v1);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    EXPECT_EQ((*store)->schema_version(), 1);
  }
  {
    // A run as builds of schema 1 wrote it: a complete latest checkpoint (covariance included) sampling with a
    // stored eigensystem.
    SQLite::Database db(path, SQLite::OPEN_READWRITE);
    db.exec("INSERT INTO runs(id, name, created_at, spec_yaml, dimension, model_fingerprint, status, stage, "
            "generation) VALUES(1, 'r', '2026-01-01T00:00:00Z', 'name: r', 9, 'm', 'running', 0, 0)");
    db.exec("INSERT INTO stages(run_id, stage, tasks, generations) VALUES(1, 0, '[\"t/a\"]', 3)");
    const std::string eigen = encode_eigensystem(s.eigen), state = encode_cmaes_state(s);
    SQLite::Statement d(db, "INSERT INTO decompositions(id, run_id, cmaes_generation, record) VALUES(1, 1, ?, ?)");
    d.bind(1, s.eigen.generation);
    d.bindNoCopy(2, eigen.data(), static_cast<int>(eigen.size()));
    d.exec();
    SQLite::Statement c(db, "INSERT INTO checkpoints(run_id, role, stage, generation, state, checksum, "
                            "decomposition_id, created_at) VALUES(1, 'latest', 0, 0, ?, ?, 1, 'now')");
    c.bindNoCopy(1, state.data(), static_cast<int>(state.size()));
    c.bind(2, static_cast<int64_t>(record_checksum(state)));
    c.exec();
  }
  auto ro = Store::Open(path, OpenMode::kReadOnly);
  ASSERT_FALSE(ro.ok());
  EXPECT_NE(ro.status().message().find("open it once with a writing command"), std::string::npos);

  auto store = Store::Open(path, OpenMode::kExisting);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->schema_version(), kStoreSchemaVersion);
  auto run = (*store)->GetRun(1);
  ASSERT_TRUE(run.ok());
  EXPECT_EQ(run->name, "r");
  EXPECT_EQ(run->optimizer_revision, 1) << "an older build's run keeps its arithmetic";
  auto latest = (*store)->GetCheckpoint(1, "latest", 0, p);
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  EXPECT_TRUE(latest->state == s);
  EXPECT_TRUE((*store)->GetMetrics(1, 0).ok());  // the table migration 2 added
  EXPECT_TRUE((*store)->ListSnapshots(1)->empty());  // and migration 3
}

TEST(Store, RefusesNewerForeignAndNonDatabasesWithoutTouchingThem) {
  const std::string newer = FreshDatabasePath("newer.db");
  {
    auto store = Store::Open(newer, OpenMode::kCreate);
    ASSERT_TRUE(store.ok());
  }
  {
    SQLite::Database db(newer, SQLite::OPEN_READWRITE);
    db.exec("PRAGMA journal_mode = DELETE");
    db.exec("PRAGMA user_version = 99");
  }
  const std::string newer_bytes = Bytes(newer);
  auto s1 = Store::Open(newer, OpenMode::kExisting);
  ASSERT_FALSE(s1.ok());
  EXPECT_NE(s1.status().message().find("schema version 99, newer than this build's"), std::string::npos)
      << s1.status().message();
  EXPECT_EQ(Bytes(newer), newer_bytes);
  EXPECT_FALSE(std::filesystem::exists(newer + "-wal"));

  const std::string foreign = FreshDatabasePath("foreign.db");
  {
    SQLite::Database db(foreign, SQLite::OPEN_READWRITE | SQLite::OPEN_CREATE);
    db.exec("CREATE TABLE accounts(id INTEGER PRIMARY KEY, balance REAL)");
    db.exec("INSERT INTO accounts VALUES(1, 100.0)");
  }
  const std::string foreign_bytes = Bytes(foreign);
  auto s2 = Store::Open(foreign, OpenMode::kCreate);
  ASSERT_FALSE(s2.ok());
  EXPECT_NE(s2.status().message().find("belongs to another application"), std::string::npos) << s2.status().message();
  EXPECT_EQ(Bytes(foreign), foreign_bytes);

  const std::string junk = FreshDatabasePath("junk.db");
  {
    std::ofstream out(junk, std::ios::binary);
    out << "this is a text file, not a database, and it is long enough to have a header page........";
  }
  const std::string junk_bytes = Bytes(junk);
  auto s3 = Store::Open(junk, OpenMode::kCreate);
  ASSERT_FALSE(s3.ok());
  EXPECT_NE(s3.status().message().find("is not a readable SQLite database"), std::string::npos)
      << s3.status().message();
  EXPECT_EQ(Bytes(junk), junk_bytes);

  auto missing = Store::Open(FreshDatabasePath("missing.db"), OpenMode::kReadOnly);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Status::Code::kNotFound);
}

TEST(Store, EvaluationsAreIdempotentPerUnitAndValidated) {
  auto store = Store::Open(FreshDatabasePath("evals.db"), OpenMode::kCreate).value();
  const CmaesParams p = SmallParams();
  const CmaesState s = EvolvedState(p);
  const int64_t run = *store->CreateRun(OneStageRun(s));
  EvaluationRecord e;
  e.candidate = 2;
  e.task = "t/a";
  e.prompt = 5;
  e.score = 0.25;
  e.worker = "w1";
  EXPECT_EQ(*store->RecordEvaluations(run, {e}), 1);
  EvaluationRecord late = e;
  late.score = 0.75;
  late.worker = "w2";
  EXPECT_EQ(*store->RecordEvaluations(run, {late}), 0);
  auto stored = store->GetEvaluations(run, 0);
  ASSERT_EQ(stored->size(), 1u);
  EXPECT_EQ((*stored)[0].score, 0.25);
  EXPECT_EQ((*stored)[0].worker, "w1");

  EvaluationRecord bad = e;
  bad.prompt = 6;
  bad.score = 1.5;
  auto refused = store->RecordEvaluations(run, {bad});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("score outside [0, 1]"), std::string::npos);
  bad.score = 0.5;
  bad.cache_size_mean = std::nan("");
  EXPECT_FALSE(store->RecordEvaluations(run, {bad}).ok());
  EXPECT_EQ(store->GetEvaluations(run, 0)->size(), 1u);

  // The tokens workers reported per prompt (the largest), what later leases are balanced by.
  EvaluationRecord other = e;
  other.candidate = 3;
  other.prompt_tokens = 900;
  other.generated_tokens = 20;
  EvaluationRecord first = e;
  first.candidate = 4;
  first.prompt_tokens = 800;
  ASSERT_TRUE(store->RecordEvaluations(run, {other, first}).ok());
  const auto tokens = store->GetPromptTokens(run).value();
  ASSERT_EQ(tokens.size(), 1u);
  EXPECT_EQ(tokens.at({"t/a", 5}), 920);
}

// A commit's snapshot retention spares a snapshot another connection is writing, even when it completed after the
// trainer last listed the snapshots (it would be the pending decomposition's source: deleting it left a run that
// could not be resumed, "snapshot 7 of run 1 does not exist", found by the kill storm).
TEST(Store, RetentionSparesTheSnapshotBeingWrittenElsewhere) {
  const std::string path = FreshDatabasePath("retention.db");
  auto store = Store::Open(path, OpenMode::kCreate).value();
  const CmaesParams p = SmallParams();
  const CmaesState s = EvolvedState(p);
  const int64_t run = *store->CreateRun(OneStageRun(s));
  const int64_t first = store->ListSnapshots(run)->front().id;
  NewSnapshot elsewhere;
  elsewhere.stage = 0;
  elsewhere.generation = 1;
  elsewhere.eigen_from_self = true;
  elsewhere.state = &s;
  const int64_t written = *store->AddSnapshotConcurrently(run, elsewhere);  // complete before the commit
  GenerationCommit c;
  c.run_id = run;
  c.generation.generation = 0;
  c.generation.stage = 0;
  c.generation.mean = s.mean;
  c.generation.best_params = s.mean;
  c.next_state = &s;
  c.keep_snapshots = std::vector<int64_t>{first};  // what the trainer knew it needed
  c.snapshot_in_flight = std::make_pair(int64_t{0}, int64_t{1});
  auto outcome = store->CommitGeneration(c);
  ASSERT_TRUE(outcome.ok());
  EXPECT_TRUE(outcome->unneeded_snapshots.empty());
  const auto ids = [&] {
    const std::vector<SnapshotRecord> listed = store->ListSnapshots(run).value();
    std::set<int64_t> out;
    for (const SnapshotRecord& r : listed) out.insert(r.id);
    return out;
  };
  EXPECT_EQ(ids(), (std::set<int64_t>{first, written}));
  // Without the in-flight mark it would have gone, as an unneeded snapshot does.
  c.generation.generation = 1;
  c.snapshot_in_flight.reset();
  outcome = store->CommitGeneration(c);
  ASSERT_TRUE(outcome.ok());
  EXPECT_EQ(outcome->unneeded_snapshots, std::vector<int64_t>{written});
  EXPECT_EQ(ids(), (std::set<int64_t>{first, written})) << "the commit only names it";
  ASSERT_TRUE(store->DropSnapshotsConcurrently(run, outcome->unneeded_snapshots).ok());
  EXPECT_EQ(ids(), (std::set<int64_t>{first}));
}

EvaluationRecord Evaluation(int64_t prompt) {
  EvaluationRecord e;
  e.candidate = 0;
  e.task = "t/a";
  e.prompt = prompt;
  e.score = 0.5;
  e.worker = "w";
  return e;
}

// The database's write lock held by another process for longer than SQLite's busy handler waits (1 s) is waited
// out: the call is tried again until it goes through, and the wait is reported once, when it ends.
TEST(Store, ATransientLockIsWaitedOutAndReported) {
  const std::string path = FreshDatabasePath("transient.db");
  std::vector<StoreWait> waits;
  std::mutex mu;
  StoreOptions options;
  options.on_wait = [&](const StoreWait& w) {
    std::lock_guard<std::mutex> lock(mu);
    waits.push_back(w);
  };
  auto store = Store::Open(path, OpenMode::kCreate, options).value();
  const CmaesParams p = SmallParams();
  const int64_t run = *store->CreateRun(OneStageRun(EvolvedState(p)));
  SQLite::Database other(path, SQLite::OPEN_READWRITE);
  other.exec("BEGIN IMMEDIATE");
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    other.exec("COMMIT");
  });
  const auto recorded = store->RecordEvaluations(run, {Evaluation(3)});
  release.join();
  ASSERT_TRUE(recorded.ok()) << recorded.status().ToString();
  EXPECT_EQ(*recorded, 1);
  ASSERT_FALSE(waits.empty());
  const StoreWait& end = waits.back();
  EXPECT_TRUE(end.ended);
  EXPECT_EQ(end.what, "recording evaluations");
  EXPECT_NE(end.error.find("(SQLITE_BUSY)"), std::string::npos) << end.error;
  EXPECT_GT(end.seconds, 1.0);
  EXPECT_LT(end.seconds, 3.0);
  EXPECT_EQ(static_cast<int64_t>(waits.size()), end.retries + 1) << "one report per retry, one at the end";
  EXPECT_EQ(store->GetEvaluations(run, 0)->size(), 1u);
  // A second run of the same name is refused (runs are found by name).
  EXPECT_NE(store->CreateRun(OneStageRun(EvolvedState(p))).status().message().find("already holds a run named 'r'"),
            std::string::npos);
}

// A full disk fails a call at once by default (StoreOptions::io_error_patience 0), naming SQLite's code, and what
// was stored stays. (A file size limit, FileSizeLimit, where this test once mounted a 1 MB tmpfs as root: SQLite
// names its EFBIG SQLITE_IOERR where a full disk's ENOSPC is SQLITE_FULL; both are retried alike.)
TEST(Store, AFullDiskIsNamedAndLeavesTheStoredRunWhole) {
  const std::string path = FreshDatabasePath("store_full_disk.db");
  const CmaesParams p = SmallParams();
  Status full;
  int64_t stored = 0;
  {
    auto store = Store::Open(path, OpenMode::kCreate).value();
    const int64_t run = *store->CreateRun(OneStageRun(EvolvedState(p)));
    namm::testing::FileSizeLimit limit(1 << 20);
    for (int64_t batch = 0; batch < 1000 && full.ok(); ++batch) {
      std::vector<EvaluationRecord> records;
      for (int64_t i = 0; i < 100; ++i) {
        records.push_back(Evaluation(batch * 100 + i));
        records.back().worker = std::string(200, 'w');
      }
      const auto r = store->RecordEvaluations(run, records);
      if (r.ok()) stored += *r;
      full = r.status();
    }
  }
  ASSERT_FALSE(full.ok()) << "1 MB never filled up";
  EXPECT_EQ(full.code(), Status::Code::kIOError);
  EXPECT_NE(full.message().find("recording evaluations failed on " + path + ": "), std::string::npos)
      << full.ToString();
  EXPECT_NE(full.message().find("(SQLITE_IOERR)"), std::string::npos) << full.ToString();
  EXPECT_EQ(full.message().find("of retries"), std::string::npos) << "no patience: no retries";
  auto reopened = Store::Open(path, OpenMode::kReadOnly);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_EQ(static_cast<int64_t>((*reopened)->GetEvaluations(1, 0)->size()), stored);
}

// With io_error_patience, a full disk that is freed meanwhile is waited out: the call goes through once there is
// room, each failed attempt reported to on_wait with SQLite's error; one that stays full fails after the patience,
// saying how long it retried.
TEST(Store, AFullDiskIsWaitedOutForItsPatience) {
  const std::string path = FreshDatabasePath("store_patience.db");
  const CmaesParams p = SmallParams();
  std::vector<StoreWait> waits;
  StoreOptions options;
  options.io_error_patience = std::chrono::seconds(2);
  options.backoff_initial = std::chrono::milliseconds(5);
  options.backoff_max = std::chrono::milliseconds(50);
  options.on_wait = [&](const StoreWait& w) { waits.push_back(w); };
  auto store = Store::Open(path, OpenMode::kCreate, options).value();
  const int64_t run = *store->CreateRun(OneStageRun(EvolvedState(p)));
  const auto batch = [](int64_t first) {
    std::vector<EvaluationRecord> records;
    for (int64_t i = 0; i < 50; ++i) {
      records.push_back(Evaluation(first + i));
      records.back().worker = std::string(2000, 'w');
    }
    return records;
  };
  const uintmax_t size = std::filesystem::file_size(path) + std::filesystem::file_size(path + "-wal");
  {
    namm::testing::FileSizeLimit limit(size);  // no room for another batch
    std::thread freed([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      limit.Lift();
    });
    const auto r = store->RecordEvaluations(run, batch(0));
    freed.join();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(*r, 50);
  }
  ASSERT_GE(waits.size(), 2u);
  EXPECT_NE(waits.front().error.find("(SQLITE_IOERR)"), std::string::npos) << waits.front().error;
  EXPECT_TRUE(waits.back().ended && waits.back().succeeded);
  EXPECT_GE(waits.back().seconds, 0.2);

  namm::testing::FileSizeLimit limit(std::filesystem::file_size(path) + std::filesystem::file_size(path + "-wal"));
  const auto start = std::chrono::steady_clock::now();
  const auto stays_full = store->RecordEvaluations(run, batch(1000));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(stays_full.ok());
  EXPECT_NE(stays_full.status().message().find("(SQLITE_IOERR) (after 2 s of retries)"), std::string::npos)
      << stays_full.status().ToString();
  EXPECT_GE(took, 2.0);
  EXPECT_LT(took, 10.0);
}

// A snapshot row whose stored length is corrupt is refused before the length sizes anything (it was passed to
// reserve() first: a huge value threw out of the store).
TEST(Store, ASnapshotWithACorruptLengthIsRefused) {
  const std::string path = FreshDatabasePath("corrupt_length.db");
  const CmaesParams p = SmallParams();
  int64_t run = 0, id = 0;
  {
    auto store = Store::Open(path, OpenMode::kCreate).value();
    run = *store->CreateRun(OneStageRun(EvolvedState(p)));
    id = store->ListSnapshots(run)->front().id;
  }
  {
    SQLite::Database raw(path, SQLite::OPEN_READWRITE);
    raw.exec("UPDATE snapshots SET bytes = 4000000000000000 WHERE id = " + std::to_string(id));
  }
  auto store = Store::Open(path, OpenMode::kExisting).value();
  const auto snapshot = store->GetSnapshot(run, id, p);
  ASSERT_FALSE(snapshot.ok());
  EXPECT_EQ(snapshot.status().code(), Status::Code::kCorruption);
  EXPECT_NE(snapshot.status().message().find("says it holds 4000000000000000 bytes but its parts hold"),
            std::string::npos)
      << snapshot.status().ToString();
}

TEST(Store, ReferenceImportRefusesConflictsAsAWhole) {
  auto store = Store::Open(FreshDatabasePath("refs.db"), OpenMode::kCreate).value();
  tasks::ReferenceScores a;
  ASSERT_TRUE(a.Set("lb/x", 0, 0.5).ok());
  ASSERT_TRUE(a.Set("lb/x", 1, 0.25).ok());
  auto first = store->ImportReferenceScores("m", a, "a.json", false);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->added, 2);

  tasks::ReferenceScores b;
  ASSERT_TRUE(b.Set("lb/x", 1, 0.25).ok());
  ASSERT_TRUE(b.Set("lb/x", 2, 1.0).ok());
  ASSERT_TRUE(b.Set("lb/y", 0, 0.0).ok());
  ASSERT_TRUE(b.Set("lb/x", 0, 0.75).ok());  // differs from the stored 0.5
  auto conflict = store->ImportReferenceScores("m", b, "b.json", false);
  ASSERT_FALSE(conflict.ok());
  EXPECT_NE(conflict.status().message().find("lb/x prompt 0"), std::string::npos) << conflict.status().message();
  EXPECT_EQ(store->GetReferenceScores("m")->scores().at("lb/x").size(), 2u);  // nothing of b was imported

  auto replaced = store->ImportReferenceScores("m", b, "b.json", true);
  ASSERT_TRUE(replaced.ok());
  EXPECT_EQ(replaced->added, 2);
  EXPECT_EQ(replaced->unchanged, 1);
  EXPECT_EQ(replaced->replaced, 1);
  EXPECT_EQ(*store->GetReferenceScores("m")->Get("lb/x", 0), 0.75);
  EXPECT_TRUE(store->GetReferenceScores("other")->scores().empty());
}

TEST(Store, ImportsTheReferencesPerPromptFile) {
  const std::string file = std::string(NAMM_SHARED_DIR) + "/data/reference_scores/llama3-8b-32k-x2NTK2alpha-v2.per_request.json";
  if (!std::filesystem::exists(file)) GTEST_SKIP() << "needs ../shared/data/reference_scores (absent: " << file << ")";
  auto scores = tasks::ReferenceScores::Load(file);
  ASSERT_TRUE(scores.ok()) << scores.status().ToString();
  auto store = Store::Open(FreshDatabasePath("refs_file.db"), OpenMode::kCreate).value();
  auto summary = store->ImportReferenceScores("llama3-8b-32k-x2NTK2alpha-v2", *scores, file, false);
  ASSERT_TRUE(summary.ok()) << summary.status().ToString();
  EXPECT_EQ(summary->added, 4750);  // 21 tasks: 200 prompts, multifieldqa_en 150, lcc and repobench-p 500
  auto back = store->GetReferenceScores("llama3-8b-32k-x2NTK2alpha-v2");
  EXPECT_EQ(back->scores(), scores->scores());
  double sum = 0;
  for (const auto& [row, score] : back->scores().at("lb/passage_retrieval_en")) sum += score;
  EXPECT_NEAR(100 * sum / 200, 12.175, 1e-9);  // the aggregate file's value (spec §7.2)
}

}  // namespace
}  // namespace namm::coordinator
