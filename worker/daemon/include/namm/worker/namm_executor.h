// Runs a lease's prompts on the local model: the coordinator client's executor inside namm-worker serve.
// A candidate lease runs its generation's NAMM (the run's architecture with the leased parameters and
// normalization statistics, or collecting fresh statistics per prompt); a reference lease runs the full cache.
//
// A prompt never takes the daemon down: every torch/c10 exception is caught and becomes the prompt's error,
// which the client reports (the coordinator retries the prompt elsewhere). Out of memory is retried first,
// with the prefill chunk halved each time down to kMinChunkSize: a long prompt that does not fit in one
// chunk's attention may fit in smaller ones.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "namm/cache_budget.h"
#include "namm/namm_model.h"
#include "namm/tasks/task.h"
#include "namm/worker/coordinator_client.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/task_runner.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

class NammExecutor final : public LeaseExecutor {
 public:
  static constexpr int64_t kMinChunkSize = 16;
  // Called before each attempt at a batch of prompts with the chunk size it will use (fault-injection tests
  // throw from it).
  using AttemptHook = std::function<void(const std::vector<PromptJob>& jobs, int64_t chunk_size)>;

  // `model` is loaded with its checkpoint's RoPE; tasks or the run may ask for another (a variant sharing the
  // weights is made on first use).
  NammExecutor(const LlamaModel& model, const Tokenizer& tokenizer, tasks::TaskPaths paths,
               AttemptHook before_attempt = nullptr);

  // Executor threads running batches at once (serve's --units-concurrency): each sizes its batches to this share
  // of the pool.
  void set_concurrency(int threads) { concurrency_ = std::max(1, threads); }

  Status Prepare(const RunInfo& run) override;
  // The jobs through the batched engine (TaskRunner::RunBatch), each with its lease's NAMM (or the full cache).
  // Where the model's caches are in blocks of a pool with a limit (use_kv_blocks: serve's --max-kv-bytes), the jobs
  // run in batches sized by memory: as many together as the KV storage each held when its prompt last ran here
  // (the reference and the candidates apart) fits in the pool, a prompt not yet run counting nothing; those that
  // find the pool dry run again with fewer beside them, then alone. Out of memory (the last resort) splits the
  // batch in halves and runs each; a single prompt out of memory is retried with the prefill chunk halved, down to
  // kMinChunkSize; any other error splits the batch in halves down to the prompt that fails alone, whose error
  // it becomes (the others are not failed with it).
  std::vector<Result<PromptOutcome>> RunPrompts(const std::vector<PromptJob>& jobs, int slot) override;

 private:
  struct LoadedTask {
    tasks::TaskSpec spec;  // a variant's ("T@budget=16"): its base task's
    std::shared_ptr<const std::vector<tasks::TaskRow>> rows;  // a variant's: its base task's, shared
    std::optional<CacheBudget> budget;  // a variant's: the candidates' selection budget
    bool keep_prompt = false;           // a variant's: the candidates keep the prompt until its end
    bool own_head_counts = false;       // a variant's: each KV head keeps its own count (heads=own)
  };
  Result<std::shared_ptr<const LoadedTask>> Task(const std::string& name);
  Result<const LlamaModel*> ModelFor(const std::string& rope_scaling);
  // The jobs in batches that fit the pool (RunPrompts), then RunSplitting each.
  std::vector<Result<PromptOutcome>> RunByMemory(const std::vector<PromptJob>& jobs, const LoadedTask& task,
                                                 int64_t chunk_size);
  // The jobs together; those that found the pool dry again, with fewer beside them.
  std::vector<Result<PromptOutcome>> RunFitting(const std::vector<PromptJob>& jobs, const LoadedTask& task,
                                                int64_t chunk_size);
  // What RunByMemory counts for a job: the KV storage it held when its prompt last ran (0: not run here yet).
  int64_t KvBytesSeen(const PromptJob& job);
  // The jobs (valid prompts of one task) at `chunk_size`, splitting on out of memory.
  std::vector<Result<PromptOutcome>> RunSplitting(const std::vector<PromptJob>& jobs, const LoadedTask& task,
                                                  int64_t chunk_size);
  // One attempt at the jobs with the given prefill chunk; may throw what torch throws.
  std::vector<Result<PromptOutcome>> Attempt(const std::vector<PromptJob>& jobs, const LoadedTask& task,
                                             int64_t chunk_size);

  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
  tasks::TaskPaths paths_;
  AttemptHook before_attempt_;
  int concurrency_ = 1;
  std::mutex mu_;
  NammArchitecture architecture_;
  std::string rope_override_;
  std::map<std::string, std::shared_ptr<const LoadedTask>> tasks_;
  // Per (task, prompt, reference or not): the most KV storage, in whole blocks, a run of it held here.
  std::map<std::tuple<std::string, int64_t, bool>, int64_t> kv_bytes_seen_;
  std::map<std::string, std::unique_ptr<LlamaModel>> variants_;  // RoPE setting -> model sharing the weights
};

}  // namespace namm::worker
