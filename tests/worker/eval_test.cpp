// namm-worker eval as a real process on stories260K and interruption rows it builds: every output file,
// resume after a crash without recomputing, refusal to mix evaluations, shards merged into exactly the
// unsharded result, and the HTML page rendered by headless Chromium.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "../chromium.h"
#include "../process_util.h"
#include "../temp_path.h"
#include "namm/worker/evaluation.h"
#include "namm/worker/policy_spec.h"
#include "shared_data.h"

namespace namm::worker {
namespace {

using namm::testing::ReadText;
using namm::testing::RunProcess;
using nlohmann::json;

const std::string kWorker = NAMM_WORKER_PATH;

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// A predictions line without its timing, which differs from run to run.
json WithoutTiming(const std::string& line) {
  json j = json::parse(line);
  j.erase("seconds");
  return j;
}

// results.csv without the timing columns (seconds, tokens/s: the last two).
std::vector<std::string> ResultsWithoutTiming(const std::string& dir) {
  std::vector<std::string> rows;
  for (std::string line : Lines(ReadText(dir + "/results.csv"))) {
    for (int k = 0; k < 2; ++k) line.resize(line.rfind(','));
    rows.push_back(line);
  }
  return rows;
}

TEST(EvalPolicies, ListsSplitExpandAndPutTheFullCacheFirst) {
  auto specs = split_policy_list({"h2o:budget=8,recent=2,tova", "namm:a,b.safetensors"});
  ASSERT_TRUE(specs.ok()) << specs.status().ToString();
  EXPECT_EQ(*specs, (std::vector<std::string>{"h2o:budget=8,recent=2", "tova", "namm:a", "b.safetensors"}))
      << "a comma ends a NAMM path too: name files without commas";
  auto expanded = expand_policies({"tova", "snapkv:window=4", "full", "oracle"}, {}, {"0.25", "0.5"});
  ASSERT_TRUE(expanded.ok()) << expanded.status().ToString();
  EXPECT_EQ(*expanded,
            (std::vector<std::string>{"full", "tova:ratio=0.25", "tova:ratio=0.5",
                                      "snapkv:ratio=0.25,window=4", "snapkv:ratio=0.5,window=4", "oracle"}));
  EXPECT_FALSE(split_policy_list({"recent=2,h2o:budget=4"}).ok());
  // A NAMM draws a curve too: its own threshold, then each budget (the knob: namm:FILE,budget=N).
  auto namm = expand_policies({"namm:f.safetensors", "namm:g.safetensors,threshold=0.5"}, {"8", "16"}, {});
  ASSERT_TRUE(namm.ok()) << namm.status().ToString();
  EXPECT_EQ(*namm, (std::vector<std::string>{"full", "namm:f.safetensors", "namm:f.safetensors,budget=8",
                                             "namm:f.safetensors,budget=16", "namm:g.safetensors,threshold=0.5"}));
  auto knobbed = split_policy_list({"namm:f.safetensors,ratio=0.25,tova"});
  ASSERT_TRUE(knobbed.ok()) << knobbed.status().ToString();
  EXPECT_EQ(*knobbed, (std::vector<std::string>{"namm:f.safetensors,ratio=0.25", "tova"}));
  EXPECT_FALSE(policy_family("namm:f.safetensors,budget=8,ratio=0.5").ok()) << "one setting at most";
  EXPECT_FALSE(policy_family("namm:f.safetensors,budget=x").ok());
  // prompt=keep (the NAMM's eviction at the prompt's end) goes with it through the list, the curve and the bound.
  auto keep = split_policy_list({"namm:f.safetensors,prompt=keep,tova"});
  ASSERT_TRUE(keep.ok()) << keep.status().ToString();
  EXPECT_EQ(*keep, (std::vector<std::string>{"namm:f.safetensors,prompt=keep", "tova"}));
  EXPECT_EQ(*expand_policies({"namm:f.safetensors,prompt=keep"}, {"8"}, {}),
            (std::vector<std::string>{"full", "namm:f.safetensors,prompt=keep", "namm:f.safetensors,budget=8,prompt=keep"}));
  const NammSpec spec = parse_namm_spec("namm:f.safetensors,prompt=keep,threshold=0.5").value();
  EXPECT_TRUE(spec.keep_prompt);
  EXPECT_EQ(spec.setting, "threshold=0.5");
  EXPECT_EQ(spec.ToString(), "namm:f.safetensors,threshold=0.5,prompt=keep");
  EXPECT_FALSE(parse_namm_spec("namm:f.safetensors,prompt=evict").value().keep_prompt);
  const Result<NammSpec> bad = parse_namm_spec("namm:f.safetensors,prompt=later");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("prompt= takes keep"), std::string::npos) << bad.status().ToString();
  const Result<NammSpec> twice = parse_namm_spec("namm:f.safetensors,prompt=keep,prompt=evict");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("given twice"), std::string::npos) << twice.status().ToString();
  EXPECT_NE(twice.status().message().find("'namm:f.safetensors,prompt=keep,prompt=evict'"), std::string::npos)
      << "the error names the whole policy: " << twice.status().ToString();
  EXPECT_EQ(*with_cache_setting("namm:f.safetensors,prompt=keep", "budget=4"), "namm:f.safetensors,budget=4,prompt=keep");
  // A key a NAMM does not take is refused, not read as part of the file's name (namm-api opened
  // "<its NAMM>,x=/../../etc/hostname" for a client).
  const Result<std::string> unknown = with_cache_setting("namm:/srv/f.safetensors", "x=/../../etc/hostname");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("unknown option 'x' for namm in the cache setting 'x=/../../etc/hostname' "
                                             "of 'namm:/srv/f.safetensors'"),
            std::string::npos)
      << unknown.status().ToString();
  // What a cache holds at most over 300 prompt tokens and 50 new ones, adding up to 64 between evictions.
  const auto peak = [](const std::string& policy, int64_t prompt = 300, int64_t new_tokens = 50) {
    const Result<int64_t> tokens = policy_peak_tokens(policy, prompt, new_tokens, 64);
    EXPECT_TRUE(tokens.ok()) << policy << ": " << tokens.status().ToString();
    return tokens.ok() ? *tokens : -1;
  };
  EXPECT_EQ(peak("namm:f.safetensors,budget=4,prompt=keep", 300, 100), 300 + 64) << "it holds the prompt, then evicts";
  EXPECT_EQ(peak("namm:f.safetensors,budget=4"), 4 + 64);
  EXPECT_EQ(peak("namm:f.safetensors"), 350) << "nothing bounds a NAMM without a knob";
  EXPECT_EQ(peak("full"), 350);
  EXPECT_EQ(peak("h2o:budget=16"), 16 + 64);
  EXPECT_EQ(peak("streaming:ratio=0.5"), 150 + 64);
  EXPECT_EQ(peak("h2o:budget=9223372036854775807"), 350) << "a budget past the allowance holds the allowance";
  EXPECT_EQ(peak("h2o:budget=290"), 350) << "the budget and a step pass the allowance";
  // SnapKV holds the prompt until its end, then its budget and every new token; FastGen's heads may keep all.
  EXPECT_EQ(peak("snapkv:budget=16"), 300);
  EXPECT_EQ(peak("snapkv:budget=16", 40, 200), 16 + 200);
  EXPECT_EQ(peak("snapkv:budget=64", 40, 200), 240);
  EXPECT_EQ(peak("fastgen:budget=16"), 350);
  EXPECT_EQ(peak("l2:budget=16"), 16 + 64);
  EXPECT_EQ(peak("l2:budget=16,skip_layers=1"), 350) << "its first layer keeps every token";
  EXPECT_TRUE(policy_keeps_prompt("snapkv:budget=16") && policy_keeps_prompt("fastgen:ratio=0.1"));
  EXPECT_FALSE(policy_keeps_prompt("h2o:budget=16") || policy_keeps_prompt("namm:f.safetensors,budget=4"));
  EXPECT_FALSE(policy_peak_tokens("h2o:budget=-3", 300, 50, 64).ok());
  EXPECT_EQ(output_directory_name("namm:runs/a b.safetensors"), "namm_runs_a_b.safetensors");
  // heads=own (each KV head keeps its own count: a ragged cache) likewise.
  EXPECT_EQ(*split_policy_list({"namm:f.safetensors,heads=own,tova"}),
            (std::vector<std::string>{"namm:f.safetensors,heads=own", "tova"}));
  const NammSpec own = parse_namm_spec("namm:f.safetensors,heads=own,prompt=keep,budget=8").value();
  EXPECT_TRUE(own.own_head_counts && own.keep_prompt);
  EXPECT_EQ(own.ToString(), "namm:f.safetensors,budget=8,prompt=keep,heads=own");
  EXPECT_FALSE(parse_namm_spec("namm:f.safetensors,heads=equal").value().own_head_counts);
  EXPECT_EQ(*with_cache_setting("namm:f.safetensors,heads=own", "budget=4"), "namm:f.safetensors,budget=4,heads=own");
  EXPECT_EQ(*with_cache_setting("namm:f.safetensors,budget=8", "heads=own"), "namm:f.safetensors,budget=8,heads=own")
      << "a flag keeps the NAMM's budget";
  EXPECT_EQ(*with_cache_setting("namm:f.safetensors,heads=own,prompt=keep", "heads=equal"),
            "namm:f.safetensors,prompt=keep") << "a flag named in the setting is the setting's";
  const Result<NammSpec> bad_heads = parse_namm_spec("namm:f.safetensors,heads=some");
  ASSERT_FALSE(bad_heads.ok());
  EXPECT_NE(bad_heads.status().message().find("heads= takes own"), std::string::npos) << bad_heads.status().ToString();
}

