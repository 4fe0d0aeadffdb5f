#include "namm/worker/namm_executor.h"

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <exception>

#include "namm/policies/full_cache_policy.h"
#include "namm/policies/namm_policy.h"
#include "namm/tasks/task_variant.h"
#include "namm/worker/device_memory.h"

namespace namm::worker {

namespace {

// Memory in use on a CUDA device (the whole device's: one worker per GPU); 0 on CPU, where metrics fall back
// to the process's resident memory.
int64_t DeviceMemoryInUse(const at::Device& device) {
  if (!device.is_cuda()) return 0;
  const DeviceMemory memory = device_memory(device);
  return memory.total - memory.free;
}

// CUDA's caching allocator throws OutOfMemoryError; other allocators and libraries (the CPU allocator, cuBLAS)
// throw a plain c10::Error that says so.
bool IsOutOfMemory(const c10::Error& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  const std::string what = e.what_without_backtrace();
  return what.find("out of memory") != std::string::npos || what.find("not enough memory") != std::string::npos ||
         what.find("ALLOC_FAILED") != std::string::npos;
}

// The first line of a torch message (they carry multi-line context).
std::string FirstLine(const std::string& message) { return message.substr(0, message.find('\n')); }

}  // namespace

NammExecutor::NammExecutor(const LlamaModel& model, const Tokenizer& tokenizer, tasks::TaskPaths paths,
                           AttemptHook before_attempt)
    : model_(model), tokenizer_(tokenizer), paths_(std::move(paths)), before_attempt_(std::move(before_attempt)) {}

Status NammExecutor::Prepare(const RunInfo& run) {
  NAMM_ASSIGN_OR_RETURN(NammArchitecture architecture, NammArchitecture::FromJson(run.architecture_json));
  NAMM_RETURN_IF_ERROR(architecture.Validate());
  if (!run.rope_scaling.empty()) NAMM_RETURN_IF_ERROR(RopeScaling::Parse(run.rope_scaling).status());
  std::lock_guard<std::mutex> lock(mu_);
  architecture_ = architecture;
  rope_override_ = run.rope_scaling;
  return Status::Ok();
}

Result<std::shared_ptr<const NammExecutor::LoadedTask>> NammExecutor::Task(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (const auto it = tasks_.find(name); it != tasks_.end()) return it->second;
  NAMM_ASSIGN_OR_RETURN(const tasks::TaskVariant variant, tasks::parse_task_variant(name));
  // A variant shares its base task's rows: they are read once, whatever the number of budgets.
  std::shared_ptr<const LoadedTask> base;
  if (const auto it = tasks_.find(variant.base); it != tasks_.end()) {
    base = it->second;
  } else {
    auto loaded = std::make_shared<LoadedTask>();
    NAMM_ASSIGN_OR_RETURN(loaded->spec, tasks::find_task(variant.base, paths_));
    NAMM_ASSIGN_OR_RETURN(std::vector<tasks::TaskRow> rows, tasks::load_rows(loaded->spec));
    loaded->rows = std::make_shared<const std::vector<tasks::TaskRow>>(std::move(rows));
    base = tasks_[variant.base] = std::move(loaded);
  }
  if (!variant.budget && !variant.keep_prompt && !variant.own_head_counts) return base;
  auto loaded = std::make_shared<LoadedTask>(*base);
  loaded->budget = variant.budget;
  loaded->keep_prompt = variant.keep_prompt;
  loaded->own_head_counts = variant.own_head_counts;
  tasks_[name] = loaded;
  return std::shared_ptr<const LoadedTask>(loaded);
}

Result<const LlamaModel*> NammExecutor::ModelFor(const std::string& rope_scaling) {
  if (rope_scaling.empty()) return &model_;
  std::lock_guard<std::mutex> lock(mu_);
  auto& variant = variants_[rope_scaling];
  if (!variant) {
    NAMM_ASSIGN_OR_RETURN(RopeScaling scaling, RopeScaling::Parse(rope_scaling));
    LlamaConfig config = model_.config();
    config.rope_scaling = scaling;
    variant = std::make_unique<LlamaModel>(LoadedModel{config, model_.weights()}, model_.options());
    NAMM_RETURN_IF_ERROR(variant->set_kv_block_pool(model_.kv_block_pool()));  // one pool for all
  }
  return variant.get();
}

std::vector<Result<PromptOutcome>> NammExecutor::RunPrompts(const std::vector<PromptJob>& jobs, int /*slot*/) {
  std::vector<Result<PromptOutcome>> outcomes(jobs.size(), Result<PromptOutcome>(Status::Internal("not run")));
  if (jobs.empty()) return outcomes;
  const std::string& task_name = jobs.front().lease->task;
  Result<std::shared_ptr<const LoadedTask>> task = Task(task_name);
  std::vector<PromptJob> valid;
  std::vector<std::size_t> where;  // valid[i] is jobs[where[i]]
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    const int64_t prompt = jobs[j].prompt;
    if (!task.ok()) {
      outcomes[j] = task.status();
    } else if (jobs[j].lease->task != task_name) {
      outcomes[j] = Status::InvalidArgument("a batch runs one task: " + jobs[j].lease->task + " beside " + task_name);
    } else if (prompt < 0 || prompt >= static_cast<int64_t>((*task)->rows->size())) {
      outcomes[j] = Status::InvalidArgument("task " + task_name + " has " + std::to_string((*task)->rows->size()) +
                                            " prompts; prompt " + std::to_string(prompt) + " does not exist");
    } else {
      valid.push_back(jobs[j]);
      where.push_back(j);
    }
  }
  if (valid.empty()) return outcomes;
  std::vector<Result<PromptOutcome>> ran =
      RunByMemory(valid, **task, effective_chunk_size((*task)->spec, TaskRunOptions{}));
  for (std::size_t i = 0; i < valid.size(); ++i) outcomes[where[i]] = std::move(ran[i]);
  return outcomes;
}

