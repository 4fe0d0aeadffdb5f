// Running tasks end to end on stories260K: synthetic rows built by the model, teacher-forced scoring checked
// against a direct computation, LongBench rows through prompt building, truncation, generation and scoring.
#include "namm/worker/task_runner.h"

#include <ATen/ops/log_softmax.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "../namm_core/test_util.h"
#include "../process_util.h"
#include "namm/file_util.h"
#include "namm/policies/full_cache_policy.h"
#include "namm/tasks/normalized_score.h"
#include "namm/worker/synthetic_stories.h"
#include "shared_data.h"

namespace namm::worker {
namespace {

using testing::SharedPath;

struct Stories {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

Stories Load(const std::string& rope = "") {
  LoadOptions options;
  if (!rope.empty()) options.rope_scaling = *RopeScaling::Parse(rope);
  auto model = LlamaModel::Load(SharedPath(testing::kStoriesModel), options);
  auto tokenizer = load_tokenizer(SharedPath(testing::kStoriesTokenizer));
  EXPECT_TRUE(model.ok() && tokenizer.ok());
  return {std::make_unique<LlamaModel>(std::move(model).value()), std::move(tokenizer).value()};
}

StoryRecallOptions SmallStories() {
  StoryRecallOptions o;
  o.rows = 6;
  o.pool = 5;
  o.story_tokens = 120;
  o.prefix_tokens = 80;
  o.continuation_tokens = 30;
  o.distractor_tokens = 700;
  return o;
}

TEST(Sampling, SeededBannedAndDeterministic) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = Load();
  FullCachePolicy full;
  GenerationOptions g;
  g.max_new_tokens = 80;
  g.temperature = 1.0;
  g.seed = 11;
  g.banned_ids = {2};  // EOS
  Generator generator(*s.model, *s.tokenizer);
  auto a = generator.Generate({1}, full, g), b = generator.Generate({1}, full, g);
  g.seed = 12;
  auto c = generator.Generate({1}, full, g);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->token_ids, b->token_ids);
  EXPECT_NE(a->token_ids, c->token_ids);
  EXPECT_EQ(a->token_ids.size(), 80u);  // EOS banned: the full length
  EXPECT_EQ(std::count(a->token_ids.begin(), a->token_ids.end(), 2), 0);
}

TEST(StoryRecall, RowsAreDeterministicAndWellFormed) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = Load();
  const StoryRecallOptions o = SmallStories();
  auto rows = build_story_recall_rows(*s.model, *s.tokenizer, o);
  auto again = build_story_recall_rows(*s.model, *s.tokenizer, o);
  ASSERT_TRUE(rows.ok() && again.ok()) << rows.status().ToString();
  ASSERT_EQ(rows->size(), 6u);
  EXPECT_EQ(*rows, *again);
  for (const auto& row : *rows) {
    const auto prompt = row["prompt_ids"].get<std::vector<int64_t>>();
    const auto clean = row["clean_prompt_ids"].get<std::vector<int64_t>>();
    EXPECT_EQ(prompt.size(), 1u + 700 + 1 + 80);  // BOS, distractors, newline, target prefix
    EXPECT_EQ(clean.size(), 1u + 80);
    EXPECT_TRUE(std::equal(clean.begin() + 1, clean.end(), prompt.end() - 80));  // the same target prefix
    EXPECT_EQ(row["continuation_ids"].size(), 30u);
    for (const auto& d : row["distractors"]) EXPECT_NE(d.get<int64_t>(), row["target"].get<int64_t>());
  }
  StoryRecallOptions other = o;
  other.seed = 2;
  EXPECT_NE(*build_story_recall_rows(*s.model, *s.tokenizer, other), *rows);
}

