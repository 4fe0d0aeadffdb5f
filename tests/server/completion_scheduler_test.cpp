// namm-api's scheduler without HTTP: a stream's pieces add up to the whole answer, whatever the tokenizer does to
// text already decoded (GPT-2's cleans up spaces before punctuation once the next token arrives); requests join
// the batch only as their KV caches fit (--max-kv-bytes).
#include "namm/server/completion_scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../server/src/api_metrics.h"
#include "../namm_core/test_util.h"
#include "../temp_path.h"
#include "../worker/shared_data.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/tokenizer.h"

namespace namm::server {
namespace {

// The text a handle streams until it finishes, and the answer it finishes with.
std::pair<std::string, std::string> StreamedAndWhole(CompletionHandle& handle) {
  std::string streamed;
  while (true) {
    CompletionUpdate update = handle.Wait(std::chrono::milliseconds(100));
    streamed += update.text;
    if (update.finished) {
      EXPECT_FALSE(update.error.has_value()) << update.error->message;
      return {streamed, update.outcome.text};
    }
  }
}

// Polls every handle until each has finished, noting the most requests the scheduler ran at once; each handle's
// streamed text and last update (which must carry no error), in order.
std::vector<std::pair<std::string, CompletionUpdate>> FinishAll(const CompletionScheduler& scheduler,
                                                                 const std::vector<std::shared_ptr<CompletionHandle>>& handles,
                                                                 std::size_t* most_running) {
  std::vector<std::pair<std::string, CompletionUpdate>> ends(handles.size());
  std::vector<bool> done(handles.size(), false);
  for (std::size_t finished = 0; finished < handles.size();) {
    *most_running = std::max(*most_running, scheduler.running());
    for (std::size_t i = 0; i < handles.size(); ++i) {
      if (done[i]) continue;
      CompletionUpdate update = handles[i]->Wait(std::chrono::milliseconds(0));
      ends[i].first += update.text;
      if (!update.finished) continue;
      EXPECT_FALSE(update.error.has_value()) << update.error->message;
      ends[i].second = std::move(update);
      done[i] = true;
      ++finished;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return ends;
}

// How a handle finishes (its last update), whatever it streams before.
CompletionUpdate Final(CompletionHandle& handle) {
  while (true) {
    CompletionUpdate update = handle.Wait(std::chrono::milliseconds(100));
    if (update.finished) return update;
  }
}

// Pieces " ", "." and "w" by id, decoded with transformers' clean-up of " ." (as clean_up_tokenization_spaces does):
// sampled ids give a space that is sent and then rewritten by the next token at almost every step.
class CleanUpTokenizer final : public worker::Tokenizer {
 public:
  Result<std::vector<int64_t>> Encode(const std::string&) const override { return std::vector<int64_t>{}; }
  Result<std::vector<int64_t>> EncodeForModel(const std::string&) const override { return std::vector<int64_t>{1}; }
  std::string Decode(const std::vector<int64_t>& ids, bool) const override {
    ++decodes;
    std::string text;
    for (int64_t id : ids) text += id % 3 == 0 ? " " : id % 3 == 1 ? "." : "w";
    for (std::size_t at; (at = text.find(" .")) != std::string::npos;) text.erase(at, 1);
    return text;
  }
  int64_t vocab_size() const override { return 512; }
  std::vector<int64_t> eos_ids() const override { return {}; }
  mutable std::atomic<int64_t> decodes{0};
};

TEST(CompletionScheduler, EveryStreamAddsUpToTheWholeAnswerForEveryTokenizer) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  auto model = worker::LlamaModel::Load(testing::SharedPath(testing::kStoriesModel), worker::LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  // stories260K's ids (< 512) read through GPT-2's byte-level vocabulary are single characters and short pieces,
  // punctuation and spaces among them: its decoder's clean-up rewrites " ." and " ," once the punctuation arrives,
  // after the space may have been sent.
  for (const char* tokenizer_path : {testing::kStoriesTokenizer, testing::kGpt2Tokenizer, "clean-up"}) {
    SCOPED_TRACE(tokenizer_path);
    Result<std::unique_ptr<worker::Tokenizer>> tokenizer =
        std::string(tokenizer_path) == "clean-up" ? std::unique_ptr<worker::Tokenizer>(new CleanUpTokenizer())
                                                  : worker::load_tokenizer(testing::SharedPath(tokenizer_path));
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
    SchedulerOptions options;
    options.chunk_size = 32;
    options.update_interval = 64;
    auto scheduler = CompletionScheduler::Start(*model, **tokenizer, "full", options, nullptr);
    ASSERT_TRUE(scheduler.ok()) << scheduler.status().ToString();
    int punctuated = 0;  // answers where the clean-up had something to do
    for (uint64_t seed = 1; seed <= 24; ++seed) {
      CompletionJob job;
      job.prompt_ids = {1, 300, 301, 302};
      job.policy = job.policy_label = "full";
      job.max_tokens = 60;
      job.temperature = 1.0;
      job.seed = seed;
      std::shared_ptr<CompletionHandle> handle = (*scheduler)->Submit(job);
      ASSERT_NE(handle, nullptr);
      const auto [streamed, whole] = StreamedAndWhole(*handle);
      EXPECT_EQ(streamed, whole) << "seed " << seed;
      punctuated += whole.find_first_of(".,?!") != std::string::npos ? 1 : 0;
    }
    EXPECT_GT(punctuated, 4);
    (*scheduler)->Stop();
  }
}

// A request that does not stream (CompletionJob::stream false) gets no text until it finishes, and then the answer
// the same request streamed gets; its answer is decoded once, not at every step.
TEST(CompletionScheduler, ARequestThatDoesNotStreamIsAnsweredWholeAndDecodedOnce) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  auto model = worker::LlamaModel::Load(testing::SharedPath(testing::kStoriesModel), worker::LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  CleanUpTokenizer tokenizer;
  SchedulerOptions options;
  options.chunk_size = 32;
  options.update_interval = 64;
  auto scheduler = CompletionScheduler::Start(*model, tokenizer, "full", options, nullptr);
  ASSERT_TRUE(scheduler.ok()) << scheduler.status().ToString();
  const std::vector<int64_t> prompt = {1, 300, 301, 302};
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    const auto submit = [&](bool stream) {
      CompletionJob job;
      job.prompt_ids = prompt;
      job.policy = job.policy_label = "full";
      job.max_tokens = 60;
      job.temperature = 1.0;
      job.seed = seed;
      job.stream = stream;
      std::shared_ptr<CompletionHandle> handle = (*scheduler)->Submit(std::move(job));
      EXPECT_NE(handle, nullptr);
      return StreamedAndWhole(*handle);
    };
    const int64_t before = tokenizer.decodes.load();
    const auto [streamed, answer] = submit(true);
    const int64_t streaming_decodes = tokenizer.decodes.load() - before;
    const auto [nothing, whole] = submit(false);
    const int64_t whole_decodes = tokenizer.decodes.load() - before - streaming_decodes;
    EXPECT_EQ(nothing, "") << "seed " << seed;
    EXPECT_EQ(whole, answer) << "seed " << seed;
    EXPECT_EQ(streamed, answer) << "seed " << seed;
    EXPECT_GE(streaming_decodes, 50) << "seed " << seed;  // a decode per step
    EXPECT_EQ(whole_decodes, 1) << "seed " << seed;        // the generator's, at the end
  }
  (*scheduler)->Stop();
}

// stories260K (float32, CPU) and its tokenizer.
void LoadStories(std::unique_ptr<worker::LlamaModel>* model, std::unique_ptr<worker::Tokenizer>* tokenizer) {
  auto loaded = worker::LlamaModel::Load(testing::SharedPath(testing::kStoriesModel), worker::LoadOptions{});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  *model = std::make_unique<worker::LlamaModel>(std::move(*loaded));
  auto read = worker::load_tokenizer(testing::SharedPath(testing::kStoriesTokenizer));
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  *tokenizer = std::move(*read);
}

// A completion's text continues its prompt's (OpenAI's: prompt + text is the whole text): llama2.c's decoder drops
// the leading space of a text, and the answer to "Once upon a" came back as "time, there", so a stop string
// " time" never matched. A chat reply (text_continues_prompt false) is decoded alone, as before.
TEST(CompletionScheduler, ACompletionKeepsTheSpaceItsFirstTokenCarries) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  std::unique_ptr<worker::LlamaModel> model;
  std::unique_ptr<worker::Tokenizer> tokenizer;
  LoadStories(&model, &tokenizer);
  SchedulerOptions options;
  options.chunk_size = 32;
  options.update_interval = 64;
  auto scheduler = CompletionScheduler::Start(*model, *tokenizer, "full", options, nullptr);
  ASSERT_TRUE(scheduler.ok()) << scheduler.status().ToString();
  const auto answer = [&](bool continues, std::vector<std::string> stop) {
    CompletionJob job;
    job.prompt_ids = tokenizer->EncodeForModel("Once upon a").value();
    job.policy = job.policy_label = "full";
    job.max_tokens = 4;
    job.text_continues_prompt = continues;
    job.stop = std::move(stop);
    std::shared_ptr<CompletionHandle> handle = (*scheduler)->Submit(std::move(job));
    EXPECT_NE(handle, nullptr);
    std::string streamed;
    while (true) {
      CompletionUpdate update = handle->Wait(std::chrono::milliseconds(100));
      streamed += update.text;
      if (update.finished) {
        EXPECT_EQ(streamed, update.outcome.text);
        return update.outcome;
      }
    }
  };
  const CompletionOutcome completion = answer(true, {});
  EXPECT_EQ(completion.text.rfind(" time,", 0), 0u) << completion.text;
  EXPECT_EQ(answer(false, {}).text, completion.text.substr(1));
  const CompletionOutcome stopped = answer(true, {" time"});
  EXPECT_EQ(stopped.text, "");
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.completion_tokens, 1);
  (*scheduler)->Stop();
}

// Admission (SchedulerOptions::max_kv_bytes): 16 requests, 12 of which fit two at a time and 2 of which could
// never fit, on a budget of 500 tokens' keys and values (1,280 bytes a token on stories260K in float32): the two are
// refused at once with a 400 naming the limit, the twelve all finish, never more than two running at once; the same
// long request with a budgeted policy is taken. Without the limit the twelve run eight at once (the batch's
// size), which is what the server's memory would have had to hold.
TEST(CompletionScheduler, AdmitsRequestsAsTheirKvCachesFitAndRefusesOnesThatNeverCould) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  std::unique_ptr<worker::LlamaModel> model;
  std::unique_ptr<worker::Tokenizer> tokenizer;
  ASSERT_NO_FATAL_FAILURE(LoadStories(&model, &tokenizer));
  const auto job = [](const std::string& policy, int64_t max_tokens, uint64_t seed) {
    CompletionJob j;
    j.prompt_ids = {1, 300, 301, 302};
    j.policy = j.policy_label = policy;
    j.max_tokens = max_tokens;
    j.temperature = 1.0;
    j.seed = seed;
    return j;
  };
  for (const int64_t limit : {int64_t{1280} * 500, int64_t{0}}) {
    SCOPED_TRACE(limit);
    SchedulerOptions options;
    options.chunk_size = 32;
    options.update_interval = 64;
    options.max_kv_bytes = limit;
    options.max_context = 2048;
    auto scheduler = CompletionScheduler::Start(*model, *tokenizer, "full", options, nullptr);
    ASSERT_TRUE(scheduler.ok()) << scheduler.status().ToString();
    std::vector<std::shared_ptr<CompletionHandle>> fitting, never;
    for (uint64_t i = 0; i < 16; ++i) {
      const bool huge = i == 5 || i == 11;  // 1,004 tokens of full cache: 1.2 MiB
      (huge ? never : fitting).push_back((*scheduler)->Submit(job("full", huge ? 1000 : 200, i + 1)));
    }
    std::size_t most_running = 0;
    (void)FinishAll(**scheduler, fitting, &most_running);
    for (const auto& handle : never) {
      const CompletionUpdate update = Final(*handle);
      if (limit > 0) {
        ASSERT_TRUE(update.error.has_value());
        EXPECT_EQ(update.error->http_status, 400);
        EXPECT_NE(update.error->message.find("the request may need 1.2 MiB of KV cache (4 prompt tokens + "
                                             "max_tokens 1000 with full), more than the server holds for all "
                                             "requests together (--max-kv-bytes, 0.6 MiB)"),
                  std::string::npos)
            << update.error->message;
      } else {
        EXPECT_FALSE(update.error.has_value());
      }
    }
    if (limit > 0) {
      EXPECT_LE(most_running, 2u);
      // A budget bounds the cache (16 tokens + the 64-token update interval): the same length is taken.
      const CompletionUpdate bounded = Final(*(*scheduler)->Submit(job("streaming:budget=16", 1000, 99)));
      EXPECT_FALSE(bounded.error.has_value()) << bounded.error->message;
      // A budget past the allowance bounds nothing (2^63 - 1 plus the interval overflowed into ~500 tokens).
      const CompletionUpdate unbounded =
          Final(*(*scheduler)->Submit(job("h2o:budget=9223372036854775807", 1000, 98)));
      ASSERT_TRUE(unbounded.error.has_value());
      EXPECT_EQ(unbounded.error->http_status, 400) << unbounded.error->message;
    } else {
      EXPECT_GT(most_running, 2u);
    }
    (*scheduler)->Stop();
  }
}