int64_t NammExecutor::KvBytesSeen(const PromptJob& job) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = kv_bytes_seen_.find({job.lease->task, job.prompt, job.lease->reference});
  return it == kv_bytes_seen_.end() ? 0 : it->second;
}

std::vector<Result<PromptOutcome>> NammExecutor::RunByMemory(const std::vector<PromptJob>& jobs,
                                                             const LoadedTask& task, int64_t chunk_size) {
  const std::shared_ptr<KvBlockPool>& pool = model_.kv_block_pool();
  if (pool == nullptr || pool->max_blocks() == 0) return RunSplitting(jobs, task, chunk_size);
  const int64_t budget = pool->max_blocks() * pool->block_bytes() / concurrency_;
  std::vector<Result<PromptOutcome>> outcomes;
  std::vector<PromptJob> batch;
  int64_t bytes = 0;
  const auto run = [&] {
    if (batch.size() > 1) {
      spdlog::debug("{} prompts of {} together: {} bytes of KV seen", batch.size(), jobs.front().lease->task, bytes);
    }
    for (auto& r : RunFitting(batch, task, chunk_size)) outcomes.push_back(std::move(r));
    batch.clear();
    bytes = 0;
  };
  for (const PromptJob& job : jobs) {
    const int64_t need = KvBytesSeen(job);
    if (!batch.empty() && bytes + need > budget) run();
    batch.push_back(job);
    bytes += need;
  }
  if (!batch.empty()) run();
  return outcomes;
}

std::vector<Result<PromptOutcome>> NammExecutor::RunFitting(const std::vector<PromptJob>& jobs, const LoadedTask& task,
                                                            int64_t chunk_size) {
  std::vector<Result<PromptOutcome>> outcomes = RunSplitting(jobs, task, chunk_size);
  // A row whose cache found the pool dry failed alone (LayerKVCache::Append); the others finished.
  std::vector<std::size_t> dry;
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    if (!outcomes[i].ok() && KvBlockPool::IsExhausted(outcomes[i].status())) dry.push_back(i);
  }
  if (dry.empty() || jobs.size() == 1) return outcomes;  // alone it cannot fit: its error says so
  // Again with fewer beside them: the dry ones together, or, when every row was, each half apart.
  std::vector<PromptJob> again;
  for (std::size_t i : dry) again.push_back(jobs[i]);
  spdlog::warn("the KV block pool ran dry for {} of {} prompts of {}: running them again with fewer beside them",
               dry.size(), jobs.size(), jobs.front().lease->task);
  std::vector<Result<PromptOutcome>> rerun;
  if (again.size() < jobs.size()) {
    rerun = RunFitting(again, task, chunk_size);
  } else {
    const auto half = static_cast<std::ptrdiff_t>(again.size() / 2);
    rerun = RunFitting({again.begin(), again.begin() + half}, task, chunk_size);
    for (auto& r : RunFitting({again.begin() + half, again.end()}, task, chunk_size)) rerun.push_back(std::move(r));
  }
  for (std::size_t k = 0; k < dry.size(); ++k) outcomes[dry[k]] = std::move(rerun[k]);
  return outcomes;
}

