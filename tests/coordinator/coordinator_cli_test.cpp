// namm-coordinator's status, export and import-reference as real processes, on a database a real training run
// (the crash tests' helper, run to completion) wrote.
#include <SQLiteCpp/SQLiteCpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "../chromium.h"
#include "../process_util.h"
#include "../temp_path.h"
#include "namm/file_util.h"
#include "namm/coordinator/reference_checkpoint.h"
#include "namm/namm_file.h"

namespace namm::coordinator {
namespace {

using namm::testing::RunProcess;
using nlohmann::json;

const std::string kCoordinator = NAMM_COORDINATOR_PATH;

class CoordinatorCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    db_ = new std::string(namm::testing::FreshDatabasePath("cli.db"));
    const auto r = RunProcess(std::string(STORE_CRASH_HELPER) + " " + *db_);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() { delete db_; }
  static std::string* db_;
};
std::string* CoordinatorCli::db_ = nullptr;

TEST_F(CoordinatorCli, StatusReportsStageGenerationFitnessAndCheckpoints) {
  const auto text = RunProcess(kCoordinator + " status --db " + *db_);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("run 1 'synthetic' (finished)"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("stage 2 of 2 [t/a, t/b], 5 of 5 generations done"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("checkpoint stage_best stage 0, starts generation 2"), std::string::npos) << text.output;

  const auto j = RunProcess(kCoordinator + " status --json --db " + *db_);
  ASSERT_EQ(j.exit_code, 0) << j.output;
  const json runs = json::parse(j.output);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0]["generations_done"], 5);
  EXPECT_EQ(runs[0]["last_generation"]["generation"], 4);
  EXPECT_TRUE(runs[0]["norm_stats_frozen"].get<bool>());
  std::set<uint32_t> checksums;
  for (const json& c : runs[0]["checkpoints"]) checksums.insert(c["checksum"].get<uint32_t>());
  EXPECT_EQ(checksums.size(), 3u) << "three different states carry three different checksums";
}

TEST_F(CoordinatorCli, ReportWritesCurvesThatChromiumRenders) {
  const std::string out = namm::testing::TempPath("report");
  std::filesystem::remove_all(out);
  const auto r = RunProcess(kCoordinator + " report --db " + *db_ + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // One CSV row per generation, with the stage each belongs to and the evaluations of the mean where they ran.
  const std::string generations = namm::testing::ReadText(out + "/generations.csv");
  EXPECT_EQ(std::count(generations.begin(), generations.end(), '\n'), 1 + 5) << generations;
  EXPECT_NE(generations.find("\n4,1,"), std::string::npos) << "generation 4 belongs to stage 1";
  const std::string stages = namm::testing::ReadText(out + "/stages.csv");
  EXPECT_NE(stages.find("\n1,t/a t/b,"), std::string::npos) << stages;
  EXPECT_NE(namm::testing::ReadText(out + "/eval_tasks.csv").find(",t/b,"), std::string::npos);
  const std::string html = namm::testing::ReadText(out + "/report.html");
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg")) << "no network resources";
  EXPECT_EQ(html.find("https://"), std::string::npos);
  EXPECT_NE(html.find("stage 2"), std::string::npos) << "the stage boundary is marked";
  EXPECT_NE(html.find("Fitness is the score normalized by the base model's on the same prompts, averaged over tasks."),
            std::string::npos) << "the spec's fitness rule (no cache_weight, no mean_rank)";

  if (!namm::testing::ChromiumInstalled()) GTEST_SKIP() << "chromium is not installed (scripts/install-deps.sh)";
  // Fitness (3 series), per-task score, sigma, cache, throughput and workers: at least 6 curves.
  namm::testing::ExpectRenderedWithCurves(namm::testing::RenderedDom(out + "/report.html"), 6);
}

// report --explain: a page of what a NAMM keeps (namm-worker's) shown in the report, beside it as explain.html.
TEST_F(CoordinatorCli, ReportShowsAnExplainPageAndRefusesAnyOtherPage) {
  const std::string out = namm::testing::TempPath("report_explain");
  std::filesystem::remove_all(out);
  const std::string page = namm::testing::TempPath("explain_in.html"), other = namm::testing::TempPath("other.html");
  const std::string explain = "<!DOCTYPE html><title>What namm kept</title><div id=\"tokens\"><span class=\"t\">Once</span></div>";
  namm::testing::WriteText(page, explain);
  namm::testing::WriteText(other, "<!DOCTYPE html><p>not an explain page</p>");
  const auto r = RunProcess(kCoordinator + " report --db " + *db_ + " --out " + out + " --explain " + page);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(namm::testing::ReadText(out + "/explain.html"), explain);
  const std::string html = namm::testing::ReadText(out + "/report.html");
  EXPECT_NE(html.find("What the best NAMM keeps"), std::string::npos);
  EXPECT_NE(html.find("<iframe src=\"explain.html\""), std::string::npos);
  const auto refused = RunProcess(kCoordinator + " report --db " + *db_ + " --out " + out + "_2 --explain " + other);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("is not a page of namm-worker"), std::string::npos) << refused.output;
  const std::string plain = namm::testing::TempPath("report_plain");
  std::filesystem::remove_all(plain);
  ASSERT_EQ(RunProcess(kCoordinator + " report --db " + *db_ + " --out " + plain).exit_code, 0);
  EXPECT_EQ(namm::testing::ReadText(plain + "/report.html").find("What the best NAMM keeps"), std::string::npos);
}