// 12 requests of 4 + 300 tokens with `policy` (each with its seed) through a scheduler of at most 16 rows and
// `limit` bytes of KV (0: no limit), the caches in blocks of `block_tokens` of one pool the size of the limit
// (0: rectangular): their answers, in order, each streamed whole; the most that ran at once in
// `most_running`.
std::vector<std::string> FloodAnswers(worker::LlamaModel& model, const worker::Tokenizer& tokenizer,
                                      const std::string& policy, int64_t limit, ApiMetrics* metrics,
                                      std::size_t* most_running, int64_t block_tokens = 0) {
  EXPECT_TRUE(worker::use_kv_blocks(model, block_tokens, limit).ok());
  SchedulerOptions options;
  options.chunk_size = 32;
  options.update_interval = 64;
  options.max_kv_bytes = limit;
  options.max_running = 16;
  auto scheduler = CompletionScheduler::Start(model, tokenizer, "full", options, metrics);
  EXPECT_TRUE(scheduler.ok()) << scheduler.status().ToString();
  std::vector<std::shared_ptr<CompletionHandle>> handles;
  for (uint64_t i = 0; i < 12; ++i) {
    CompletionJob j;
    j.prompt_ids = {1, 300 + static_cast<int64_t>(i), 301, 302};
    j.policy = j.policy_label = policy;
    j.max_tokens = 300;
    j.temperature = 1.0;
    j.seed = i + 1;
    handles.push_back((*scheduler)->Submit(j));
  }
  std::vector<std::string> texts;
  for (const auto& [streamed, end] : FinishAll(**scheduler, handles, most_running)) {
    EXPECT_EQ(streamed, end.outcome.text) << "request " << texts.size();
    texts.push_back(end.outcome.text);
  }
  (*scheduler)->Stop();
  if (block_tokens > 0) {
    EXPECT_EQ(model.kv_block_pool()->blocks_in_use(), 0);
  }
  EXPECT_TRUE(worker::use_kv_blocks(model, 0, 0).ok());
  return texts;
}

