// The serve executor keeps the daemon alive through torch failures: out of memory is retried with the prefill
// chunk halved down to a floor, any other torch error becomes the prompt's error, and the next prompt runs.
// Failures are injected before an attempt, as CUDA's allocator would throw them (none can be caused on CPU).
#include "namm/worker/namm_executor.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <random>

#include "../process_util.h"
#include "../temp_path.h"
#include "namm/policies/full_cache_policy.h"
#include "namm/policies/namm_policy.h"
#include "shared_data.h"

namespace namm::worker {
namespace {

using testing::SharedPath;

// Synthetic rows of the stories model: `namm-worker build-synthetic ARGS` run in a fresh directory (ARGS' --out
// relative to it), and the task paths that read synthetic data from there.
void BuildRows(const std::string& name, const std::string& args, tasks::TaskPaths* paths) {
  const std::string dir = testing::TempPath(name);
  std::filesystem::create_directories(dir);
  const auto built = testing::RunProcess("cd " + dir + " && " + NAMM_WORKER_PATH + " build-synthetic --model " +
                                         SharedPath(testing::kStoriesModel) + " --tokenizer " +
                                         SharedPath(testing::kStoriesTokenizer) + " " + args);
  ASSERT_EQ(built.exit_code, 0) << built.output;
  *paths = tasks::default_task_paths();
  paths->data_dirs["synthetic"] = dir;
}

TEST(NammExecutor, OutOfMemoryRetriesWithHalvedChunksAndOtherTorchErrorsBecomePromptErrors) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  tasks::TaskPaths paths;
  ASSERT_NO_FATAL_FAILURE(BuildRows("executor_faults", "--rows 2 --pool 2 --story-tokens 100 --prefix-tokens 60 "
                                    "--continuation-tokens 20 --distractor-tokens 300 --out story_recall.jsonl", &paths));
  auto model = LlamaModel::Load(SharedPath(testing::kStoriesModel), LoadOptions{});
  auto tokenizer = load_tokenizer(SharedPath(testing::kStoriesTokenizer));
  ASSERT_TRUE(model.ok() && tokenizer.ok());
  const tasks::TaskSpec task = tasks::find_task("syn/story_recall", paths).value();
  const std::vector<tasks::TaskRow> rows = tasks::load_rows(task).value();

  std::vector<int64_t> chunks;
  int out_of_memory = 2;
  bool other_error = false;
  std::vector<std::size_t> batch_sizes;
  std::size_t out_of_memory_above = 1000;  // batches larger than this run out of memory
  NammExecutor executor(*model, **tokenizer, paths, [&](const std::vector<PromptJob>& jobs, int64_t chunk) {
    chunks.push_back(chunk);
    batch_sizes.push_back(jobs.size());
    if (jobs.size() > out_of_memory_above) C10_THROW_ERROR(OutOfMemoryError, "CUDA out of memory (batch, injected)");
    if (other_error) C10_THROW_ERROR(Error, "an injected kernel failure\nwith context on a second line");
    if (out_of_memory-- > 0) C10_THROW_ERROR(OutOfMemoryError, "CUDA out of memory (injected)");
  });
  LeaseWork lease;
  lease.reference = true;
  lease.task = "syn/story_recall";
  const auto run_one = [&](int64_t prompt) { return std::move(executor.RunPrompts({{&lease, prompt}}, 0).front()); };

  // Two out-of-memory failures: the third attempt, at a quarter of the chunk, succeeds.
  const int64_t chunk = effective_chunk_size(task, TaskRunOptions{});
  const Result<PromptOutcome> retried = run_one(0);
  ASSERT_TRUE(retried.ok()) << retried.status().ToString();
  EXPECT_EQ(chunks, (std::vector<int64_t>{chunk, chunk / 2, chunk / 4}));
  FullCachePolicy full;
  TaskRunOptions quarter;
  quarter.chunk_size = chunk / 4;
  const PromptResult direct = TaskRunner(*model, **tokenizer).Run(task, rows[0], full, quarter).value();
  EXPECT_DOUBLE_EQ(retried->score, direct.score) << "the retry ran at the smaller chunk";

  // Out of memory at every size: a clear error once the floor is reached.
  chunks.clear();
  out_of_memory = 1000;
  const Result<PromptOutcome> exhausted = run_one(1);
  ASSERT_FALSE(exhausted.ok());
  EXPECT_EQ(chunks.back(), NammExecutor::kMinChunkSize);
  EXPECT_NE(exhausted.status().message().find("out of memory on syn/story_recall prompt 1 even with a prefill chunk "
                                               "of 16 tokens: CUDA out of memory (injected)"),
            std::string::npos)
      << exhausted.status().ToString();