TEST(TaskRunner, TeacherForcedScoresMatchADirectComputation) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = Load();
  auto rows = build_story_recall_rows(*s.model, *s.tokenizer, SmallStories());
  ASSERT_TRUE(rows.ok());
  tasks::TaskSpec task;
  task.name = "syn/test";
  task.prompt_source = tasks::PromptSource::kTokenIds;
  task.max_context = 2048;
  tasks::TaskRow row{0, (*rows)[0]};
  TaskRunner runner(*s.model, *s.tokenizer);
  FullCachePolicy full;
  task.scoring = tasks::Scoring::kLikelihood;
  auto likelihood = runner.Run(task, row, full, {});
  task.scoring = tasks::Scoring::kTokenAccuracy;
  auto accuracy = runner.Run(task, row, full, {});
  ASSERT_TRUE(likelihood.ok() && accuracy.ok()) << likelihood.status().ToString();

  // Directly: one forward over prompt + continuation without a generator.
  std::vector<int64_t> ids = row.fields["prompt_ids"].get<std::vector<int64_t>>();
  const auto continuation = row.fields["continuation_ids"].get<std::vector<int64_t>>();
  const std::size_t prompt_length = ids.size();
  ids.insert(ids.end(), continuation.begin(), continuation.end());
  auto caches = s.model->NewCaches(full);
  auto logits = s.model->Forward(at::from_blob(ids.data(), {static_cast<int64_t>(ids.size())},
                                               at::TensorOptions().dtype(at::kLong)).clone(),
                                 caches, full, /*all_logits=*/true);
  ASSERT_TRUE(logits.ok());
  double nll = 0;
  int64_t right = 0;
  for (std::size_t i = 0; i < continuation.size(); ++i) {
    const at::Tensor l = (*logits)[static_cast<int64_t>(prompt_length + i - 1)];
    nll -= at::log_softmax(l.to(at::kDouble), 0)[continuation[i]].item<double>();
    right += l.argmax().item<int64_t>() == continuation[i];
  }
  EXPECT_NEAR(likelihood->score, std::exp(-nll / static_cast<double>(continuation.size())), 1e-5);
  EXPECT_DOUBLE_EQ(accuracy->score, static_cast<double>(right) / static_cast<double>(continuation.size()));
  EXPECT_EQ(likelihood->updates.size(), 1u);  // the sequence crosses 512 once: a memory update ran

  // A one-token continuation is scored from the prompt's last position alone.
  row.fields["continuation_ids"] = std::vector<int64_t>{continuation[0]};
  task.scoring = tasks::Scoring::kLikelihood;
  auto one = runner.Run(task, row, full, {});
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  const at::Tensor first = (*logits)[static_cast<int64_t>(prompt_length - 1)];
  EXPECT_NEAR(one->score, std::exp(at::log_softmax(first.to(at::kDouble), 0)[continuation[0]].item<double>()), 1e-5);

  // An id outside the vocabulary is the row's error, named; its last continuation id is never fed to the model
  // (before: libtorch's "index 99999 is out of bounds" from the scoring's gather, naming nothing).
  for (const auto& [field, given] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"continuation_ids", {continuation[0], 99999}}, {"continuation_ids", {-1}},
           {"continuation_ids", {18446744073709551615ull}}, {"prompt_ids", {1, 512}}}) {
    tasks::TaskRow bad = row;
    bad.fields[field] = given;
    auto refused = runner.Run(task, bad, full, {});
    ASSERT_FALSE(refused.ok()) << given.dump();
    EXPECT_NE(refused.status().message().find("task syn/test row 0: '" + field + "' holds token id " +
                                              given.back().dump() + ", outside the model's vocabulary of 512"),
              std::string::npos)
        << refused.status().ToString();
  }
}

TEST(TaskRunner, CleanContextBeatsDistractorsUnderPlainRope) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = Load("none");
  auto rows = build_story_recall_rows(*s.model, *s.tokenizer, SmallStories());
  ASSERT_TRUE(rows.ok());
  tasks::TaskSpec task;
  task.name = "syn/test";
  task.prompt_source = tasks::PromptSource::kTokenIds;
  task.scoring = tasks::Scoring::kLikelihood;
  task.max_context = 2048;
  TaskRunner runner(*s.model, *s.tokenizer);
  FullCachePolicy full;
  double distracted = 0, clean = 0;
  for (std::size_t i = 0; i < rows->size(); ++i) {
    const tasks::TaskRow row{static_cast<int64_t>(i), (*rows)[i]};
    TaskRunOptions with_distractors, without;
    without.clean_context = true;
    distracted += runner.Run(task, row, full, with_distractors)->score;
    clean += runner.Run(task, row, full, without)->score;
  }
  EXPECT_GT(clean, distracted);  // the room a memory policy can win back
}

TEST(TaskRunner, GptTwoTokenLengthsOfTheSharedLongBenchSubsets) {
  NAMM_REQUIRE_SHARED("data/longbench/dureader.jsonl");
  auto gpt2 = load_tokenizer(SharedPath(testing::kGpt2Tokenizer));
  ASSERT_TRUE(gpt2.ok());
  for (const char* name : {"lb/dureader", "lb/multifieldqa_zh", "lb/passage_retrieval_zh", "lb/vcsum", "lb/lsht"}) {
    auto task = tasks::find_task(name, tasks::default_task_paths());
    ASSERT_TRUE(task.ok());
    auto rows = tasks::load_rows(*task);
    ASSERT_TRUE(rows.ok());
    std::vector<int64_t> lengths;
    for (const auto& row : *rows) lengths.push_back(static_cast<int64_t>((*gpt2)->Encode(*tasks::build_prompt(*task, row)).value().size()));
    std::sort(lengths.begin(), lengths.end());
    std::printf("%-24s gpt2 tokens: min %6lld  p25 %6lld  median %6lld  p75 %6lld  max %6lld\n", name,
                static_cast<long long>(lengths.front()), static_cast<long long>(lengths[lengths.size() / 4]),
                static_cast<long long>(lengths[lengths.size() / 2]), static_cast<long long>(lengths[3 * lengths.size() / 4]),
                static_cast<long long>(lengths.back()));
    EXPECT_GT(lengths.front(), 500) << name;  // long-context prompts
    // Middle truncation to 4096 tokens keeps every prompt within a few tokens of the budget.
    const auto& longest = *std::max_element(rows->begin(), rows->end(), [&](const auto& a, const auto& b) {
      return (*tasks::build_prompt(*task, a)).size() < (*tasks::build_prompt(*task, b)).size();
    });
    const auto truncated = encode_truncated_middle(**gpt2, *tasks::build_prompt(*task, longest), 4096).value();
    EXPECT_LE(std::abs(static_cast<int64_t>(truncated.size()) - 4096), 8) << name;
  }
}

