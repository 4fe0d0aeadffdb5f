// Running one task prompt end to end: build the prompt (template, tokenizer, the reference's middle truncation
// to context - max_new_tokens), generate with a memory policy, and score the answer; or, for token-id rows,
// score the true continuation under teacher forcing.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "namm/policies/memory_policy.h"
#include "namm/status.h"
#include "namm/tasks/task.h"
#include "namm/worker/generator.h"

namespace namm::worker {

struct PromptResult {
  int64_t row = 0;
  double score = 0;                // in [0, 1]
  std::string prediction;          // generated text ("" for teacher-forced scoring)
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;    // or, teacher-forced, the continuation's length
  std::vector<MemoryUpdateRecord> updates;
  std::vector<int64_t> final_cache_sizes;
  double mean_kv_tokens = 0, answer_kv_tokens = 0, peak_kv_tokens = 0;  // see GenerationResult
  double seconds = 0;
  // The model's work: tokens in prefill chunks and in single decode steps, and the seconds of each.
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  // For the rows in TaskRunOptions::explain_rows: every token the model read (the prompt, then the generated or
  // teacher-forced tokens) and the generation, with when each token left each cache (GenerationResult::retention).
  std::vector<int64_t> explained_ids;
  std::shared_ptr<const GenerationResult> explained;
};

struct TaskRunOptions {
  int64_t max_context = 0;        // 0: the task's `max_context`, else the model's context length
  bool clean_context = false;     // token-id rows: score with "clean_prompt_ids" (no distractors)
  tasks::MetricOptions metric;
  // 0: the task's setting (chunk_size / update_interval in its definition), else 128 / 512 (the reference's).
  int64_t chunk_size = 0;
  int64_t memory_update_interval = 0;
  std::set<int64_t> explain_rows;  // rows whose evictions are recorded for an explain page (PromptResult::explained)
};

// The prefill chunk a run of `task` uses: `options.chunk_size`, else the task's, else 128 (the reference's).
int64_t effective_chunk_size(const tasks::TaskSpec& task, const TaskRunOptions& options);

class TaskRunner {
 public:
  TaskRunner(const LlamaModel& model, const Tokenizer& tokenizer) : model_(model), tokenizer_(tokenizer) {}

  // Runs `row` of `task` with `policy` (which serves this one prompt at a time).
  Result<PromptResult> Run(const tasks::TaskSpec& task, const tasks::TaskRow& row, MemoryPolicy& policy,
                           const TaskRunOptions& options) const;

  // One row of a batch, with its own policy object.
  struct Item {
    const tasks::TaskRow* row;
    MemoryPolicy* policy;
  };
  // Runs the items together (Generator::GenerateBatch): each result (or error) is what Run gives that row and
  // policy alone, bit for bit on the CPU in float32, except `seconds`: the row's share of the batch's time.
  std::vector<Result<PromptResult>> RunBatch(const tasks::TaskSpec& task, const std::vector<Item>& items,
                                             const TaskRunOptions& options) const;

 private:
  std::vector<int64_t> EosIds() const;

  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
};

}  // namespace namm::worker
