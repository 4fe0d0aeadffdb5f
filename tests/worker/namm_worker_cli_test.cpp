// namm-worker generate as a user runs it.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "../chromium.h"
#include "../namm_core/test_util.h"
#include "../process_util.h"
#include "namm/file_util.h"
#include "namm/worker/tokenizer.h"
#include "shared_data.h"

namespace namm::worker {
namespace {

using testing::SharedPath;

testing::ProcessResult Worker(const std::string& args) {
  return testing::RunProcess(std::string(NAMM_WORKER_PATH) + " " + args);
}

std::string StoriesArgs() {
  return "generate --model " + SharedPath(testing::kStoriesModel) + " --tokenizer " + SharedPath(testing::kStoriesTokenizer);
}

std::string LongPromptFile() {
  std::string text;
  for (int i = 0; i < 40; ++i) text += "Once upon a time, there was a little girl named Lily. She loved to play outside. ";
  const std::string path = testing::TempPath("long_prompt.txt");
  EXPECT_TRUE(write_file_atomically(path, {text}).ok());
  return path;
}

TEST(NammWorkerCli, GeneratesTheKnownStory) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  auto run = Worker(StoriesArgs() + " --prompt 'Once upon a time' --max-new-tokens 20");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(run.output.rfind(", there was a little girl named Lily.", 0), 0u) << run.output;
}

// llama2.c's run.c ends a sequence at BOS, which delimits the TinyStories: the story ends there (it ran on into
// another story, "Once upon a time" again, until the token limit, the BOS dropped from the text).
TEST(NammWorkerCli, AStoryEndsAtTheBosThatDelimitsIt) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  auto run = Worker(StoriesArgs() + " --prompt 'Once upon a time' --max-new-tokens 400 --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const nlohmann::json report = nlohmann::json::parse(run.output);
  EXPECT_EQ(report["stop_reason"], "eos");
  EXPECT_LT(report["generated_tokens"].get<int64_t>(), 400);
  const std::string text = report["text"];
  EXPECT_EQ(text.find("Once upon a time"), std::string::npos) << text;
  const std::string end = "You are a good friend.\"";
  ASSERT_GE(text.size(), end.size());
  EXPECT_EQ(text.substr(text.size() - end.size()), end) << text;
}

TEST(NammWorkerCli, ChatFormatsThePromptWithTheModelsTemplate) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  // The stories tokenizer, with a chat template beside it.
  const std::string dir = testing::TempPath("chat_tokenizer");
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(SharedPath(testing::kStoriesTokenizer), dir + "/tok512.bin",
                             std::filesystem::copy_options::overwrite_existing);
  const std::string config = R"({"chat_template": "{% for m in messages %}{{ m.content }}, said the {{ m.role }}.{% endfor %}"})";
  ASSERT_TRUE(write_file_atomically(dir + "/tokenizer_config.json", {config}).ok());
  const std::string args = "generate --model " + SharedPath(testing::kStoriesModel) + " --tokenizer " + dir +
                           "/tok512.bin --prompt 'Once upon a time' --max-new-tokens 4 --json";
  auto chat = Worker(args + " --chat");
  ASSERT_EQ(chat.exit_code, 0) << chat.output;
  auto plain = Worker(args);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  auto tokenizer = load_tokenizer(dir + "/tok512.bin");
  ASSERT_TRUE(tokenizer.ok());
  // The rendered turn, encoded as the template wrote it (no BOS of the tokenizer's own); plain: BOS + the text.
  EXPECT_EQ(nlohmann::json::parse(chat.output)["prompt_tokens"].get<std::size_t>(),
            (*tokenizer)->Encode("Once upon a time, said the user.").value().size());
  EXPECT_EQ(nlohmann::json::parse(plain.output)["prompt_tokens"].get<std::size_t>(),
            (*tokenizer)->EncodeForModel("Once upon a time").value().size());

  // No template beside the tokenizer: refused, naming what is missing.
  auto missing = Worker(StoriesArgs() + " --prompt 'Once upon a time' --chat");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("chat"), std::string::npos) << missing.output;
}