TEST_F(CoordinatorCli, ReportRefusesWhatIsNotARun) {
  const std::string empty = namm::testing::FreshDatabasePath("not-a-db.db");
  namm::testing::WriteText(empty, "not sqlite");
  const auto r = RunProcess(kCoordinator + " report --db " + empty + " --out " + namm::testing::TempPath("r2"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("not-a-db.db"), std::string::npos) << r.output;
  EXPECT_EQ(namm::testing::ReadText(empty), "not sqlite") << "the file is left as it was";
}

TEST_F(CoordinatorCli, ExportsANammFileWithStatisticsAndProvenance) {
  const std::string out = namm::testing::TempPath("best.safetensors");
  const auto r = RunProcess(kCoordinator + " export --db " + *db_ + " --best --force --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto model = read_namm_file(out);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ(model->params.size(), 676u);
  EXPECT_EQ(model->norm_state, NormState::kFrozen);
  EXPECT_GT(model->norm_stats.count, 0);
  EXPECT_EQ(model->metadata.at("run"), "1");
  EXPECT_EQ(model->metadata.at("stage"), "1");
  EXPECT_EQ(model->metadata.at("generation"), "4");
  EXPECT_EQ(model->metadata.at("params"), "mean");
  EXPECT_TRUE(model->metadata.count("fitness"));

  const std::string gen = namm::testing::TempPath("gen1.safetensors");
  const auto g = RunProcess(kCoordinator + " export --db " + *db_ + " --generation 1 --params best --force --out " + gen);
  ASSERT_EQ(g.exit_code, 0) << g.output;
  auto best1 = read_namm_file(gen);
  ASSERT_TRUE(best1.ok());
  EXPECT_NE(best1->params, model->params);
  EXPECT_EQ(best1->metadata.at("source"), "generation best candidate");

  const auto info = RunProcess(std::string(NAMM_TOOL_PATH) + " info " + out);
  ASSERT_EQ(info.exit_code, 0) << info.output;
  EXPECT_NE(info.output.find("normalization: frozen"), std::string::npos) << info.output;

  const std::string model_path = std::string(NAMM_SHARED_DIR) + "/models/stories260K/stories260K.bin";
  if (std::filesystem::exists(model_path)) {
    const auto run = RunProcess(std::string(NAMM_WORKER_PATH) + " generate --model " + model_path + " --tokenizer " +
                                std::string(NAMM_SHARED_DIR) + "/models/stories260K/tok512.bin --namm " + out +
                                " --prompt 'Once upon a time' --max-new-tokens 8");
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_NE(run.output.find(", there was a little girl"), std::string::npos) << run.output;
  }
}

// A finished run keeps its final complete state, so the reference's ckpt.pt of its latest checkpoint can be
// written (before, a finished run kept no covariance snapshot and the export always failed).
TEST_F(CoordinatorCli, ExportsAFinishedRunsLatestCheckpointInTheReferencesFormat) {
  const std::string ckpt = namm::testing::TempPath("finished_ckpt.pt");
  const auto r = RunProcess(kCoordinator + " export --db " + *db_ + " --latest --format reference --force --out " + ckpt);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto read = read_reference_checkpoint(ckpt);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  const std::string mean = namm::testing::TempPath("finished_mean.safetensors");
  ASSERT_EQ(RunProcess(kCoordinator + " export --db " + *db_ + " --latest --force --out " + mean).exit_code, 0);
  const auto model = read_namm_file(mean);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ASSERT_EQ(read->mean.size(), model->params.size());
  for (std::size_t i = 0; i < read->mean.size(); ++i) {
    EXPECT_FLOAT_EQ(static_cast<float>(read->mean[i]), model->params[i]) << i;
  }
  EXPECT_EQ(read->iter_num, 5) << "the latest checkpoint starts generation 5";
  // The stage best's state is not kept: the error says what can be exported.
  const auto best = RunProcess(kCoordinator + " export --db " + *db_ + " --best --format reference --force --out " + ckpt);
  EXPECT_EQ(best.exit_code, 1);
  EXPECT_NE(best.output.find("a finished run keeps the snapshot of its final state only: export --latest"),
            std::string::npos)
      << best.output;
}

TEST_F(CoordinatorCli, BadRequestsGetClearErrorsAndChangeNothing) {
  const std::string before = *read_file(*db_);
  const std::string out = namm::testing::TempPath("never.safetensors");
  auto r = RunProcess(kCoordinator + " export --db " + *db_ + " --generation 9 --out " + out);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("run 1 has no completed generation 9"), std::string::npos) << r.output;
  r = RunProcess(kCoordinator + " export --db " + *db_ + " --params worst --out " + out);
  EXPECT_NE(r.output.find("--params must be mean or best"), std::string::npos) << r.output;
  r = RunProcess(kCoordinator + " export --db " + *db_ + " --run 7 --out " + out);
  EXPECT_NE(r.output.find("no run 7"), std::string::npos) << r.output;
  // A negative generation is an error, not the latest checkpoint (-1 meant "not given").
  r = RunProcess(kCoordinator + " export --db " + *db_ + " --generation -5 --out " + out);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--generation: Value -5 not in range 0 to"), std::string::npos) << r.output;
  r = RunProcess(kCoordinator + " status --db " + namm::testing::TempPath("absent.db"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("no database at"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out));
  const std::string kept = namm::testing::TempPath("kept.safetensors");
  ASSERT_TRUE(write_file_atomically(kept, {"precious"}).ok());
  r = RunProcess(kCoordinator + " export --db " + *db_ + " --out " + kept);
  EXPECT_NE(r.output.find("exists; pass --force"), std::string::npos) << r.output;
  EXPECT_EQ(*read_file(kept), "precious");
  EXPECT_EQ(*read_file(*db_), before);
}

// A database that is inconsistent, locked, or asked for a run id that is no run's: an error naming the problem,
// the file untouched. (status crashed on a run whose stage index was past its stages.)
TEST_F(CoordinatorCli, OddDatabasesAndRunIdsGetClearErrors) {
  for (const char* bad : {"0", "-1", "18446744073709551617", "1x"}) {
    for (const char* command : {" status", " report --out /nonexistent/r", " export --out /nonexistent/n.safetensors"}) {
      const auto r = RunProcess(kCoordinator + command + " --db " + *db_ + " --run " + bad);
      EXPECT_NE(r.exit_code, 0) << command << " --run " << bad;
      EXPECT_NE(r.output.find(std::string("'") + bad + "' is not a run id"), std::string::npos) << r.output;
    }
  }
  const std::string copy = namm::testing::FreshDatabasePath("inconsistent.db");
  std::filesystem::copy_file(*db_, copy);
  {
    SQLite::Database raw(copy, SQLite::OPEN_READWRITE);
    raw.exec("UPDATE runs SET stage = 5");
  }
  auto r = RunProcess(kCoordinator + " status --db " + copy);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("run 1 is at stage 5 but has 2 stage(s): the database is inconsistent"), std::string::npos)
      << r.output;
  {
    SQLite::Database raw(copy, SQLite::OPEN_READWRITE);
    raw.exec("UPDATE runs SET stage = 0; DELETE FROM stages");
  }
  r = RunProcess(kCoordinator + " status --db " + copy);
  EXPECT_NE(r.output.find("run 1 in " + copy + " has no stages"), std::string::npos) << r.output;
  // Numbers past 1e15 in the report's tables: every digit with an exponent, not cut to 63 characters.
  const std::string huge = namm::testing::FreshDatabasePath("huge.db");
  std::filesystem::copy_file(*db_, huge);
  {
    SQLite::Database raw(huge, SQLite::OPEN_READWRITE);
    raw.exec("UPDATE generations SET fitness_best = 1e300 WHERE generation = 1");
  }
  const std::string report = namm::testing::TempPath("huge_report");
  std::filesystem::remove_all(report);
  r = RunProcess(kCoordinator + " report --db " + huge + " --out " + report);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(namm::testing::ReadText(report + "/generations.csv").find(",1.0000000000000001e+300,"), std::string::npos)
      << namm::testing::ReadText(report + "/generations.csv");
  // Another process holding the database's exclusive lock for longer than the store waits.
  {
    SQLite::Database holder(copy, SQLite::OPEN_READWRITE);
    holder.exec("PRAGMA locking_mode = EXCLUSIVE; BEGIN EXCLUSIVE");
    r = RunProcess(kCoordinator + " status --db " + copy);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("is locked by another process"), std::string::npos) << r.output;
    holder.exec("ROLLBACK");
  }
}

