#include "namm/worker/synthetic_stories.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "namm/policies/full_cache_policy.h"
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

// Draws from [lo, hi] with the counter-keyed generator.
int64_t Uniform(uint64_t seed, uint64_t a, uint64_t b, int64_t lo, int64_t hi) {
  return lo + static_cast<int64_t>(Mix(seed, a, b) % static_cast<uint64_t>(hi - lo + 1));
}

// The most rows, and tokens in any one length, a row set may ask for: bounds that keep every sum of lengths far
// from overflow and the rows' memory finite (a million-token prompt is past any model here).
constexpr int64_t kMaxRows = int64_t{1} << 20, kMaxTokens = int64_t{1} << 20;

// Refuses what no row set can be built from: a temperature that is not a positive finite number (NaN fell back to
// greedy decoding, so every seed sampled the same stories) and counts or lengths past the bounds above.
Status CheckCommon(int64_t rows, int64_t story_tokens, double temperature,
                   std::initializer_list<std::pair<const char*, int64_t>> lengths) {
  if (!(temperature > 0) || !std::isfinite(temperature)) {
    return Status::InvalidArgument("temperature must be a positive finite number, got " + std::to_string(temperature));
  }
  if (rows > kMaxRows) return Status::InvalidArgument("at most " + std::to_string(kMaxRows) + " rows, got " + std::to_string(rows));
  if (story_tokens <= 0 || story_tokens > kMaxTokens) {
    return Status::InvalidArgument("story tokens must be in 1.." + std::to_string(kMaxTokens) + ", got " +
                                   std::to_string(story_tokens));
  }
  for (const auto& [name, length] : lengths) {
    if (length > kMaxTokens) {
      return Status::InvalidArgument(std::string(name) + " must be at most " + std::to_string(kMaxTokens) +
                                     " tokens, got " + std::to_string(length));
    }
  }
  return Status::Ok();
}

struct StoryPool {
  std::vector<int64_t> bos, newline;
  std::vector<std::vector<int64_t>> stories;
};

// `pool` stories of `story_tokens` each, sampled from BOS with their own seeds (EOS and BOS banned).
Result<StoryPool> SampleStories(const LlamaModel& model, const Tokenizer& tokenizer, uint64_t seed, int64_t pool,
                                int64_t story_tokens, double temperature,
                                const std::function<void(int64_t, int64_t)>& progress) {
  StoryPool out;
  NAMM_ASSIGN_OR_RETURN(out.bos, tokenizer.EncodeForModel(""));
  if (out.bos.empty()) return Status::FailedPrecondition("the tokenizer adds no BOS token to start stories from");
  // The newline token that separates stories (SentencePiece-style encoders prepend a space token: drop it).
  NAMM_ASSIGN_OR_RETURN(out.newline, tokenizer.Encode("\n"));
  if (out.newline.size() > 1) out.newline.erase(out.newline.begin(), out.newline.end() - 1);
  Generator generator(model, tokenizer);
  FullCachePolicy full;
  for (int64_t s = 0; s < pool; ++s) {
    GenerationOptions g;
    g.max_new_tokens = story_tokens;
    g.temperature = temperature;
    g.seed = Mix(seed, 1, static_cast<uint64_t>(s));
    g.banned_ids = model.config().eos_token_ids;
    g.banned_ids.insert(g.banned_ids.end(), model.config().bos_token_ids.begin(), model.config().bos_token_ids.end());
    NAMM_ASSIGN_OR_RETURN(GenerationResult story, generator.Generate(out.bos, full, g));
    out.stories.push_back(std::move(story.token_ids));
    if (progress) progress(s + 1, pool);
  }
  return out;
}

}  // namespace