TEST(NammWorkerCli, JsonReportWithANammAtFourTimesTheContext) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const std::string namm = testing::TempPath("cli_zero.safetensors");
  ASSERT_EQ(testing::RunProcess(std::string(NAMM_TOOL_PATH) + " init --arch bam --zero --force --out " + namm).exit_code, 0);
  auto run = Worker(StoriesArgs() + " --prompt-file " + LongPromptFile() +
                    " --rope-scaling ntk:factor=4,alpha=2 --namm " + namm + " --max-new-tokens 8 --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto j = nlohmann::json::parse(run.output);
  EXPECT_GT(j["prompt_tokens"].get<int64_t>(), 1024);
  ASSERT_EQ(j["memory_updates"].size(), 2u);
  EXPECT_EQ(j["memory_updates"][1]["sequence_length"], 1024);
  EXPECT_EQ(j["memory_updates"][1]["cache_sizes"][0], 1024);  // a zero NAMM keeps everything
  EXPECT_EQ(j["final_cache_sizes"].size(), 5u);
  EXPECT_EQ(j["token_ids"].size(), 8u);
  EXPECT_GT(j["prefill_tokens_per_second"].get<double>(), 0);
  EXPECT_GT(j["peak_kv_bytes"].get<int64_t>(), 0);
  // Everything kept: the answer's queries saw more than the mean query did, and at most the peak.
  EXPECT_GT(j["answer_kv_tokens"].get<double>(), j["mean_kv_tokens"].get<double>());
  EXPECT_LE(j["answer_kv_tokens"].get<double>(), j["peak_kv_tokens"].get<double>());
  EXPECT_NE(j["policy"].get<std::string>().find("namm("), std::string::npos);
}

// --explain: the page shows every token, shaded from the recorded evictions; what it says is held at the end
// adds up to the final cache of every layer and head.
TEST(NammWorkerCli, ExplainDrawsWhatThePolicyKept) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  std::string text;
  for (int i = 0; i < 12; ++i) text += "Once upon a time, there was a little girl named Lily. She loved to play outside. ";
  const std::string prompt = testing::TempPath("explain_prompt.txt"), page = testing::TempPath("explain.html");
  ASSERT_TRUE(write_file_atomically(prompt, {text}).ok());
  std::filesystem::remove(page);
  auto run = Worker(StoriesArgs() + " --prompt-file " + prompt + " --policy h2o:budget=48 --update-interval 64 "
                    "--chunk-size 32 --max-new-tokens 16 --json --explain " + page);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto j = nlohmann::json::parse(run.output);
  const auto tokens = j["prompt_tokens"].get<std::size_t>() + j["token_ids"].size();
  int64_t held_at_end = 0;
  for (const auto& size : j["final_cache_sizes"]) held_at_end += size.get<int64_t>() * 4;  // 4 KV heads
  const std::string html = testing::ReadText(page);
  EXPECT_EQ(html.find("https://"), std::string::npos) << "self-contained";
  if (!testing::ChromiumInstalled()) GTEST_SKIP() << "chromium is not installed (scripts/install-deps.sh)";
  const std::string dom = testing::RenderedDom(page);
  testing::ExpectRenderedWithCurves(dom, 5);  // a cache-size curve per layer
  EXPECT_NE(dom.find("data-explained=\"-1\""), std::string::npos) << "the tokens were not shaded";
  std::size_t spans = 0, evicted = 0;
  int64_t held = 0;
  for (std::size_t at = dom.find("data-heads-kept=\""); at != std::string::npos;
       at = dom.find("data-heads-kept=\"", at + 1)) {
    const int64_t kept = std::stoll(dom.substr(at + 17));
    ++spans;
    held += kept;
    evicted += kept == 0 ? 1 : 0;
  }
  EXPECT_EQ(spans, tokens);
  EXPECT_EQ(held, held_at_end) << "the page's kept tokens are the final caches";
  EXPECT_GT(evicted, tokens / 4) << "a budget of 48 evicts most of a " << tokens << "-token sequence";
  std::size_t options = 0;
  for (std::size_t at = dom.find("<option"); at != std::string::npos; at = dom.find("<option", at + 1)) ++options;
  EXPECT_EQ(options, 6u) << "all layers and each of the 5";
}

TEST(NammWorkerCli, GeneratesInBfloat16OnTheCpuWithANamm) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const std::string namm = testing::TempPath("cli_bf16.safetensors");
  const auto made = testing::RunProcess(std::string(NAMM_TOOL_PATH) + " init --arch bam --seed 3 --scale 0.1 --force --out " + namm);
  ASSERT_EQ(made.exit_code, 0) << made.output;
  const std::string args = StoriesArgs() + " --prompt-file " + LongPromptFile() +
                           " --rope-scaling ntk:factor=4,alpha=2 --max-new-tokens 8 --json";
  std::map<std::string, nlohmann::json> runs;
  for (const std::string dtype : {"fp32", "bf16"}) {
    for (const std::string& policy : {std::string(), " --namm " + namm}) {
      auto run = Worker(args + " --dtype " + dtype + policy);
      ASSERT_EQ(run.exit_code, 0) << run.output;
      runs[dtype + policy] = nlohmann::json::parse(run.output);
    }
  }
  // The cache is kept in the compute dtype: half the bytes in bfloat16.
  EXPECT_EQ(runs["bf16"]["peak_kv_bytes"].get<int64_t>() * 2, runs["fp32"]["peak_kv_bytes"].get<int64_t>());
  // The NAMM runs its whole pipeline (features in float32) on a bfloat16 model and updates the memory.
  const nlohmann::json& bf16_namm = runs["bf16 --namm " + namm];
  EXPECT_EQ(bf16_namm["memory_updates"].size(), runs["fp32 --namm " + namm]["memory_updates"].size());
  EXPECT_GT(bf16_namm["memory_updates"].size(), 0u);
  EXPECT_EQ(bf16_namm["token_ids"].size(), 8u);

  auto half = Worker(StoriesArgs() + " --prompt 'Once' --dtype fp16");
  EXPECT_NE(half.exit_code, 0);
  EXPECT_NE(half.output.find("--dtype fp16 needs a CUDA device; on the CPU use bf16 or fp32"), std::string::npos)
      << half.output;
}