// The value of the sample that begins with `line` (e.g. "\nnamm_api_preemptions_total ") in an exposition.
double Sample(const std::string& exposition, const std::string& line) {
  const std::size_t at = exposition.find(line);
  EXPECT_NE(at, std::string::npos) << line << exposition;
  return at == std::string::npos ? -1 : std::stod(exposition.substr(at + line.size()));
}

constexpr int64_t kBytesPerToken = 1280;  // stories260K: 2 x 5 layers x 4 KV heads x 8 x 4 bytes

// A flood of requests whose caches grow and never shrink (H2O with a budget over their length: an evicting
// policy whose bound is not known in advance, as a NAMM's) on a budget that holds few of them grown: they are
// admitted by the memory they use, the youngest are preempted when the running ones' caches and the oldest's
// next step would not fit (a held row frees nothing until an older one finishes), and every request finishes
// with the answer it gets without a budget (a preempted one starts again with its seed; nothing it sent is sent
// twice). The same with the caches in blocks of one pool the size of the budget (--kv-block-tokens): admission
// counts whole blocks, so no append ever finds the pool dry, and every block is back in the pool at the end.
TEST(CompletionScheduler, AFloodOfGrowingCachesOnASmallBudgetFinishesWithTheUnlimitedAnswers) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  std::unique_ptr<worker::LlamaModel> model;
  std::unique_ptr<worker::Tokenizer> tokenizer;
  ASSERT_NO_FATAL_FAILURE(LoadStories(&model, &tokenizer));
  const std::string policy = "h2o:budget=400";  // holds every token of these 4 + 300
  std::size_t unlimited_running = 0, limited_running = 0;
  const std::vector<std::string> unlimited =
      FloodAnswers(*model, *tokenizer, policy, 0, nullptr, &unlimited_running);
  ApiMetrics metrics("stories260K", "full");
  // Room for 9 requests at their start (64 tokens of storage each), for 2 grown to 304 tokens.
  const std::vector<std::string> limited =
      FloodAnswers(*model, *tokenizer, policy, 600 * kBytesPerToken, &metrics, &limited_running);
  EXPECT_EQ(limited, unlimited);
  EXPECT_GE(limited_running, 4u);  // counted at their worst case (304 tokens each), one would run at a time
  EXPECT_GT(Sample(metrics.Exposition(), "\nnamm_api_preemptions_total "), 0);

  ApiMetrics block_metrics("stories260K", "full");
  std::size_t block_running = 0;
  const std::vector<std::string> in_blocks =
      FloodAnswers(*model, *tokenizer, policy, 600 * kBytesPerToken, &block_metrics, &block_running, 16);
  EXPECT_EQ(in_blocks, unlimited);
  EXPECT_GE(block_running, 4u);
  const std::string blocks = block_metrics.Exposition();
  EXPECT_GT(Sample(blocks, "\nnamm_api_preemptions_total "), 0);
  EXPECT_GT(Sample(blocks, "\nnamm_api_kv_blocks{state=\"free\"} "), 0);
}