TEST(EvalPolicies, MatchedCacheComparisonInterpolatesEachFamily) {
  const auto result = [](const std::string& policy, const std::string& family, const std::string& setting,
                         double cache, double score) {
    PolicyResult r;
    r.task = "t";
    r.policy = policy;
    r.family = family;
    r.cache_setting = setting;
    r.relative_cache = cache;
    r.score = score;
    return r;
  };
  const std::vector<PolicyResult> results = {
      result("full", "full", "", 1.0, 0.3),
      result("h2o:budget=8", "h2o", "budget=8", 0.2, 0.20),
      result("h2o:budget=16", "h2o", "budget=16", 0.4, 0.30),
      result("tova:budget=16", "tova", "budget=16", 0.4, 0.10),
      result("namm:x", "namm", "", 0.25, 0.28),
  };
  const auto matched = matched_cache_comparison(results);
  ASSERT_EQ(matched.size(), 2u);
  EXPECT_EQ(matched[0].family, "h2o");
  EXPECT_NEAR(matched[0].family_score, 0.225, 1e-12);  // a quarter of the way from 0.20 to 0.30
  EXPECT_EQ(matched[1].family, "tova");
  EXPECT_TRUE(std::isnan(matched[1].family_score));
  EXPECT_NE(matched[1].note.find("below its smallest cache"), std::string::npos) << matched[1].note;
  // A family none of whose settings has a finite relative cache (the full cache's size unknown) is named as such;
  // it indexed an empty list before.
  std::vector<PolicyResult> unknown = results;
  unknown.push_back(result("snapkv:budget=8", "snapkv", "budget=8", std::nan(""), 0.1));
  unknown.push_back(result("snapkv:budget=16", "snapkv", "budget=16", std::nan(""), 0.2));
  const auto with_unknown = matched_cache_comparison(unknown);
  ASSERT_EQ(with_unknown.size(), 3u);
  EXPECT_EQ(with_unknown[2].family, "snapkv");
  EXPECT_TRUE(std::isnan(with_unknown[2].family_score));
  EXPECT_EQ(with_unknown[2].note, "no cache setting of it has a known relative cache");
  // A NAMM evaluated at budgets too: its own settings are not a family to compare it with (they were, and an
  // own-threshold point without a setting was taken for one of its settings).
  std::vector<PolicyResult> knob = results;
  knob[4].family = "namm:x";
  knob.push_back(result("namm:x,budget=8", "namm:x", "budget=8", 0.2, 0.27));
  const auto with_knob = matched_cache_comparison(knob);
  ASSERT_EQ(with_knob.size(), 2u);
  EXPECT_EQ(with_knob[0].family, "h2o");
  EXPECT_EQ(with_knob[1].family, "tova");
}

