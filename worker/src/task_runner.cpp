#include "namm/worker/task_runner.h"

#include <ATen/ops/log_softmax.h>

#include <chrono>
#include <cmath>

#include "aten.h"

namespace namm::worker {

namespace {

Result<std::vector<int64_t>> IdField(const tasks::TaskSpec& task, const tasks::TaskRow& row, const char* field) {
  const auto where = "task " + task.name + " row " + std::to_string(row.index);
  if (!row.fields.contains(field) || !row.fields[field].is_array()) {
    return Status::InvalidArgument(where + ": needs an integer array '" + field + "'");
  }
  std::vector<int64_t> ids;
  for (const auto& v : row.fields[field]) {
    if (!v.is_number_integer()) return Status::InvalidArgument(where + ": '" + field + "' holds a non-integer");
    ids.push_back(v.get<int64_t>());
  }
  return ids;
}

}  // namespace

std::vector<int64_t> TaskRunner::EosIds() const {
  std::vector<int64_t> ids = model_.config().eos_token_ids;
  for (int64_t id : tokenizer_.eos_ids()) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  }
  return ids;
}

namespace {

void RecordWork(const GenerationResult& g, PromptResult* out) {
  out->mean_kv_tokens = g.mean_kv_tokens;
  out->answer_kv_tokens = g.answer_kv_tokens;
  out->peak_kv_tokens = g.peak_kv_tokens;
  out->prefill_tokens = g.prompt_tokens;
  out->decode_tokens = g.decode_steps;
  out->prefill_seconds = g.prefill_seconds;
  out->decode_seconds = g.decode_seconds;
}

}  // namespace

int64_t effective_chunk_size(const tasks::TaskSpec& task, const TaskRunOptions& options) {
  return options.chunk_size > 0 ? options.chunk_size : task.chunk_size > 0 ? task.chunk_size : 128;
}

Result<PromptResult> TaskRunner::Run(const tasks::TaskSpec& task, const tasks::TaskRow& row, MemoryPolicy& policy,
                                     const TaskRunOptions& options) const {
  const auto start = std::chrono::steady_clock::now();
  const int64_t context = options.max_context > 0   ? options.max_context
                          : task.max_context > 0    ? task.max_context
                                                    : model_.config().context_length();
  GenerationOptions generation;
  generation.max_context = context;
  generation.chunk_size = effective_chunk_size(task, options);
  generation.memory_update_interval = options.memory_update_interval > 0 ? options.memory_update_interval
                                      : task.update_interval > 0          ? task.update_interval
                                                                          : 512;
  generation.eos_ids = EosIds();
  Generator generator(model_, tokenizer_);
  PromptResult out;
  out.row = row.index;

  std::vector<int64_t> prompt;
  std::vector<int64_t> continuation;
  if (task.prompt_source == tasks::PromptSource::kTokenIds) {
    NAMM_ASSIGN_OR_RETURN(prompt, IdField(task, row, options.clean_context ? "clean_prompt_ids" : "prompt_ids"));
    if (task.scoring != tasks::Scoring::kGeneration) {
      NAMM_ASSIGN_OR_RETURN(continuation, IdField(task, row, "continuation_ids"));
    }
  } else {
    NAMM_ASSIGN_OR_RETURN(std::string text, tasks::build_prompt(task, row));
    auto fitted = truncate_to_context(tokenizer_, text, context, task.max_new_tokens);
    if (!fitted.ok()) return fitted.status().WithContext("task " + task.name);
    prompt = std::move(fitted->ids);
    generation.max_context = fitted->context;
  }
  out.prompt_tokens = static_cast<int64_t>(prompt.size());

  if (task.scoring == tasks::Scoring::kGeneration) {
    generation.max_new_tokens = task.max_new_tokens;
    generation.stop_strings = task.stop_strings;
    NAMM_ASSIGN_OR_RETURN(GenerationResult result, generator.Generate(prompt, policy, generation));
    NAMM_ASSIGN_OR_RETURN(out.score, tasks::score_generation(task, row, result.text, options.metric));
    out.prediction = std::move(result.text);
    out.generated_tokens = static_cast<int64_t>(result.token_ids.size());
    out.updates = std::move(result.updates);
    out.final_cache_sizes = std::move(result.final_cache_sizes);
    RecordWork(result, &out);
  } else {
    // Teacher forcing: the continuation follows the prompt as decoded tokens would (after the policy's
    // end-of-prefill hook, through the memory updates that fall in it), and the logits at each of its positions
    // are compared with the next true token.
    if (continuation.empty()) return Status::InvalidArgument("task " + task.name + " row " + std::to_string(row.index) + ": empty continuation");
    generation.max_new_tokens = 0;
    generation.teacher_forcing = true;
    generation.forced_tokens.assign(continuation.begin(), continuation.end() - 1);
    NAMM_ASSIGN_OR_RETURN(GenerationResult result, generator.Generate(prompt, policy, generation));
    const int64_t n = static_cast<int64_t>(continuation.size());
    const at::Tensor& logits = result.forced_logits;
    const at::Tensor targets = at::from_blob(continuation.data(), {n}, at::TensorOptions().dtype(at::kLong).device(at::kCPU))
                                   .to(logits.device(), /*non_blocking=*/false, /*copy=*/true);
    if (task.scoring == tasks::Scoring::kLikelihood) {
      const at::Tensor log_probs = at::log_softmax(logits.to(at::kDouble), -1).gather(1, targets.unsqueeze(1));
      out.score = std::exp(log_probs.mean().item<double>());
    } else {
      out.score = logits.argmax(-1).eq(targets).to(at::kDouble).mean().item<double>();
    }
    out.generated_tokens = n;
    out.updates = std::move(result.updates);
    out.final_cache_sizes = std::move(result.final_cache_sizes);
    RecordWork(result, &out);
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace namm::worker