std::vector<Result<PromptOutcome>> NammExecutor::RunSplitting(const std::vector<PromptJob>& jobs,
                                                              const LoadedTask& task, int64_t chunk_size) {
  const auto describe = [&] {
    std::string prompts;
    for (const PromptJob& job : jobs) prompts += (prompts.empty() ? "" : ",") + std::to_string(job.prompt);
    return jobs.front().lease->task + (jobs.size() == 1 ? " prompt " : " prompts ") + prompts;
  };
  const auto all_fail = [&](const Status& status) { return std::vector<Result<PromptOutcome>>(jobs.size(), status); };
  // Each half apart, at `chunk` (a prompt's outcome does not depend on its batch).
  const auto halves = [&](int64_t chunk) {
    const auto half = static_cast<std::ptrdiff_t>(jobs.size() / 2);
    std::vector<Result<PromptOutcome>> first = RunSplitting({jobs.begin(), jobs.begin() + half}, task, chunk);
    std::vector<Result<PromptOutcome>> second = RunSplitting({jobs.begin() + half, jobs.end()}, task, chunk);
    for (auto& r : second) first.push_back(std::move(r));
    return first;
  };
  // Another error fails the prompt that causes it, not the prompts batched with it: a batch is run again in
  // halves down to the one that fails alone.
  const auto failed = [&](const std::string& error) {
    if (jobs.size() == 1) return all_fail(Status::Internal(error));
    spdlog::warn("{}: running the prompts apart to find the one that fails", error);
    return halves(chunk_size);
  };
  for (int64_t chunk = chunk_size;;) {
    try {
      if (before_attempt_) before_attempt_(jobs, chunk);
      return Attempt(jobs, task, chunk);
    } catch (const c10::Error& e) {
      const std::string message = FirstLine(e.what_without_backtrace());
      if (!IsOutOfMemory(e)) return failed("torch failed on " + describe() + ": " + message);
      if (jobs.size() > 1) {  // fewer rows first
        spdlog::warn("out of memory on {} together: running {} and {} apart ({})", describe(), jobs.size() / 2,
                     jobs.size() - jobs.size() / 2, message);
        return halves(chunk);
      }
      if (chunk / 2 < kMinChunkSize) {
        return all_fail(Status::Internal("out of memory on " + describe() + " even with a prefill chunk of " +
                                         std::to_string(chunk) + " tokens: " + message));
      }
      spdlog::warn("out of memory on {} with a prefill chunk of {} tokens: retrying with {} ({})", describe(), chunk,
                   chunk / 2, message);
      chunk /= 2;
    } catch (const std::exception& e) {
      return failed("failed on " + describe() + ": " + e.what());
    }
  }
}