// Each NAMM against the policies at its own cache setting, paired per row; at its own threshold, the full cache.
TEST(EvalPolicies, PairedComparisonPairsRowsAtTheSameSetting) {
  const auto result = [](const std::string& policy, const std::string& family, const std::string& setting,
                         std::vector<double> rows) {
    PolicyResult r;
    r.task = "t";
    r.policy = policy;
    r.family = family;
    r.cache_setting = setting;
    r.row_scores = std::move(rows);
    return r;
  };
  const std::vector<PolicyResult> results = {
      result("full", "full", "", {0.1, 0.1, 0.1}),
      result("h2o:budget=8", "h2o", "budget=8", {0.1, 0.2, 0.2}),
      result("h2o:budget=16", "h2o", "budget=16", {0.9, 0.9, 0.9}),
      result("namm:x", "namm:x", "", {0.3, 0.2, 0.1}),
      result("namm:x,budget=8", "namm:x", "budget=8", {0.3, 0.2, 0.4}),
  };
  const auto paired = paired_comparison(results);
  ASSERT_EQ(paired.size(), 2u);
  EXPECT_EQ(paired[0].policy, "namm:x");
  EXPECT_EQ(paired[0].other, "full");
  EXPECT_NEAR(paired[0].mean_difference, 0.1, 1e-12);
  EXPECT_EQ(paired[0].wins, 2);
  EXPECT_EQ(paired[1].policy, "namm:x,budget=8");
  EXPECT_EQ(paired[1].other, "h2o:budget=8");
  // Differences 0.2, 0, 0.2: mean 2/15, sample standard deviation sqrt(1/75), standard error 1/15, t = 2.
  EXPECT_NEAR(paired[1].mean_difference, 2.0 / 15, 1e-12);
  EXPECT_NEAR(paired[1].standard_error, 1.0 / 15, 1e-12);
  EXPECT_NEAR(paired[1].t, 2.0, 1e-9);
  EXPECT_EQ(paired[1].wins, 2);
  EXPECT_EQ(paired[1].rows, 3);
}

