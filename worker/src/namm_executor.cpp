#include "namm/worker/namm_executor.h"

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <exception>

#ifdef NAMM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "namm/policies/full_cache_policy.h"
#include "namm/policies/namm_policy.h"

namespace namm::worker {

namespace {

// Memory in use on a CUDA device (the whole device's: one worker per GPU); 0 on CPU, where metrics fall back
// to the process's resident memory.
int64_t DeviceMemoryInUse(const at::Device& device) {
#ifdef NAMM_WITH_CUDA
  if (device.is_cuda()) {
    int previous = 0;
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device.index()) != cudaSuccess) return 0;
    const bool ok = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
    cudaSetDevice(previous);
    return ok ? static_cast<int64_t>(total_bytes - free_bytes) : 0;
  }
#endif
  (void)device;
  return 0;
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
  auto loaded = std::make_shared<LoadedTask>();
  NAMM_ASSIGN_OR_RETURN(loaded->spec, tasks::find_task(name, paths_));
  NAMM_ASSIGN_OR_RETURN(loaded->rows, tasks::load_rows(loaded->spec));
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
  }
  return variant.get();
}

Result<PromptOutcome> NammExecutor::RunPrompt(const LeaseWork& lease, int64_t prompt, int /*slot*/) {
  NAMM_ASSIGN_OR_RETURN(std::shared_ptr<const LoadedTask> task, Task(lease.task));
  if (prompt < 0 || prompt >= static_cast<int64_t>(task->rows.size())) {
    return Status::InvalidArgument("task " + lease.task + " has " + std::to_string(task->rows.size()) +
                                   " prompts; prompt " + std::to_string(prompt) + " does not exist");
  }
  const std::string what = lease.task + " prompt " + std::to_string(prompt);
  for (int64_t chunk = effective_chunk_size(task->spec, TaskRunOptions{});;) {
    try {
      if (before_attempt_) before_attempt_(lease, prompt, chunk);
      return Attempt(lease, *task, prompt, chunk);
    } catch (const c10::Error& e) {
      const std::string message = FirstLine(e.what_without_backtrace());
      if (!IsOutOfMemory(e)) return Status::Internal("torch failed on " + what + ": " + message);
      if (chunk / 2 < kMinChunkSize) {
        return Status::Internal("out of memory on " + what + " even with a prefill chunk of " +
                                         std::to_string(chunk) + " tokens: " + message);
      }
      spdlog::warn("out of memory on {} with a prefill chunk of {} tokens: retrying with {} ({})", what, chunk,
                   chunk / 2, message);
      chunk /= 2;
    } catch (const std::exception& e) {
      return Status::Internal("failed on " + what + ": " + e.what());
    }
  }
}

Result<PromptOutcome> NammExecutor::Attempt(const LeaseWork& lease, const LoadedTask& task, int64_t prompt,
                                            int64_t chunk_size) {
  std::string rope;
  NammModel namm;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rope = rope_override_.empty() ? task.spec.rope_scaling : rope_override_;
    namm.architecture = architecture_;
  }
  NAMM_ASSIGN_OR_RETURN(const LlamaModel* model, ModelFor(rope));

  std::unique_ptr<MemoryPolicy> policy;
  const NammPolicy* namm_policy = nullptr;
  if (lease.reference) {
    policy = std::make_unique<FullCachePolicy>();
  } else {
    namm.params = *lease.params;
    namm.norm_state = lease.collect_norm_stats ? NormState::kCollecting : NormState::kFrozen;
    if (lease.norm_stats && !lease.collect_norm_stats) namm.norm_stats = *lease.norm_stats;
    NAMM_RETURN_IF_ERROR(namm.Validate());
    NAMM_ASSIGN_OR_RETURN(std::unique_ptr<NammPolicy> p, NammPolicy::Create(namm, model->options().device()));
    p->set_observe_from_query_history(true);  // the engine records each layer's queries
    namm_policy = p.get();
    policy = std::move(p);
  }
  TaskRunner runner(*model, tokenizer_);
  TaskRunOptions options;
  options.chunk_size = chunk_size;
  NAMM_ASSIGN_OR_RETURN(PromptResult r,
                        runner.Run(task.spec, task.rows[static_cast<std::size_t>(prompt)], *policy, options));
  PromptOutcome out;
  out.score = r.score;
  out.prompt_tokens = r.prompt_tokens;
  out.generated_tokens = r.generated_tokens;
  out.seconds = r.seconds;
  out.prefill_tokens = r.prefill_tokens;
  out.decode_tokens = r.decode_tokens;
  out.prefill_seconds = r.prefill_seconds;
  out.decode_seconds = r.decode_seconds;
  out.device_memory_bytes = DeviceMemoryInUse(model->options().device());
  // Cache sizes in tokens per KV head, averaged over layers: the mean over every query of the cached tokens it
  // attended to (eval's measure, docs/evaluation.md), and the size at the end.
  out.cache_size_mean = r.mean_kv_tokens;
  double final_sum = 0;
  for (int64_t s : r.final_cache_sizes) final_sum += static_cast<double>(s);
  out.cache_size_final = r.final_cache_sizes.empty()
                             ? 0
                             : static_cast<int64_t>(std::llround(final_sum / static_cast<double>(r.final_cache_sizes.size())));
  if (lease.collect_norm_stats && namm_policy != nullptr) out.norm_stats = namm_policy->normalizer().stats();
  return out;
}

}  // namespace namm::worker