Result<std::vector<nlohmann::json>> build_story_recall_rows(const LlamaModel& model, const Tokenizer& tokenizer,
                                                            const StoryRecallOptions& o,
                                                            const std::function<void(int64_t, int64_t)>& progress) {
  if (o.rows <= 0 || o.pool < 2 || o.prefix_tokens <= 0 || o.continuation_tokens <= 0 || o.distractor_tokens < 0) {
    return Status::InvalidArgument("story recall needs rows > 0, a pool of at least 2 stories and positive lengths");
  }
  NAMM_RETURN_IF_ERROR(CheckCommon(o.rows, o.story_tokens, o.temperature,
                                   {{"the prefix", o.prefix_tokens}, {"the continuation", o.continuation_tokens},
                                    {"the distractors", o.distractor_tokens}}));
  if (o.prefix_tokens + o.continuation_tokens > o.story_tokens) {
    return Status::InvalidArgument("prefix + continuation (" + std::to_string(o.prefix_tokens + o.continuation_tokens) +
                                   " tokens) must fit in a story of " + std::to_string(o.story_tokens));
  }
  NAMM_ASSIGN_OR_RETURN(StoryPool pool,
                        SampleStories(model, tokenizer, o.seed, o.pool, o.story_tokens, o.temperature, progress));
  const std::vector<int64_t>& bos = pool.bos;
  const std::vector<int64_t>& newline = pool.newline;
  const std::vector<std::vector<int64_t>>& stories = pool.stories;

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

Result<InterruptionKind> parse_interruption_kind(const std::string& text) {
  if (text == "random") return InterruptionKind::kRandom;
  if (text == "stories") return InterruptionKind::kStories;
  if (text == "mix") return InterruptionKind::kMix;
  return Status::InvalidArgument("unknown interruption kind '" + text + "' (known: random, stories, mix)");
}

Result<std::vector<nlohmann::json>> build_interruption_rows(const LlamaModel& model, const Tokenizer& tokenizer,
                                                            const InterruptionOptions& o,
                                                            const std::function<void(int64_t, int64_t)>& progress) {
  const auto range_ok = [](int64_t lo, int64_t hi, int64_t least) { return least <= lo && lo <= hi; };
  if (o.rows <= 0 || o.pool < 2 || o.continuation_tokens <= 0 || !range_ok(o.prefix_min, o.prefix_max, 1) ||
      !range_ok(o.interruption_min, o.interruption_max, 1) || !range_ok(o.resume_min, o.resume_max, 0)) {
    return Status::InvalidArgument("interruption rows need rows > 0, a pool of at least 2 stories, a positive "
                                   "continuation and length ranges with 0 < min <= max (resumption: 0 <= min)");
  }
  NAMM_RETURN_IF_ERROR(CheckCommon(o.rows, o.story_tokens, o.temperature,
                                   {{"the prefix", o.prefix_max}, {"the interruption", o.interruption_max},
                                    {"the resumption", o.resume_max}, {"the continuation", o.continuation_tokens}}));
  if (o.prefix_max + o.resume_max + o.continuation_tokens > o.story_tokens) {
    return Status::InvalidArgument("the longest prefix + resumption + continuation (" +
                                   std::to_string(o.prefix_max + o.resume_max + o.continuation_tokens) +
                                   " tokens) must fit in a story of " + std::to_string(o.story_tokens));
  }
  NAMM_ASSIGN_OR_RETURN(StoryPool pool,
                        SampleStories(model, tokenizer, o.seed, o.pool, o.story_tokens, o.temperature, progress));
  // Random interruptions use ordinary tokens: none that decoding drops (BOS, EOS, unknown).
  std::vector<int64_t> ordinary;
  for (int64_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (!tokenizer.Decode({id}).empty()) ordinary.push_back(id);
  }
  if (ordinary.empty()) return Status::FailedPrecondition("the tokenizer has no ordinary tokens to interrupt with");

  std::vector<nlohmann::json> rows;
  for (int64_t r = 0; r < o.rows; ++r) {
    const auto row = static_cast<uint64_t>(r);
    const int64_t target = Uniform(o.seed, 2, row, 0, o.pool - 1);
    const int64_t prefix = Uniform(o.seed, 3, row, o.prefix_min, o.prefix_max);
    const int64_t length = Uniform(o.seed, 4, row, o.interruption_min, o.interruption_max);
    const int64_t resume = Uniform(o.seed, 5, row, o.resume_min, o.resume_max);
    const bool random = o.kind == InterruptionKind::kRandom ||
                        (o.kind == InterruptionKind::kMix && Uniform(o.seed, 6, row, 0, 1) == 0);
    std::vector<int64_t> interruption;
    if (random) {
      for (int64_t i = 0; i < length; ++i) {
        const auto pick = Uniform(o.seed, 7 + row, static_cast<uint64_t>(i), 0, static_cast<int64_t>(ordinary.size()) - 1);
        interruption.push_back(ordinary[static_cast<std::size_t>(pick)]);
      }
    } else {
      // Other stories from their beginning, separated by newlines, as many as the length takes.
      for (uint64_t k = 0; static_cast<int64_t>(interruption.size()) < length; ++k) {
        const int64_t pick = Uniform(o.seed, 1000003 + k, row, 0, o.pool - 2);
        const auto& other = pool.stories[static_cast<std::size_t>(pick >= target ? pick + 1 : pick)];
        interruption.insert(interruption.end(), pool.newline.begin(), pool.newline.end());
        interruption.insert(interruption.end(), other.begin(), other.end());
      }
      interruption.resize(static_cast<std::size_t>(length));
    }
    const auto& story = pool.stories[static_cast<std::size_t>(target)];
    const auto at = [&](int64_t i) { return story.begin() + i; };
    std::vector<int64_t> prompt = pool.bos, clean = pool.bos;
    prompt.insert(prompt.end(), at(0), at(prefix));
    const auto begin = static_cast<int64_t>(prompt.size());
    prompt.insert(prompt.end(), interruption.begin(), interruption.end());
    const auto end = static_cast<int64_t>(prompt.size());
    prompt.insert(prompt.end(), at(prefix), at(prefix + resume));
    clean.insert(clean.end(), at(0), at(prefix + resume));
    const std::vector<int64_t> continuation(at(prefix + resume), at(prefix + resume + o.continuation_tokens));
    rows.push_back({{"prompt_ids", prompt},
                    {"clean_prompt_ids", clean},
                    {"continuation_ids", continuation},
                    {"answers", nlohmann::json::array({tokenizer.Decode(continuation)})},
                    {"evict_spans", nlohmann::json::array({nlohmann::json::array({begin, end})})},
                    {"target", target},
                    {"kind", random ? "random" : "stories"},
                    {"prefix_tokens", prefix},
                    {"interruption_tokens", length},
                    {"resume_tokens", resume}});
  }
  return rows;
}

}  // namespace namm::worker