// The answer-time relative cache pairs rows: a row where a policy answered nothing (EOS first, no answer query)
// counts for neither side (before: the policy's mean over its rows against the full cache's over all, 6 / 20).
TEST(EvalResults, TheAnswerTimeRelativeCacheComparesTheSameRows) {
  const std::string dir = namm::testing::TempPath("answer_cache");
  std::filesystem::remove_all(dir);
  EvalConfig config;
  config.tasks = {"t/x"};
  config.task_rows["t/x"] = "0:2";
  config.policies = {"full", "h2o:budget=8"};
  const auto write = [&](const std::string& policy, double row0, double row1) {
    const std::string path = predictions_path(dir, "t/x", policy);
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    Result<PredictionWriter> w = PredictionWriter::Open(path);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    for (const auto& [row, answer] : {std::make_pair(0, row0), std::make_pair(1, row1)}) {
      PredictionRecord r;
      r.row = row;
      r.score = 0.5;
      r.mean_kv_tokens = 10;
      r.answer_kv_tokens = answer;
      ASSERT_TRUE(w->Append(r).ok());
    }
  };
  write("full", 10, 30);
  write("h2o:budget=8", 0, 6);
  const Result<std::vector<PolicyResult>> results = compute_results(config, dir);
  ASSERT_TRUE(results.ok()) << results.status().ToString();
  ASSERT_EQ(results->size(), 2u);
  EXPECT_DOUBLE_EQ((*results)[1].answer_relative_cache, 6.0 / 30.0);
  EXPECT_DOUBLE_EQ((*results)[1].answer_kv_tokens, 6.0) << "its own mean: over the rows it answered";
  EXPECT_DOUBLE_EQ((*results)[0].answer_relative_cache, 1.0);

  // A task where the full cache scored 0 has no normalized score, and the mean over tasks leaves it out (it made
  // every policy's mean blank).
  PolicyResult h2o = (*results)[1];
  h2o.relative_cache = 0.5;
  PolicyResult zero = h2o;
  zero.task = "t/zero";
  zero.normalized_score = std::nan("");
  EvalConfig both = config;
  both.tasks = {"t/x", "t/zero"};
  // (The full cache has no result for t/zero here: its cell stays empty. Before, the row came out short and the
  // table read past it: AddressSanitizer.)
  const std::string table = results_table(both, {(*results)[0], h2o, zero});
  const std::size_t at = table.find("h2o:budget=8");
  ASSERT_NE(at, std::string::npos) << table;
  const std::string line = table.substr(at, table.find('\n', at) - at);
  EXPECT_NE(line.find("1.000"), std::string::npos) << "its normalized 0.5 / 0.5 on t/x alone: " << table;
}

TEST(EvalPredictions, ATornLastLineIsCutAndACompleteOneKept) {
  const std::string path = namm::testing::TempPath("predictions.jsonl");
  PredictionRecord a, b;
  a.row = 0;
  b.row = 1;
  b.score = std::nan("");  // written as null, read back as NaN
  const std::string line_a = a.ToJson().dump(), line_b = b.ToJson().dump();
  namm::testing::WriteText(path, line_a + "\n" + line_b.substr(0, 10));
  auto cut = load_predictions(path, /*repair=*/true);
  ASSERT_TRUE(cut.ok()) << cut.status().ToString();
  EXPECT_EQ(cut->size(), 1u);
  EXPECT_EQ(ReadText(path), line_a + "\n");
  namm::testing::WriteText(path, line_a + "\n" + line_b);  // complete, only its newline missing
  auto kept = load_predictions(path, /*repair=*/true);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  ASSERT_EQ(kept->size(), 2u);
  EXPECT_TRUE(std::isnan((*kept)[1].score));
  EXPECT_EQ(ReadText(path), line_a + "\n" + line_b + "\n");
  const std::string broken = line_a + "\n{not json\n" + line_b + "\n";
  namm::testing::WriteText(path, broken);
  auto refused = load_predictions(path, /*repair=*/true);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("line 2"), std::string::npos) << refused.status().ToString();
  EXPECT_EQ(ReadText(path), broken) << "a malformed file is left as it is";
}

class Eval : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::SharedExists(testing::kStoriesModel)) return;
    dir_ = new std::string(namm::testing::TempPath("eval"));
    std::filesystem::remove_all(*dir_);
    std::filesystem::create_directories(*dir_ + "/data");
    // Small interruption rows: ~100-token prompts, memory updates every 64 tokens (the task's setting).
    const auto rows =
        RunProcess(kWorker + " build-synthetic --family interruption " + ModelFlags() +
                   " --rows 6 --pool 4 --story-tokens 110 --prefix-range 20:40 --interruption-range "
                   "30:60 --resume-range 0:8 --continuation-tokens 16 --out " +
                   *dir_ + "/data/interruption_heldout.jsonl");
    ASSERT_EQ(rows.exit_code, 0) << rows.output;
    const auto zero = RunProcess(std::string(NAMM_TOOL_PATH) + " init --arch bam --zero --out " + *dir_ +
                                 "/zero.safetensors");
    ASSERT_EQ(zero.exit_code, 0) << zero.output;
  }
  static void TearDownTestSuite() { delete dir_; }

  void SetUp() override { NAMM_REQUIRE_SHARED(testing::kStoriesModel); }

  static std::string ModelFlags() {
    return "--model " + testing::SharedPath(testing::kStoriesModel) + " --tokenizer " +
           testing::SharedPath(testing::kStoriesTokenizer);
  }
  // `namm-worker eval` on the rows built above.
  static namm::testing::ProcessResult RunEval(const std::string& out, const std::string& policies,
                                              const std::string& extra = "") {
    return RunProcess(kWorker + " eval " + ModelFlags() +
                      " --tasks syn/interruption_heldout --data-dir synthetic=" + *dir_ +
                      "/data --threads 1 --policies '" + policies + "' --out " + out + " " + extra);
  }

  static std::string* dir_;
};
std::string* Eval::dir_ = nullptr;