// Caches in blocks that evict back to a few tokens at every memory update (StreamingLLM with 16 tokens: at
// most 16 + 64) on a budget where the running rows cannot all grow at once: the rows whose next step would
// pass it wait with their caches (namm_api_held_steps_total) while the others' updates give blocks back, and
// none is preempted and recomputed (preempting at once, as before, preempted some). Every answer is the
// unlimited one. (A rectangular cache keeps its storage after evicting: there a held row waits for an older
// one to finish, as in the flood above.)
TEST(CompletionScheduler, RowsThatWouldPassTheBudgetWaitForEvictionsInsteadOfBeingPreempted) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  std::unique_ptr<worker::LlamaModel> model;
  std::unique_ptr<worker::Tokenizer> tokenizer;
  ASSERT_NO_FATAL_FAILURE(LoadStories(&model, &tokenizer));
  const std::string policy = "streaming:budget=16";
  std::size_t unlimited_running = 0, most_running = 0;
  const std::vector<std::string> unlimited =
      FloodAnswers(*model, *tokenizer, policy, 0, nullptr, &unlimited_running);
  ApiMetrics metrics("stories260K", "full");
  // Room for 9 requests at their first memory update (64 tokens: 4 blocks of 16 per KV head), not for 9 grown
  // to 80 (5 blocks).
  const std::vector<std::string> limited =
      FloodAnswers(*model, *tokenizer, policy, 600 * kBytesPerToken, &metrics, &most_running, 16);
  EXPECT_EQ(limited, unlimited);
  EXPECT_GE(most_running, 8u);
  const std::string exposition = metrics.Exposition();
  EXPECT_GT(Sample(exposition, "\nnamm_api_held_steps_total "), 0);
  EXPECT_EQ(Sample(exposition, "\nnamm_api_preemptions_total "), 0);
}