// The worker daemon drains on SIGTERM whichever thread the kernel hands the signal to: OpenBLAS starts its pool
// as the library loads, before main, and a waiter that blocked the signals in the threads started later left
// those with the default action, which killed the worker (exit by signal, no drain, its leases expired).
TEST(NammWorkerCli, ServeDrainsOnSigtermWhicheverThreadTakesIt) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const std::string dir = testing::TempPath("worker_sigterm");
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(write_file_atomically(dir + "/token", {"sim-run-shared-secret-0123456789\n"}).ok());
  const std::string log = dir + "/worker.log";
  std::filesystem::remove(log);
  // No coordinator listens there: the worker serves, retrying the connection, until the signal.
  testing::Child worker = testing::Spawn(
      {NAMM_WORKER_PATH, "serve", "--coordinator", "127.0.0.1:" + std::to_string(testing::FreePort()), "--token-file",
       dir + "/token", "--insecure-plaintext", "--model", SharedPath(testing::kStoriesModel), "--tokenizer",
       SharedPath(testing::kStoriesTokenizer)},
      log);
  ASSERT_TRUE(testing::WaitUntil([&] { return testing::ReadText(log).find(" serving ") != std::string::npos; },
                                 std::chrono::seconds(60)))
      << testing::ReadText(log);
  ::kill(worker.pid, SIGTERM);
  EXPECT_EQ(testing::Wait(worker, std::chrono::seconds(60)), 0) << testing::ReadText(log);
  EXPECT_NE(testing::ReadText(log).find("namm-worker: draining"), std::string::npos) << testing::ReadText(log);
}