TEST_F(Eval, WritesPredictionsResultsConfigurationAndPage) {
  const std::string out = *dir_ + "/all";
  const auto r =
      RunEval(out,
              "h2o:budget=32,recent=8,streaming,tova,snapkv,fastgen:recovery=0.5,l2,oracle,namm:" + *dir_ +
                  "/zero.safetensors",
              "--budgets 32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("mean normalized"), std::string::npos) << "the Table 1 layout is printed";

  auto config = EvalConfig::FromYaml(ReadText(out + "/config.yaml"), "config.yaml");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const std::vector<std::string> expected = {"full",
                                             "h2o:budget=32,recent=8",
                                             "streaming:budget=32",
                                             "tova:budget=32",
                                             "snapkv:budget=32",
                                             "fastgen:budget=32,recovery=0.5",
                                             "l2:budget=32",
                                             "oracle",
                                             "namm:" + *dir_ + "/zero.safetensors",
                                             "namm:" + *dir_ + "/zero.safetensors,budget=32"};  // the knob
  EXPECT_EQ(config->policies, expected);
  EXPECT_FALSE(config->commit.empty());
  EXPECT_EQ(config->task_rows.at("syn/interruption_heldout"), "0:6");

  // LongBench-format predictions with our cache sizes, one line per row, in row order.
  const std::vector<json> source = [&] {
    std::vector<json> rows;
    for (const auto& line : Lines(ReadText(*dir_ + "/data/interruption_heldout.jsonl")))
      rows.push_back(json::parse(line));
    return rows;
  }();
  for (const auto& policy : expected) {
    const auto lines = Lines(ReadText(predictions_path(out, "syn/interruption_heldout", policy)));
    ASSERT_EQ(lines.size(), 6u) << policy;
    for (std::size_t i = 0; i < lines.size(); ++i) {
      const json p = json::parse(lines[i]);
      EXPECT_EQ(p["row"], static_cast<int64_t>(i));
      EXPECT_EQ(p["answers"], source[i]["answers"]);
      for (const char* key : {"pred", "all_classes", "length", "score", "mean_kv_tokens", "peak_kv_tokens"}) {
        EXPECT_TRUE(p.contains(key)) << key;
      }
    }
  }

  const json results = json::parse(ReadText(out + "/results.json"));
  std::map<std::string, json> by_policy;
  for (const auto& result : results["results"]) by_policy[result["policy"]] = result;
  ASSERT_EQ(by_policy.size(), expected.size());
  EXPECT_DOUBLE_EQ(by_policy["full"]["normalized_score"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(by_policy["full"]["relative_cache"].get<double>(), 1.0);
  // A zero NAMM keeps everything: the base model's scores and cache, exactly.
  const json& zero = by_policy["namm:" + *dir_ + "/zero.safetensors"];
  EXPECT_DOUBLE_EQ(zero["score"].get<double>(), by_policy["full"]["score"].get<double>());
  EXPECT_DOUBLE_EQ(zero["relative_cache"].get<double>(), 1.0);
  // The fixed-budget baselines and the oracle hold less; a 32-token window is at most a third of a ~110-token
  // sequence's mean... and the oracle keeps more than the windows (it only drops the interruption).
  for (const char* p : {"streaming:budget=32", "tova:budget=32", "l2:budget=32", "oracle"}) {
    EXPECT_LT(by_policy[p]["relative_cache"].get<double>(), 1.0) << p;
  }
  EXPECT_LT(by_policy["snapkv:budget=32"]["answer_relative_cache"].get<double>(), 1.0);
  EXPECT_EQ(Lines(ReadText(out + "/results.csv")).size(), 1 + expected.size());

  // Paired per row: the NAMM at its own threshold against the full cache, at budget=32 against every policy at
  // budget=32; the mean difference is the difference of the means, its spread that of the rows' differences.
  std::map<std::string, json> paired;
  for (const auto& p : results["paired"]) {
    EXPECT_EQ(p["task"], "syn/interruption_heldout");
    paired[p["policy"].get<std::string>() + " vs " + p["other"].get<std::string>()] = p;
  }
  const std::string namm = "namm:" + *dir_ + "/zero.safetensors";
  const std::vector<std::string> at_32 = {"h2o:budget=32,recent=8", "streaming:budget=32", "tova:budget=32",
                                          "snapkv:budget=32", "fastgen:budget=32,recovery=0.5", "l2:budget=32"};
  ASSERT_EQ(paired.size(), 1 + at_32.size()) << results["paired"].dump();
  const json& own = paired.at(namm + " vs full");
  EXPECT_EQ(own["mean_difference"].get<double>(), 0.0);  // the zero NAMM keeps everything
  EXPECT_TRUE(own["t"].is_null()) << "no spread, no t";
  EXPECT_EQ(own["wins"], 0);
  for (const std::string& other : at_32) {
    const json& p = paired.at(namm + ",budget=32 vs " + other);
    EXPECT_EQ(p["cache_setting"], "budget=32");
    EXPECT_EQ(p["rows"], 6);
    EXPECT_NEAR(p["mean_difference"].get<double>(),
                by_policy[namm + ",budget=32"]["score"].get<double>() - by_policy[other]["score"].get<double>(), 1e-12);
  }
  EXPECT_NE(r.output.find("Paired per row"), std::string::npos) << r.output;

  const std::string html = ReadText(out + "/results.html");
  EXPECT_EQ(html.find("https://"), std::string::npos) << "self-contained";
  if (!namm::testing::ChromiumInstalled())
    GTEST_SKIP() << "chromium is not installed (scripts/install-deps.sh)";
  // One curve per family with several cache settings would need --budgets with two values; here each family
  // has one point, so the check is the page and its chart: expand h2o over two budgets for a curve.
  const std::string curve_out = *dir_ + "/curve";
  const auto curve = RunEval(curve_out, "h2o,streaming", "--budgets 16,48");
  ASSERT_EQ(curve.exit_code, 0) << curve.output;
  namm::testing::ExpectRenderedWithCurves(namm::testing::RenderedDom(curve_out + "/results.html"), 2);
}

// eval --explain-rows: a page per (row, policy) for the first rows, linked from results.html; each page holds
// every token the model read (prompt and teacher-forced continuation) and the policy's evictions.
TEST_F(Eval, ExplainRowsWritesAPagePerRowAndPolicyLinkedFromTheResults) {
  const std::string out = *dir_ + "/explain";
  const auto r = RunEval(out, "streaming:budget=24,oracle", "--explain-rows 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<json> predictions = [&] {
    std::vector<json> rows;
    for (const auto& line : Lines(ReadText(predictions_path(out, "syn/interruption_heldout", "streaming:budget=24"))))
      rows.push_back(json::parse(line));
    return rows;
  }();
  for (const std::string policy : {"full", "streaming:budget=24", "oracle"}) {
    for (int64_t row = 0; row < 6; ++row) {
      const bool explained = std::filesystem::exists(explain_path(out, "syn/interruption_heldout", policy, row));
      EXPECT_EQ(explained, row < 2) << policy << " row " << row;
    }
  }
  const std::string html = ReadText(out + "/results.html");
  EXPECT_NE(html.find("What the policies keep"), std::string::npos);
  const std::string page = explain_path(out, "syn/interruption_heldout", "streaming:budget=24", 1);
  EXPECT_EQ(ReadText(page).find("https://"), std::string::npos) << "self-contained";
  if (!namm::testing::ChromiumInstalled())
    GTEST_SKIP() << "chromium is not installed (scripts/install-deps.sh)";
  // The results page links each page by a path relative to it.
  const std::string dom = namm::testing::RenderedDom(out + "/results.html");
  std::size_t links = 0;
  for (std::size_t at = dom.find("/explain-row-"); at != std::string::npos; at = dom.find("/explain-row-", at + 1)) ++links;
  EXPECT_EQ(links, 6u) << "rows 0 and 1 of three policies";
  const std::string shown = namm::testing::RenderedDom(page);
  EXPECT_NE(shown.find("data-explained=\"-1\""), std::string::npos) << "the tokens were not shaded";
  std::size_t spans = 0, evicted = 0;
  for (std::size_t at = shown.find("data-heads-kept=\""); at != std::string::npos; at = shown.find("data-heads-kept=\"", at + 1)) {
    ++spans;
    evicted += std::stoll(shown.substr(at + 17)) == 0 ? 1 : 0;
  }
  // Every position the model read: the prompt and the continuation fed after it (all but its last token).
  EXPECT_EQ(spans, predictions[1]["prompt_tokens"].get<std::size_t>() + predictions[1]["generated_tokens"].get<std::size_t>() - 1)
      << predictions[1].dump();
  EXPECT_GT(evicted, 0u) << "a 24-token window evicts part of a ~100-token row";

  // --overwrite with no explain pages removes the old ones: the new results page linked them (rows of another
  // evaluation).
  const auto again = RunEval(out, "streaming:budget=24", "--overwrite --rows 4:6");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  for (const std::string policy : {"full", "streaming:budget=24"}) {
    EXPECT_FALSE(std::filesystem::exists(explain_path(out, "syn/interruption_heldout", policy, 0))) << policy;
  }
  EXPECT_EQ(ReadText(out + "/results.html").find("What the policies keep"), std::string::npos);
}

TEST_F(Eval, ResumesAfterACrashWithoutRecomputingFinishedRows) {
  const std::string out = *dir_ + "/resume";
  std::filesystem::remove_all(out);
  ASSERT_EQ(RunEval(out, "tova:budget=32").exit_code, 0);
  const std::string path = predictions_path(out, "syn/interruption_heldout", "tova:budget=32");
  const auto before = Lines(ReadText(path));
  ASSERT_EQ(before.size(), 6u);
  // As if the process died while writing row 4: rows 0-3 complete, row 4 half written.
  {
    std::ofstream cut(path, std::ios::trunc);
    for (int i = 0; i < 4; ++i) cut << before[static_cast<std::size_t>(i)] << "\n";
    cut << before[4].substr(0, before[4].size() / 2);
  }
  std::filesystem::remove(out + "/results.csv");
  const auto resumed = RunEval(out, "tova:budget=32");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto after = Lines(ReadText(path));
  ASSERT_EQ(after.size(), 6u);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(after[static_cast<std::size_t>(i)], before[static_cast<std::size_t>(i)])
        << "row " << i << " was recomputed";
  for (int i = 4; i < 6; ++i)
    EXPECT_EQ(WithoutTiming(after[static_cast<std::size_t>(i)]),
              WithoutTiming(before[static_cast<std::size_t>(i)]));
  EXPECT_TRUE(std::filesystem::exists(out + "/results.csv"));

  // Another evaluation in the same directory is refused and changes nothing; --overwrite starts over.
  const std::string config = ReadText(out + "/config.yaml");
  const auto other = RunEval(out, "tova:budget=16");
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.output.find("holds another evaluation (policies:"), std::string::npos) << other.output;
  EXPECT_EQ(ReadText(out + "/config.yaml"), config);
  EXPECT_EQ(Lines(ReadText(path)), after);
  const auto overwritten = RunEval(out, "tova:budget=16", "--overwrite");
  ASSERT_EQ(overwritten.exit_code, 0) << overwritten.output;
  EXPECT_FALSE(std::filesystem::exists(path)) << "the old policy's predictions are gone";
  EXPECT_EQ(Lines(ReadText(predictions_path(out, "syn/interruption_heldout", "tova:budget=16"))).size(), 6u);
}

TEST_F(Eval, RefusesToMixFilesItCannotVouchFor) {
  // Another NAMM behind the same path: the finished rows were computed with the first one.
  const std::string out = *dir_ + "/fingerprint", namm = *dir_ + "/changing.safetensors";
  std::filesystem::remove_all(out);
  std::filesystem::copy_file(*dir_ + "/zero.safetensors", namm,
                             std::filesystem::copy_options::overwrite_existing);
  ASSERT_EQ(RunEval(out, "namm:" + namm).exit_code, 0);
  const auto init = RunProcess(std::string(NAMM_TOOL_PATH) +
                               " init --arch bam --seed 5 --scale 0.05 --force --out " + namm);
  ASSERT_EQ(init.exit_code, 0) << init.output;
  const auto resumed = RunEval(out, "namm:" + namm);
  EXPECT_NE(resumed.exit_code, 0);
  EXPECT_NE(resumed.output.find("holds another evaluation (fingerprints:"), std::string::npos)
      << resumed.output;

  // Another task definition behind the same --tasks-dir (its scoring changed): the finished rows were scored
  // under the first one (before, the resumed rows were scored by token accuracy beside likelihoods).
  const std::string tasks = *dir_ + "/tasks", changed = *dir_ + "/changed-task";
  std::filesystem::remove_all(tasks);
  std::filesystem::remove_all(changed);
  std::filesystem::copy(std::string(NAMM_SOURCE_DIR) + "/tasks", tasks, std::filesystem::copy_options::recursive);
  ASSERT_EQ(RunEval(changed, "h2o:budget=16", "--tasks-dir " + tasks + " --rows 0:3").exit_code, 0);
  std::string yaml = ReadText(tasks + "/synthetic.yaml");
  const std::size_t at = yaml.find("scoring: likelihood", yaml.find("name: syn/interruption_heldout"));
  ASSERT_NE(at, std::string::npos);
  yaml.replace(at, std::string("scoring: likelihood").size(), "scoring: token_accuracy");
  namm::testing::WriteText(tasks + "/synthetic.yaml", yaml);
  const auto rescored = RunEval(changed, "h2o:budget=16", "--tasks-dir " + tasks + " --rows 0:3");
  EXPECT_NE(rescored.exit_code, 0);
  EXPECT_NE(rescored.output.find("holds another evaluation (fingerprints:"), std::string::npos)
      << rescored.output;

  // Another tokenizer.bin beside a llama2.c model loaded without --tokenizer (before, the fingerprint covered only
  // a tokenizer given on the command line, and the resumed rows were tokenized with the other one).
  const std::string beside = *dir_ + "/beside", beside_out = *dir_ + "/beside-out";
  std::filesystem::remove_all(beside);
  std::filesystem::remove_all(beside_out);
  std::filesystem::create_directories(beside);
  std::filesystem::copy_file(testing::SharedPath(testing::kStoriesModel), beside + "/model.bin");
  std::filesystem::copy_file(testing::SharedPath(testing::kStoriesTokenizer), beside + "/tokenizer.bin");
  const std::string beside_eval = kWorker + " eval --model " + beside + "/model.bin --tasks syn/interruption_heldout" +
                                   " --data-dir synthetic=" + *dir_ + "/data --threads 1 --policies h2o:budget=16" +
                                   " --rows 0:2 --out " + beside_out;
  const auto first = RunProcess(beside_eval);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  {
    // The first token's score (a float after the header's int): still a valid tokenizer, another one.
    std::fstream tokenizer(beside + "/tokenizer.bin", std::ios::in | std::ios::out | std::ios::binary);
    tokenizer.seekp(4);
    tokenizer.put('\x42');
  }
  const auto other_tokenizer = RunProcess(beside_eval);
  EXPECT_NE(other_tokenizer.exit_code, 0);
  EXPECT_NE(other_tokenizer.output.find("holds another evaluation (fingerprints:"), std::string::npos)
      << other_tokenizer.output;

  // --overwrite removes only an evaluation's own files: not a configuration it cannot read...
  const std::string foreign = *dir_ + "/foreign";
  std::filesystem::remove_all(foreign);
  std::filesystem::create_directories(foreign);
  namm::testing::WriteText(foreign + "/config.yaml", "name: someone else's\n");
  const auto overwrite = RunEval(foreign, "tova:budget=8", "--overwrite");
  EXPECT_NE(overwrite.exit_code, 0);
  EXPECT_NE(overwrite.output.find("remove it yourself"), std::string::npos) << overwrite.output;
  EXPECT_EQ(ReadText(foreign + "/config.yaml"), "name: someone else's\n");
  // ... and predictions without a configuration are not taken for finished rows.
  std::filesystem::remove(foreign + "/config.yaml");
  const std::string stray = predictions_path(foreign, "syn/interruption_heldout", "tova:budget=8");
  std::filesystem::create_directories(std::filesystem::path(stray).parent_path());
  namm::testing::WriteText(stray, "");
  const auto unknown = RunEval(foreign, "tova:budget=8");
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.output.find("no config.yaml"), std::string::npos) << unknown.output;
}

TEST_F(Eval, ShardsMergeIntoExactlyTheUnshardedResult) {
  const std::string policies = "h2o:budget=32,oracle";
  const std::string whole = *dir_ + "/whole", s0 = *dir_ + "/shard0", s1 = *dir_ + "/shard1",
                    merged = *dir_ + "/merged";
  for (const auto& d : {whole, s0, s1, merged}) std::filesystem::remove_all(d);
  ASSERT_EQ(RunEval(whole, policies).exit_code, 0);
  ASSERT_EQ(RunEval(s0, policies, "--shard 0/2 --explain-rows 1").exit_code, 0);
  // A merge with a shard missing is refused.
  const auto partial = RunProcess(kWorker + " eval --merge " + s0 + " --out " + merged);
  EXPECT_NE(partial.exit_code, 0);
  EXPECT_NE(partial.output.find("shard 1/2 is missing"), std::string::npos) << partial.output;
  ASSERT_EQ(RunEval(s1, policies, "--shard 1/2 --explain-rows 1").exit_code, 0);
  EXPECT_EQ(Lines(ReadText(predictions_path(s1, "syn/interruption_heldout", "oracle"))).size(), 3u);
  const auto merge = RunProcess(kWorker + " eval --merge " + s1 + " " + s0 + " --out " + merged);
  ASSERT_EQ(merge.exit_code, 0) << merge.output;

  for (const char* policy : {"full", "h2o:budget=32", "oracle"}) {
    const auto a = Lines(ReadText(predictions_path(whole, "syn/interruption_heldout", policy)));
    const auto b = Lines(ReadText(predictions_path(merged, "syn/interruption_heldout", policy)));
    ASSERT_EQ(a.size(), b.size()) << policy;
    for (std::size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(WithoutTiming(a[i]), WithoutTiming(b[i])) << policy << " " << i;
  }
  EXPECT_EQ(ResultsWithoutTiming(merged), ResultsWithoutTiming(whole));
  auto merged_config = EvalConfig::FromYaml(ReadText(merged + "/config.yaml"), "merged");
  auto whole_config = EvalConfig::FromYaml(ReadText(whole + "/config.yaml"), "whole");
  ASSERT_TRUE(merged_config.ok() && whole_config.ok());
  EXPECT_EQ(merged_config->DifferenceFrom(*whole_config), "");
  EXPECT_EQ(merged_config->shard_count, 1);
  // The shards' explain pages come along, linked from the merged results page (they were left behind).
  const auto pages = [](const std::string& dir) {
    std::set<std::string> names;
    const std::string folder =
        std::filesystem::path(predictions_path(dir, "syn/interruption_heldout", "oracle")).parent_path();
    for (const auto& entry : std::filesystem::directory_iterator(folder)) {
      if (explain_page_row(entry.path().filename())) names.insert(entry.path().filename());
    }
    return names;
  };
  std::set<std::string> shard_pages = pages(s0);
  for (const std::string& name : pages(s1)) shard_pages.insert(name);
  EXPECT_FALSE(shard_pages.empty());
  EXPECT_EQ(pages(merged), shard_pages);
  EXPECT_NE(ReadText(merged + "/results.html").find("What the policies keep"), std::string::npos);
}

TEST_F(Eval, RefusesBadInputWithAClearMessage) {
  const std::string out = *dir_ + "/bad";
  std::filesystem::remove_all(out);
  const struct {
    std::string policies, extra, message;
  } cases[] = {
      {"lru:budget=4", "", "unknown policy 'lru'"},
      {"h2o", "", "needs budget=N or ratio=R"},
      {"tova:budget=8,ratio=0.5", "", "exactly one of budget=N"},
      {"snapkv:ratio=2", "", "ratio must be in (0, 1]"},
      {"h2o:budget=8", "--shard 2/2", "needs 0 <= I < N"},
      {"h2o:budget=8", "--shard 1/", "--shard expects I/N"},
      {"h2o:budget=8", "--shard \" 1/2\"", "--shard expects I/N"},
      {"h2o:budget=8", "--shard +1/2", "--shard expects I/N"},
      {"h2o:budget=8", "--shard 1/2x", "--shard expects I/N"},
      {"h2o:budget=8", "--shard 0/99999999999999999999", "--shard expects I/N"},
      {"h2o:budget=8", "--rows 4:99", "outside the task's 6 rows"},
      {"h2o:budget=8,h2o:budget=8", "", "listed twice"},
  };
  for (const auto& c : cases) {
    const auto r = RunEval(out, c.policies, c.extra);
    EXPECT_NE(r.exit_code, 0) << c.policies << " " << c.extra;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << c.policies << " " << c.extra << ": " << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(out + "/config.yaml"))
      << "nothing is written for a refused evaluation";
}

}  // namespace
}  // namespace namm::worker