  // Another torch error: no retry, the prompt's error names it (first line only).
  chunks.clear();
  out_of_memory = 0;
  other_error = true;
  const Result<PromptOutcome> failed = run_one(1);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(chunks.size(), 1u);
  EXPECT_NE(failed.status().message().find("torch failed on syn/story_recall prompt 1: an injected kernel failure"),
            std::string::npos)
      << failed.status().ToString();
  EXPECT_EQ(failed.status().message().find("second line"), std::string::npos);

  // The executor goes on serving.
  other_error = false;
  EXPECT_TRUE(run_one(1).ok());

  // An error that one prompt causes in a batch fails that prompt only: the batch is run again in halves down to
  // it (every prompt of the batch was failed with it, and a worker batching it was quarantined for it).
  bool poison = true;  // prompt 1 fails wherever it runs
  NammExecutor poisoned(*model, **tokenizer, paths, [&](const std::vector<PromptJob>& jobs, int64_t) {
    const bool holds = std::any_of(jobs.begin(), jobs.end(), [](const PromptJob& job) { return job.prompt == 1; });
    if (poison && holds) C10_THROW_ERROR(Error, "an injected failure of prompt 1");
  });
  const std::vector<Result<PromptOutcome>> isolated =
      poisoned.RunPrompts({{&lease, 0}, {&lease, 1}, {&lease, 0}, {&lease, 0}}, 0);
  ASSERT_EQ(isolated.size(), 4u);
  ASSERT_FALSE(isolated[1].ok());
  EXPECT_NE(isolated[1].status().message().find("torch failed on syn/story_recall prompt 1: an injected failure"),
            std::string::npos)
      << isolated[1].status().ToString();
  poison = false;
  const Result<PromptOutcome> zero_alone = run_one(0);
  ASSERT_TRUE(zero_alone.ok());
  for (std::size_t j : {0, 2, 3}) {
    ASSERT_TRUE(isolated[j].ok()) << j << ": " << isolated[j].status().ToString();
    EXPECT_EQ(isolated[j]->score, zero_alone->score) << j;
  }

  // A batch of four that runs out of memory above two prompts is split in halves, each run at the full chunk,
  // and every prompt gets what it gets alone; a prompt that does not exist fails alone.
  chunks.clear();
  batch_sizes.clear();
  out_of_memory_above = 2;
  const std::vector<Result<PromptOutcome>> split = executor.RunPrompts({{&lease, 0}, {&lease, 1}, {&lease, 7}, {&lease, 0}, {&lease, 1}}, 0);
  ASSERT_EQ(split.size(), 5u);
  EXPECT_EQ(batch_sizes, (std::vector<std::size_t>{4, 2, 2}));
  EXPECT_EQ(chunks, (std::vector<int64_t>{chunk, chunk, chunk}));
  ASSERT_FALSE(split[2].ok());
  EXPECT_NE(split[2].status().message().find("prompt 7 does not exist"), std::string::npos);
  out_of_memory_above = 1000;
  for (std::size_t j : {0, 1, 3, 4}) {
    ASSERT_TRUE(split[j].ok()) << split[j].status().ToString();
    const Result<PromptOutcome> alone = run_one(j % 3 == 0 ? 0 : 1);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(split[j]->score, alone->score) << j;
    EXPECT_EQ(split[j]->cache_size_mean, alone->cache_size_mean) << j;
  }
}
// A lease on a task variant ("syn/interruption@budget=8", evolution over budgets) runs the candidate with its
// cache held to that budget: the same outcome as the NAMM with the knob budget=8 run directly, and a smaller
// cache than the same candidate with its own selection on the same prompt.
TEST(NammExecutor, ATaskVariantRunsTheCandidateAtItsBudget) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  tasks::TaskPaths paths;
  ASSERT_NO_FATAL_FAILURE(BuildRows("executor_variant", "--family interruption --rows 1 --pool 2 --story-tokens 110 "
                                    "--prefix-range 20:40 --interruption-range 60:80 --resume-range 0:8 "
                                    "--continuation-tokens 16 --out interruption.jsonl", &paths));
  auto model = LlamaModel::Load(SharedPath(testing::kStoriesModel), LoadOptions{});
  auto tokenizer = load_tokenizer(SharedPath(testing::kStoriesTokenizer));
  ASSERT_TRUE(model.ok() && tokenizer.ok());

