// The CPU-scale synthetic tasks (tasks/README.md), built from stories the bundled stories260K model samples
// itself:
//  - "story recall": each row hides one story's opening behind other stories (distractors) and asks for the
//    story's true continuation;
//  - "interruption": a story's opening, then an interruption (random tokens, another story, or either), then
//    possibly a few more tokens of the story, and the story's true continuation is scored. The row marks the
//    interruption's positions, so an oracle can evict exactly it.
// Everything is drawn from a seed with counter-based generators, so a row set is a pure function of
// (model, options); different seeds sample different stories.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "namm/status.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

struct StoryRecallOptions {
  int64_t rows = 128;
  uint64_t seed = 1;
  int64_t pool = 64;                 // stories sampled
  int64_t story_tokens = 300;        // tokens per story (end-of-sequence suppressed)
  int64_t prefix_tokens = 200;       // of the target story, at the end of the prompt
  int64_t continuation_tokens = 60;  // scored
  int64_t distractor_tokens = 1400;  // other stories in front of the target
  double temperature = 0.7;          // below 1: more coherent stories, a clearer signal
};

// Rows with "prompt_ids" (BOS, distractors, target prefix), "clean_prompt_ids" (BOS, target prefix),
// "continuation_ids", "answers" (the continuation's text), "target" and "distractors" (pool indices).
// `progress(done, total)` is called after each sampled story.
Result<std::vector<nlohmann::json>> build_story_recall_rows(const LlamaModel& model, const Tokenizer& tokenizer,
                                                            const StoryRecallOptions& options,
                                                            const std::function<void(int64_t, int64_t)>& progress = {});

// What interrupts the story.
enum class InterruptionKind { kRandom, kStories, kMix };
Result<InterruptionKind> parse_interruption_kind(const std::string& text);  // random | stories | mix

struct InterruptionOptions {
  int64_t rows = 128;
  uint64_t seed = 1;
  int64_t pool = 64;
  int64_t story_tokens = 300;
  double temperature = 0.7;
  InterruptionKind kind = InterruptionKind::kMix;  // mix: each row draws random tokens or another story
  // Lengths are drawn uniformly from [min, max] per row.
  int64_t prefix_min = 64, prefix_max = 160;              // story tokens before the interruption
  int64_t interruption_min = 128, interruption_max = 256;
  int64_t resume_min = 0, resume_max = 32;                // story tokens between the interruption and the answer
  int64_t continuation_tokens = 48;                       // scored
};

// Rows with "prompt_ids" (BOS, story prefix, interruption, story resumption), "clean_prompt_ids" (the same
// without the interruption), "continuation_ids", "answers", "evict_spans" ([[begin, end]]: the interruption's
// absolute positions), "target", "kind" ("random" or "stories"), "prefix_tokens", "interruption_tokens",
// "resume_tokens".
Result<std::vector<nlohmann::json>> build_interruption_rows(const LlamaModel& model, const Tokenizer& tokenizer,
                                                            const InterruptionOptions& options,
                                                            const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace namm::worker