TEST_F(CoordinatorCli, ImportsReferenceScoresAndRefusesConflicts) {
  const std::string db = namm::testing::TempPath("refs_cli.db");
  std::filesystem::remove(db);
  const std::string a = namm::testing::TempPath("a.json"), b = namm::testing::TempPath("b.json");
  ASSERT_TRUE(write_file_atomically(a, {R"({"lb/x": {"0": 0.5, "1": 0.25}})"}).ok());
  ASSERT_TRUE(write_file_atomically(b, {R"({"lb/x": {"0": 0.75}})"}).ok());
  auto r = RunProcess(kCoordinator + " import-reference --db " + db + " --model-fingerprint m --json " + a);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("2 added, 0 unchanged, 0 replaced"), std::string::npos) << r.output;
  r = RunProcess(kCoordinator + " import-reference --db " + db + " --model-fingerprint m --json " + b);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("lb/x prompt 0"), std::string::npos) << r.output;
  // Scores that six decimals would show as one are told apart.
  const std::string close = namm::testing::TempPath("close.json");
  ASSERT_TRUE(write_file_atomically(close, {R"({"lb/x": {"1": 0.2500001}})"}).ok());
  r = RunProcess(kCoordinator + " import-reference --db " + db + " --model-fingerprint m --json " + close);
  EXPECT_NE(r.output.find("holds reference score 0.25 for lb/x prompt 1 of model m and the import says 0.2500001;"),
            std::string::npos) << r.output;
  r = RunProcess(kCoordinator + " import-reference --db " + db + " --model-fingerprint m --replace --json " + b);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("0 added, 0 unchanged, 1 replaced"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace namm::coordinator