  NammModel namm;
  namm.architecture.scorer.kind = ScorerKind::kBam;
  namm.params = initial_params(namm.architecture);
  std::mt19937 draw(5);
  std::normal_distribution<float> noise(0.0f, 0.3f);
  for (float& p : namm.params) p += noise(draw);  // a candidate whose scores keep some tokens and drop others
  namm.norm_state = NormState::kFrozen;
  NammExecutor executor(*model, **tokenizer, paths);
  ASSERT_TRUE(executor.Prepare(RunInfo{"variants", namm.architecture.ToJson(), ""}).ok());
  const auto run = [&](const std::string& task) {
    LeaseWork lease;
    lease.task = task;
    lease.params = std::make_shared<const std::vector<float>>(namm.params);
    return std::move(executor.RunPrompts({{&lease, 0}}, 0).front());
  };
  const Result<PromptOutcome> own = run("syn/interruption"), eight = run("syn/interruption@budget=8");
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  ASSERT_TRUE(eight.ok()) << eight.status().ToString();

  auto policy = NammPolicy::Create(namm, at::kCPU).value();
  policy->set_observe_from_query_history(true);
  ASSERT_TRUE(policy->set_selection_knob({int64_t{8}, std::nullopt, std::nullopt}).ok());
  const tasks::TaskSpec task = tasks::find_task("syn/interruption", paths).value();
  const std::vector<tasks::TaskRow> rows = tasks::load_rows(task).value();
  const PromptResult direct = TaskRunner(*model, **tokenizer).Run(task, rows[0], *policy, TaskRunOptions{}).value();
  EXPECT_EQ(eight->score, direct.score);
  EXPECT_EQ(eight->cache_size_mean, direct.mean_kv_tokens);
  EXPECT_LT(eight->cache_size_mean, own->cache_size_mean);

  EXPECT_NE(run("syn/interruption@budget=0").status().message().find("budget > 0"), std::string::npos);
}

// Batches sized by memory (serve's --max-kv-bytes, the caches in blocks of one pool): six full-cache prompts
// on a pool that holds two of them. The first time their sizes are unknown: they run together, those that find
// the pool dry run again with fewer beside them, and every outcome is the one without a pool. The second time
// each is counted at what it held: batches of two, none finds the pool dry, the same outcomes.
TEST(NammExecutor, BatchesAreSizedByTheKvMemoryEachPromptHeld) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  tasks::TaskPaths paths;
  ASSERT_NO_FATAL_FAILURE(BuildRows("executor_memory", "--rows 6 --pool 6 --story-tokens 100 --prefix-tokens 60 "
                                    "--continuation-tokens 20 --distractor-tokens 300 --out story_recall.jsonl", &paths));
  auto model = LlamaModel::Load(SharedPath(testing::kStoriesModel), LoadOptions{});
  auto tokenizer = load_tokenizer(SharedPath(testing::kStoriesTokenizer));
  ASSERT_TRUE(model.ok() && tokenizer.ok());
  LeaseWork lease;
  lease.reference = true;
  lease.task = "syn/story_recall";
  std::vector<PromptJob> jobs;
  for (int64_t p = 0; p < 6; ++p) jobs.push_back({&lease, p});
  const std::vector<Result<PromptOutcome>> unlimited = NammExecutor(*model, **tokenizer, paths).RunPrompts(jobs, 0);

  // One prompt's full cache: its tokens per KV head, in blocks of 16, on 5 layers x 4 KV heads of 1 KiB blocks.
  ASSERT_TRUE(unlimited[0].ok()) << unlimited[0].status().ToString();
  const int64_t tokens = unlimited[0]->prompt_tokens + unlimited[0]->generated_tokens;
  const int64_t one = ((tokens + 15) / 16 + 1) * 5 * 4 * 1024;
  ASSERT_TRUE(use_kv_blocks(*model, 16, 2 * one + one / 2).ok());
  std::vector<std::size_t> batches;
  NammExecutor executor(*model, **tokenizer, paths,
                        [&](const std::vector<PromptJob>& attempt, int64_t) { batches.push_back(attempt.size()); });
  for (const char* round : {"unknown sizes", "sizes seen"}) {
    SCOPED_TRACE(round);
    batches.clear();
    const std::vector<Result<PromptOutcome>> outcomes = executor.RunPrompts(jobs, 0);
    ASSERT_EQ(outcomes.size(), jobs.size());
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      ASSERT_TRUE(outcomes[i].ok() && unlimited[i].ok()) << outcomes[i].status().ToString();
      EXPECT_EQ(outcomes[i]->score, unlimited[i]->score);
      EXPECT_EQ(outcomes[i]->generated_tokens, unlimited[i]->generated_tokens);
    }
    EXPECT_EQ(model->kv_block_pool()->blocks_in_use(), 0);
  }
  EXPECT_EQ(batches, (std::vector<std::size_t>{2, 2, 2}));
  ASSERT_TRUE(use_kv_blocks(*model, 0, 0).ok());
}

}  // namespace
}  // namespace namm::worker


