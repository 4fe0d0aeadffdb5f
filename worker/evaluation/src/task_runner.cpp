#include "namm/worker/task_runner.h"

#include <ATen/ops/log_softmax.h>

#include <chrono>
#include <cmath>

#include <ATen/ops/from_blob.h>

namespace namm::worker {

namespace {

// The row's token ids in `field`, each in [0, vocab): a continuation's last id is never fed to the model, only
// looked up in its logits, where one out of range failed a whole batch (CPU) or the device (CUDA) unnamed.
Result<std::vector<int64_t>> IdField(const tasks::TaskSpec& task, const tasks::TaskRow& row, const char* field,
                                     int64_t vocab) {
  const auto where = "task " + task.name + " row " + std::to_string(row.index);
  if (!row.fields.contains(field) || !row.fields[field].is_array()) {
    return Status::InvalidArgument(where + ": needs an integer array '" + field + "'");
  }
  std::vector<int64_t> ids;
  for (const auto& v : row.fields[field]) {
    if (!v.is_number_integer()) return Status::InvalidArgument(where + ": '" + field + "' holds a non-integer");
    if (v.is_number_unsigned() ? v.get<uint64_t>() >= static_cast<uint64_t>(vocab)
                               : v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab) {
      return Status::InvalidArgument(where + ": '" + field + "' holds token id " + v.dump() +
                                     ", outside the model's vocabulary of " + std::to_string(vocab));
    }
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

namespace {

// A row made ready to generate: its prompt, the options, and for teacher-forced scoring the continuation.
struct Prepared {
  std::vector<int64_t> prompt, continuation;
  GenerationOptions generation;
};

Result<PromptResult> Score(const tasks::TaskSpec& task, const tasks::TaskRow& row, const Prepared& prepared,
                           GenerationResult result, const TaskRunOptions& options) {
  PromptResult out;
  out.row = row.index;
  out.prompt_tokens = static_cast<int64_t>(prepared.prompt.size());
  if (task.scoring == tasks::Scoring::kGeneration) {
    NAMM_ASSIGN_OR_RETURN(out.score, tasks::score_generation(task, row, result.text, options.metric));
    out.prediction = std::move(result.text);
    out.generated_tokens = static_cast<int64_t>(result.token_ids.size());
  } else {
    // The logits at each of the continuation's positions against the next true token.
    std::vector<int64_t> continuation = prepared.continuation;
    const auto n = static_cast<int64_t>(continuation.size());
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
  }
  RecordWork(result, &out);
  if (prepared.generation.record_retention) {
    out.explained_ids = prepared.prompt;
    const std::vector<int64_t>& after = task.scoring == tasks::Scoring::kGeneration ? result.token_ids
                                                                                   : prepared.generation.forced_tokens;
    out.explained_ids.insert(out.explained_ids.end(), after.begin(), after.end());
    out.updates = result.updates;
    out.final_cache_sizes = result.final_cache_sizes;
    out.explained = std::make_shared<const GenerationResult>(std::move(result));
    return out;
  }
  out.updates = std::move(result.updates);
  out.final_cache_sizes = std::move(result.final_cache_sizes);
  return out;
}

}  // namespace

Result<PromptResult> TaskRunner::Run(const tasks::TaskSpec& task, const tasks::TaskRow& row, MemoryPolicy& policy,
                                     const TaskRunOptions& options) const {
  return std::move(RunBatch(task, {Item{&row, &policy}}, options).front());
}

std::vector<Result<PromptResult>> TaskRunner::RunBatch(const tasks::TaskSpec& task, const std::vector<Item>& items,
                                                       const TaskRunOptions& options) const {
  const auto start = std::chrono::steady_clock::now();
  const int64_t context = options.max_context > 0   ? options.max_context
                          : task.max_context > 0    ? task.max_context
                                                    : model_.config().context_length();
  const auto prepare = [&](const tasks::TaskRow& row) -> Result<Prepared> {
    Prepared p;
    GenerationOptions& generation = p.generation;
    generation.max_context = context;
    generation.chunk_size = effective_chunk_size(task, options);
    generation.memory_update_interval = options.memory_update_interval > 0 ? options.memory_update_interval
                                        : task.update_interval > 0          ? task.update_interval
                                                                            : 512;
    generation.eos_ids = EosIds();
    generation.record_retention = options.explain_rows.count(row.index) > 0;
    if (task.prompt_source == tasks::PromptSource::kTokenIds) {
      NAMM_ASSIGN_OR_RETURN(p.prompt, IdField(task, row, options.clean_context ? "clean_prompt_ids" : "prompt_ids",
                                                   model_.config().vocab_size));
      if (task.scoring != tasks::Scoring::kGeneration) {
        NAMM_ASSIGN_OR_RETURN(p.continuation, IdField(task, row, "continuation_ids", model_.config().vocab_size));
      }
    } else {
      NAMM_ASSIGN_OR_RETURN(std::string text, tasks::build_prompt(task, row));
      auto fitted = truncate_to_context(task.chat ? tokenizer_ : tokenizer_.without_chat(), text, context,
                                        task.max_new_tokens);
      if (!fitted.ok()) return fitted.status().WithContext("task " + task.name);
      p.prompt = std::move(fitted->ids);
      generation.max_context = fitted->context;
    }
    if (task.scoring == tasks::Scoring::kGeneration) {
      generation.max_new_tokens = task.max_new_tokens;
      generation.stop_strings = task.stop_strings;
    } else {
      // Teacher forcing: the continuation follows the prompt as decoded tokens would (after the policy's
      // end-of-prefill hook, through the memory updates that fall in it).
      if (p.continuation.empty()) {
        return Status::InvalidArgument("task " + task.name + " row " + std::to_string(row.index) + ": empty continuation");
      }
      generation.max_new_tokens = 0;
      generation.teacher_forcing = true;
      generation.forced_tokens.assign(p.continuation.begin(), p.continuation.end() - 1);
    }
    return p;
  };

  std::vector<Result<PromptResult>> results(items.size(), Result<PromptResult>(Status::Internal("not run")));
  std::vector<Prepared> prepared;
  std::vector<std::size_t> item_of;  // prepared[i] is items[item_of[i]]
  std::vector<Generator::Request> requests;
  for (std::size_t i = 0; i < items.size(); ++i) {
    Result<Prepared> p = prepare(*items[i].row);
    if (!p.ok()) {
      results[i] = p.status();
      continue;
    }
    requests.push_back(Generator::Request{p->prompt, items[i].policy, p->generation});
    prepared.push_back(std::move(p).value());
    item_of.push_back(i);
  }
  std::vector<Result<GenerationResult>> generated = Generator(model_, tokenizer_).GenerateBatch(requests);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (std::size_t j = 0; j < generated.size(); ++j) {
    const std::size_t i = item_of[j];
    if (!generated[j].ok()) {
      results[i] = generated[j].status();
      continue;
    }
    results[i] = Score(task, *items[i].row, prepared[j], std::move(generated[j]).value(), options);
    if (results[i].ok()) results[i]->seconds = seconds / static_cast<double>(items.size());
  }
  return results;
}

}  // namespace namm::worker
