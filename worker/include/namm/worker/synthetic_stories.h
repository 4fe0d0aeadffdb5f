// The CPU-scale synthetic task "story recall" (tasks/README.md): the bundled stories260K model samples a pool
// of stories; each row hides one story's opening behind other stories (distractors) and asks for the story's
// true continuation. Everything is drawn from a seed with counter-based generators, so a row set is a pure
// function of (model, options).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
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

}  // namespace namm::worker