std::vector<Result<PromptOutcome>> NammExecutor::Attempt(const std::vector<PromptJob>& jobs, const LoadedTask& task,
                                                         int64_t chunk_size) {
  std::string rope;
  NammArchitecture architecture;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rope = rope_override_.empty() ? task.spec.rope_scaling : rope_override_;
    architecture = architecture_;
  }
  std::vector<Result<PromptOutcome>> outcomes(jobs.size(), Result<PromptOutcome>(Status::Internal("not run")));
  const Result<const LlamaModel*> model = ModelFor(rope);
  if (!model.ok()) return std::vector<Result<PromptOutcome>>(jobs.size(), model.status());

  // One policy per prompt: a lease's NAMM (its parameters and statistics), or the full cache.
  std::vector<std::unique_ptr<MemoryPolicy>> policies(jobs.size());
  std::vector<const NammPolicy*> namm_policies(jobs.size(), nullptr);
  std::vector<TaskRunner::Item> items;
  std::vector<std::size_t> where;
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    const LeaseWork& lease = *jobs[j].lease;
    if (lease.reference) {
      policies[j] = std::make_unique<FullCachePolicy>();
    } else {
      NammModel namm;
      namm.architecture = architecture;
      namm.params = *lease.params;
      namm.norm_state = lease.collect_norm_stats ? NormState::kCollecting : NormState::kFrozen;
      if (lease.norm_stats && !lease.collect_norm_stats) namm.norm_stats = *lease.norm_stats;
      Status valid = namm.Validate();
      Result<std::unique_ptr<NammPolicy>> p =
          valid.ok() ? NammPolicy::Create(namm, (*model)->options().device()) : Result<std::unique_ptr<NammPolicy>>(valid);
      if (!p.ok()) {
        outcomes[j] = p.status();
        continue;
      }
      (*p)->set_observe_from_query_history(true);  // the engine records each layer's queries
      if (task.budget) (*p)->set_selection_budget(*task.budget);
      (*p)->set_keep_prompt(task.keep_prompt);
      if (task.own_head_counts && !(*model)->options().device().is_cpu()) {
        outcomes[j] = Status::InvalidArgument("task variant heads=own (ragged KV caches) runs on the CPU, not " +
                                              (*model)->options().device().str());
        continue;
      }
      (*p)->set_own_head_counts(task.own_head_counts);
      namm_policies[j] = p->get();
      policies[j] = std::move(p).value();
    }
    items.push_back({&(*task.rows)[static_cast<std::size_t>(jobs[j].prompt)], policies[j].get()});
    where.push_back(j);
  }
  TaskRunOptions options;
  options.chunk_size = chunk_size;
  std::vector<Result<PromptResult>> ran = TaskRunner(**model, tokenizer_).RunBatch(task.spec, items, options);
  const int64_t device_memory = DeviceMemoryInUse((*model)->options().device());
  for (std::size_t i = 0; i < where.size(); ++i) {
    const std::size_t j = where[i];
    if (!ran[i].ok()) {
      outcomes[j] = ran[i].status();
      continue;
    }
    const PromptResult& r = *ran[i];
    PromptOutcome out;
    out.score = r.score;
    out.prompt_tokens = r.prompt_tokens;
    out.generated_tokens = r.generated_tokens;
    out.seconds = r.seconds;
    out.prefill_tokens = r.prefill_tokens;
    out.decode_tokens = r.decode_tokens;
    out.prefill_seconds = r.prefill_seconds;
    out.decode_seconds = r.decode_seconds;
    out.device_memory_bytes = device_memory;
    if (const std::shared_ptr<KvBlockPool>& pool = (*model)->kv_block_pool(); pool != nullptr) {
      // Its peak in whole blocks, one more per layer and head: the mean over layers hides the largest layer.
      const LlamaConfig& c = (*model)->config();
      const auto blocks = static_cast<int64_t>(std::ceil(r.peak_kv_tokens / static_cast<double>(pool->block_tokens()))) + 1;
      const int64_t held = blocks * c.n_layers * c.n_kv_heads * pool->block_bytes();
      std::lock_guard<std::mutex> lock(mu_);
      int64_t& seen = kv_bytes_seen_[{jobs[j].lease->task, jobs[j].prompt, jobs[j].lease->reference}];
      seen = std::max(seen, held);
    }
    // Cache sizes in tokens per KV head, averaged over layers: the mean over every query of the cached tokens it
    // attended to (eval's measure, docs/evaluation.md), and the size at the end.
    out.cache_size_mean = r.mean_kv_tokens;
    double final_sum = 0;
    for (int64_t s : r.final_cache_sizes) final_sum += static_cast<double>(s);
    out.cache_size_final = r.final_cache_sizes.empty()
                               ? 0
                               : static_cast<int64_t>(std::llround(final_sum / static_cast<double>(r.final_cache_sizes.size())));
    if (jobs[j].lease->collect_norm_stats && namm_policies[j] != nullptr) out.norm_stats = namm_policies[j]->normalizer().stats();
    outcomes[j] = std::move(out);
  }
  return outcomes;
}

}  // namespace namm::worker