TEST(NammWorkerRunTask, LongBenchRowsEndToEndOnStories260K) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  NAMM_REQUIRE_SHARED("data/longbench/passage_retrieval_zh.jsonl");
  const auto run = testing::RunProcess(std::string(NAMM_WORKER_PATH) + " run-task --model " +
                                       SharedPath(testing::kStoriesModel) + " --tokenizer " +
                                       SharedPath(testing::kStoriesTokenizer) +
                                       " --task lb/passage_retrieval_zh --rows 0:2 --rope-scaling ntk:factor=4,alpha=2 "
                                       "--policy h2o:budget=256 --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto j = nlohmann::json::parse(run.output);
  EXPECT_EQ(j["task"], "lb/passage_retrieval_zh");
  ASSERT_EQ(j["rows"].size(), 2u);
  auto task = tasks::find_task("lb/passage_retrieval_zh", tasks::default_task_paths());
  ASSERT_TRUE(task.ok());
  auto rows = tasks::load_rows(*task);
  ASSERT_TRUE(rows.ok());
  auto tokenizer = load_tokenizer(SharedPath(testing::kStoriesTokenizer));
  ASSERT_TRUE(tokenizer.ok());
  for (const auto& row : j["rows"]) {
    // Truncated in the middle exactly as the reference does, to the 2048-token context minus 32 new tokens
    // (re-encoding may leave it a few tokens over; generation then runs that far past the context).
    const auto text = tasks::build_prompt(*task, (*rows)[static_cast<std::size_t>(row["row"].get<int64_t>())]);
    ASSERT_TRUE(text.ok());
    EXPECT_EQ(row["prompt_tokens"].get<int64_t>(),
              static_cast<int64_t>(encode_truncated_middle(**tokenizer, *text, 2048 - 32).value().size()));
    EXPECT_GE(row["score"].get<double>(), 0.0);
    EXPECT_EQ(row["final_cache_sizes"].size(), 5u);
    EXPECT_LE(row["final_cache_sizes"][0].get<int64_t>(), 256 + 512);
    EXPECT_TRUE(row.contains("prediction"));
  }
}

TEST(NammWorkerRunTask, SyntheticTaskFromBuiltRows) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const std::string dir = testing::TempPath("synthetic");
  std::system(("mkdir -p " + dir).c_str());
  const std::string model = " --model " + SharedPath(testing::kStoriesModel) + " --tokenizer " +
                            SharedPath(testing::kStoriesTokenizer);
  auto build = testing::RunProcess(std::string(NAMM_WORKER_PATH) + " build-synthetic" + model + " --out " + dir +
                                   "/story_recall.jsonl --rows 3 --pool 3 --story-tokens 100 --prefix-tokens 60 "
                                   "--continuation-tokens 20 --distractor-tokens 500");
  ASSERT_EQ(build.exit_code, 0) << build.output;
  auto run = testing::RunProcess(std::string(NAMM_WORKER_PATH) + " run-task" + model +
                                 " --task syn/story_recall --data-dir synthetic=" + dir + " --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto j = nlohmann::json::parse(run.output);
  EXPECT_EQ(j["scoring"], "likelihood");
  ASSERT_EQ(j["rows"].size(), 3u);
  for (const auto& row : j["rows"]) {
    EXPECT_GT(row["score"].get<double>(), 0.0);
    EXPECT_LE(row["score"].get<double>(), 1.0);
    EXPECT_EQ(row["prompt_tokens"], 1 + 500 + 1 + 60);
  }
  // Base-model scores recorded as reference scores, merged into the file row by row.
  const std::string refs = dir + "/reference.json";
  for (const char* rows : {"0:2", "2"}) {
    auto record = testing::RunProcess(std::string(NAMM_WORKER_PATH) + " run-task" + model + " --task syn/story_recall" +
                                      " --data-dir synthetic=" + dir + " --rows " + rows + " --record-reference " + refs);
    ASSERT_EQ(record.exit_code, 0) << record.output;
  }
  auto recorded = tasks::ReferenceScores::Load(refs);
  ASSERT_TRUE(recorded.ok());
  ASSERT_EQ(recorded->scores().at("syn/story_recall").size(), 3u);
  EXPECT_DOUBLE_EQ(*recorded->Get("syn/story_recall", 2), j["rows"][2]["score"].get<double>());
  auto not_base = testing::RunProcess(std::string(NAMM_WORKER_PATH) + " run-task" + model + " --task syn/story_recall" +
                                      " --data-dir synthetic=" + dir + " --policy l2:budget=64 --record-reference " + refs);
  EXPECT_NE(not_base.exit_code, 0);
  EXPECT_NE(not_base.output.find("--policy full"), std::string::npos);

  auto missing = testing::RunProcess(std::string(NAMM_WORKER_PATH) + " run-task" + model + " --task syn/story_recall");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("no data directory for benchmark 'synthetic'"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace namm::worker
