// namm-api's scheduler without HTTP: a stream's pieces add up to the whole answer, whatever the tokenizer does to
// text already decoded (GPT-2's cleans up spaces before punctuation once the next token arrives).
#include "namm/server/completion_scheduler.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

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

// Pieces " ", "." and "w" by id, decoded with transformers' clean-up of " ." (as clean_up_tokenization_spaces does):
// sampled ids give a space that is sent and then rewritten by the next token at almost every step.
class CleanUpTokenizer final : public worker::Tokenizer {
 public:
  Result<std::vector<int64_t>> Encode(const std::string&) const override { return std::vector<int64_t>{}; }
  Result<std::vector<int64_t>> EncodeForModel(const std::string&) const override { return std::vector<int64_t>{1}; }
  std::string Decode(const std::vector<int64_t>& ids, bool) const override {
    std::string text;
    for (int64_t id : ids) text += id % 3 == 0 ? " " : id % 3 == 1 ? "." : "w";
    for (std::size_t at; (at = text.find(" .")) != std::string::npos;) text.erase(at, 1);
    return text;
  }
  int64_t vocab_size() const override { return 512; }
  std::vector<int64_t> eos_ids() const override { return {}; }
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

}  // namespace
}  // namespace namm::server