TEST(NammWorkerCli, BadInputGetsAClearError) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const std::string long_prompt = LongPromptFile();
  const std::string truncated = testing::TempPath("truncated.bin");
  auto bytes = read_file(SharedPath(testing::kStoriesModel));
  ASSERT_TRUE(write_file_atomically(truncated, {std::string_view(*bytes).substr(0, 4000)}).ok());
  struct Case {
    std::string args, message;
  };
  const std::string tok = " --tokenizer " + SharedPath(testing::kStoriesTokenizer);
  const std::vector<Case> cases = {
      {"generate --model /nonexistent/model.bin" + tok + " --prompt hi", "no such file"},
      {"generate --model " + truncated + tok + " --prompt hi", "the header implies"},
      {StoriesArgs() + " --prompt-file " + long_prompt, "pass --truncate"},
      {StoriesArgs() + " --prompt hi --policy h2o", "h2o needs exactly one of budget=N"},
      {StoriesArgs() + " --prompt hi --policy lru:budget=3", "unknown policy 'lru'"},
      {StoriesArgs() + " --prompt hi --rope-scaling ntk:alpha=2", "factor=F is required"},
      {StoriesArgs() + " --prompt hi --chunk-size 100", "must be positive and divide"},
      {StoriesArgs() + " --prompt hi --device cuda:0", "CUDA"},
      {"generate --model " + SharedPath(testing::kStoriesModel) + " --prompt hi", "--tokenizer is required"},
      // An empty stop string ended every answer after one token; an empty --prompt was called missing.
      {StoriesArgs() + " --prompt hi --stop ''", "an empty stop string would end every answer at once"},
      {StoriesArgs() + " --prompt ''", "the prompt is empty"},
      {StoriesArgs() + " --prompt hi --threads 100000", "--threads"},
      // A cache no machine can reserve: one line (libtorch's message came with a 20-frame backtrace).
      {StoriesArgs() + " --prompt hi --max-new-tokens 1000000000000000 --max-context 2000000000000000",
       "allocate"},
  };
  // build-synthetic: a NaN temperature sampled greedily (every seed the same stories), seeds wrapped or clamped
  // into each other, lengths overflowed their sums or grew memory without end, and options of the other family
  // were ignored.
  const std::string synthetic = "build-synthetic --model " + SharedPath(testing::kStoriesModel) + tok + " --out " +
                                testing::TempPath("synthetic-refused.jsonl") + " --rows 2 --pool 2 --story-tokens 20";
  const std::vector<Case> synthetic_cases = {
      {synthetic + " --temperature nan", "temperature must be a positive finite number"},
      {synthetic + " --temperature inf", "temperature must be a positive finite number"},
      {synthetic + " --seed -1", "--seed expects an integer in 0..18446744073709551615, got '-1'"},
      {synthetic + " --seed 18446744073709551616", "--seed expects an integer"},
      {synthetic + " --seed 0x10", "--seed expects an integer"},
      {synthetic + " --prefix-tokens 9223372036854775807 --continuation-tokens 1", "the prefix must be at most"},
      {synthetic + " --family interruption --resume-range 0:9223372036854775807", "the resumption must be at most"},
      {synthetic + " --family interruption --interruption-range 1:9223372036854775807 --kind random",
       "the interruption must be at most"},
      {synthetic + " --distractor-tokens 9223372036854775807", "the distractors must be at most"},
      {synthetic + " --kind random", "--kind applies to --family interruption only, not story_recall"},
      {synthetic + " --family interruption --distractor-tokens 5", "--distractor-tokens applies to --family story_recall"},
      {synthetic + " --rows 0", "not in range 1 to 1048576"},
  };
  std::vector<Case> all = cases;
  all.insert(all.end(), synthetic_cases.begin(), synthetic_cases.end());
  for (const auto& c : all) {
    auto run = Worker(c.args);
    EXPECT_NE(run.exit_code, 0) << c.args;
    EXPECT_NE(run.output.find(c.message), std::string::npos) << c.args << "\n" << run.output;
    EXPECT_EQ(run.output.find("frame #"), std::string::npos) << "a backtrace: " << c.args << "\n" << run.output;
  }
  // With --truncate the long prompt is cut in the middle exactly as the reference cuts it, to 512 - 128 tokens
  // before BOS and re-encoding (which may add a few): no second cut.
  auto fits = Worker(StoriesArgs() + " --prompt-file " + long_prompt + " --truncate --json");
  ASSERT_EQ(fits.exit_code, 0) << fits.output;
  auto tokenizer = load_tokenizer(SharedPath(testing::kStoriesTokenizer));
  ASSERT_TRUE(tokenizer.ok());
  auto text = read_file(long_prompt);
  ASSERT_TRUE(text.ok());
  const auto expected = encode_truncated_middle(**tokenizer, *text, 384).value();
  EXPECT_EQ(nlohmann::json::parse(fits.output)["prompt_tokens"].get<int64_t>(), static_cast<int64_t>(expected.size()));
}

// `cmake --install` puts the programs and the task definitions side by side, and an installed program finds
// its task definitions there without --tasks-dir (here: a task only the installed copy defines).
TEST(NammWorkerCli, AnInstalledWorkerFindsTheInstalledTaskDefinitions) {
  const std::string prefix = testing::TempPath("install");
  std::filesystem::remove_all(prefix);
  const auto installed = testing::RunProcess("cmake --install " + std::string(NAMM_BUILD_DIR) + " --prefix " + prefix);
  ASSERT_EQ(installed.exit_code, 0) << installed.output;
  const std::string tasks = prefix + "/share/namm/tasks/synthetic.yaml";
  std::string yaml = read_file(tasks).value();
  for (std::size_t at; (at = yaml.find("name: syn/")) != std::string::npos;) yaml.replace(at, 10, "name: installed/");
  ASSERT_TRUE(write_file_atomically(tasks, {yaml}).ok());

  const std::string data = testing::TempPath("install_data");
  const std::string model = " --model " + SharedPath(testing::kStoriesModel) + " --tokenizer " +
                            SharedPath(testing::kStoriesTokenizer);
  ASSERT_EQ(Worker("build-synthetic" + model + " --out " + data + "/story_recall.jsonl --rows 2 --pool 2 "
                   "--story-tokens 60 --prefix-tokens 30 --continuation-tokens 10 --distractor-tokens 0")
                .exit_code,
            0);
  const auto run = testing::RunProcess(prefix + "/bin/namm-worker run-task" + model +
                                       " --task installed/story_recall --data-dir synthetic=" + data + " --rows 0");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  // The build's own binary still reads the source tree, which has no such task.
  EXPECT_NE(Worker("run-task" + model + " --task installed/story_recall --data-dir synthetic=" + data).exit_code, 0);
}

}  // namespace
}  // namespace namm::worker
