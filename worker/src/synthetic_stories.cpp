#include "namm/worker/synthetic_stories.h"

#include <algorithm>

#include "namm/memory_policy.h"
#include "namm/worker/generator.h"

namespace namm::worker {

namespace {

// SplitMix64 mixing of a seed and two counters.
uint64_t Mix(uint64_t seed, uint64_t a, uint64_t b) {
  uint64_t z = seed ^ (0x9E3779B97F4A7C15ull * (a + 1)) ^ (0xC2B2AE3D27D4EB4Full * (b + 1));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

Result<std::vector<nlohmann::json>> build_story_recall_rows(const LlamaModel& model, const Tokenizer& tokenizer,
                                                            const StoryRecallOptions& o,
                                                            const std::function<void(int64_t, int64_t)>& progress) {
  if (o.rows <= 0 || o.pool < 2 || o.prefix_tokens <= 0 || o.continuation_tokens <= 0 || o.distractor_tokens < 0) {
    return Status::InvalidArgument("story recall needs rows > 0, a pool of at least 2 stories and positive lengths");
  }
  if (o.prefix_tokens + o.continuation_tokens > o.story_tokens) {
    return Status::InvalidArgument("prefix + continuation (" + std::to_string(o.prefix_tokens + o.continuation_tokens) +
                                   " tokens) must fit in a story of " + std::to_string(o.story_tokens));
  }
  const std::vector<int64_t> bos = tokenizer.EncodeForModel("");
  if (bos.empty()) return Status::FailedPrecondition("the tokenizer adds no BOS token to start stories from");
  // The newline token that separates stories (SentencePiece-style encoders prepend a space token: drop it).
  std::vector<int64_t> newline = tokenizer.Encode("\n");
  if (newline.size() > 1) newline.erase(newline.begin(), newline.end() - 1);

  // The pool: each story sampled from BOS with its own seed.
  std::vector<std::vector<int64_t>> stories;
  Generator generator(model, tokenizer);
  FullCachePolicy full;
  for (int64_t s = 0; s < o.pool; ++s) {
    GenerationOptions g;
    g.max_new_tokens = o.story_tokens;
    g.temperature = o.temperature;
    g.seed = Mix(o.seed, 1, static_cast<uint64_t>(s));
    g.banned_ids = model.config().eos_token_ids;
    g.banned_ids.insert(g.banned_ids.end(), model.config().bos_token_ids.begin(), model.config().bos_token_ids.end());
    NAMM_ASSIGN_OR_RETURN(GenerationResult story, generator.Generate(bos, full, g));
    stories.push_back(std::move(story.token_ids));
    if (progress) progress(s + 1, o.pool);
  }

  std::vector<nlohmann::json> rows;
  for (int64_t r = 0; r < o.rows; ++r) {
    const auto target = static_cast<int64_t>(Mix(o.seed, 2, static_cast<uint64_t>(r)) % static_cast<uint64_t>(o.pool));
    std::vector<int64_t> distractors, used;
    for (uint64_t k = 0; static_cast<int64_t>(distractors.size()) < o.distractor_tokens; ++k) {
      const auto pick = static_cast<int64_t>(Mix(o.seed, 3 + k, static_cast<uint64_t>(r)) % static_cast<uint64_t>(o.pool - 1));
      const int64_t story = pick >= target ? pick + 1 : pick;  // any story but the target
      // Distinct distractors while the pool has unused ones.
      const bool repeated = std::find(used.begin(), used.end(), story) != used.end();
      if (repeated && static_cast<int64_t>(used.size()) < o.pool - 1) continue;
      used.push_back(story);
      const auto& tokens = stories[static_cast<std::size_t>(story)];
      const int64_t take = std::min<int64_t>(static_cast<int64_t>(tokens.size()), o.distractor_tokens - static_cast<int64_t>(distractors.size()));
      distractors.insert(distractors.end(), tokens.begin(), tokens.begin() + take);
      distractors.insert(distractors.end(), newline.begin(), newline.end());
    }
    distractors.resize(static_cast<std::size_t>(o.distractor_tokens));
    const auto& story = stories[static_cast<std::size_t>(target)];
    const std::vector<int64_t> prefix(story.begin(), story.begin() + o.prefix_tokens);
    const std::vector<int64_t> continuation(story.begin() + o.prefix_tokens,
                                            story.begin() + o.prefix_tokens + o.continuation_tokens);
    std::vector<int64_t> prompt = bos, clean = bos;
    prompt.insert(prompt.end(), distractors.begin(), distractors.end());
    if (!distractors.empty()) prompt.insert(prompt.end(), newline.begin(), newline.end());
    prompt.insert(prompt.end(), prefix.begin(), prefix.end());
    clean.insert(clean.end(), prefix.begin(), prefix.end());
    rows.push_back({{"prompt_ids", prompt},
                    {"clean_prompt_ids", clean},
                    {"continuation_ids", continuation},
                    {"answers", nlohmann::json::array({tokenizer.Decode(continuation)})},
                    {"target", target},
                    {"distractors", used}});
  }
  return rows;
}

}  // namespace namm::worker