// A NAMM whose heads keep their own counts (namm:FILE,heads=own: ragged caches, whose heads give their dropped
// slots' blocks back) on the same small budget: every answer is the unlimited one's, with rectangular caches,
// and every block is back in the pool at the end (FloodAnswers).
TEST(CompletionScheduler, ANammWhoseHeadsKeepTheirOwnCountsAnswersOnASmallBudgetAsUnlimited) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  std::unique_ptr<worker::LlamaModel> model;
  std::unique_ptr<worker::Tokenizer> tokenizer;
  ASSERT_NO_FATAL_FAILURE(LoadStories(&model, &tokenizer));
  const std::string policy = "namm:" + testing::WriteRandomNammFile("own-heads.safetensors", 7) + ",heads=own";
  std::size_t unlimited_running = 0, most_running = 0;
  const std::vector<std::string> unlimited = FloodAnswers(*model, *tokenizer, policy, 0, nullptr, &unlimited_running);
  ApiMetrics metrics("stories260K", "full");
  const std::vector<std::string> limited =
      FloodAnswers(*model, *tokenizer, policy, 600 * kBytesPerToken, &metrics, &most_running, 16);
  EXPECT_EQ(limited, unlimited);
  EXPECT_GE(most_running, 4u);
}

// SnapKV and FastGen compress the prompt only at its end, so until then their caches hold the whole prompt,
// whatever their budget (as a NAMM's prompt=keep does). On a pool of blocks the size of the budget, a prompt
// that alone passes it is refused (it could never run), and prompts that fit one or two at a time all finish
// with their unlimited answers.
TEST(CompletionScheduler, PromptCompressingPoliciesAreCountedAtTheirWholePrompt) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  std::unique_ptr<worker::LlamaModel> model;
  std::unique_ptr<worker::Tokenizer> tokenizer;
  ASSERT_NO_FATAL_FAILURE(LoadStories(&model, &tokenizer));
  const auto job = [](const std::string& policy, int64_t prompt_tokens, uint64_t seed) {
    CompletionJob j;
    j.prompt_ids = {1};
    for (int64_t t = 1; t < prompt_tokens; ++t) j.prompt_ids.push_back(3 + (t * 37 + static_cast<int64_t>(seed)) % 500);
    j.policy = j.policy_label = policy;
    j.max_tokens = 24;
    j.temperature = 1.0;
    j.seed = seed;
    return j;
  };
  const int64_t limit = 320 * kBytesPerToken;
  for (const std::string policy : {"snapkv:budget=16", "fastgen:budget=16"}) {
    SCOPED_TRACE(policy);
    const auto answers = [&](int64_t bytes) {
      EXPECT_TRUE(worker::use_kv_blocks(*model, bytes > 0 ? 16 : 0, bytes).ok());
      SchedulerOptions options;
      options.chunk_size = 32;
      options.update_interval = 64;
      options.max_kv_bytes = bytes;
      options.max_running = 8;
      auto scheduler = CompletionScheduler::Start(*model, *tokenizer, "full", options, nullptr);
      EXPECT_TRUE(scheduler.ok()) << scheduler.status().ToString();
      std::vector<std::string> texts;
      if (bytes > 0) {
        const CompletionUpdate never = Final(*(*scheduler)->Submit(job(policy, 400, 1)));
        EXPECT_TRUE(never.error.has_value() && never.error->http_status == 400)
            << (never.error ? never.error->message : "answered: " + never.outcome.text);
      }
      std::vector<std::shared_ptr<CompletionHandle>> handles;
      for (uint64_t i = 0; i < 6; ++i) handles.push_back((*scheduler)->Submit(job(policy, 200, i + 2)));
      std::size_t most_running = 0;
      for (const auto& [streamed, end] : FinishAll(**scheduler, handles, &most_running)) texts.push_back(end.outcome.text);
      (*scheduler)->Stop();
      EXPECT_TRUE(worker::use_kv_blocks(*model, 0, 0).ok());
      return texts;
    };
    const std::vector<std::string> unlimited = answers(0);
    EXPECT_EQ(answers(limit), unlimited);
  }
}

}  // namespace
}  // namespace namm::server
