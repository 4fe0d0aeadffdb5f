// Runs a lease's prompts on the local model: the coordinator client's executor inside namm-worker serve.
// A candidate lease runs its generation's NAMM (the run's architecture with the leased parameters and
// normalization statistics, or collecting fresh statistics per prompt); a reference lease runs the full cache.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "namm/namm_model.h"
#include "namm/tasks/task.h"
#include "namm/worker/coordinator_client.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/task_runner.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

class NammExecutor final : public LeaseExecutor {
 public:
  // `model` is loaded with its checkpoint's RoPE; tasks or the run may ask for another (a variant sharing the
  // weights is made on first use).
  NammExecutor(const LlamaModel& model, const Tokenizer& tokenizer, tasks::TaskPaths paths);

  Status Prepare(const RunInfo& run) override;
  Result<PromptOutcome> RunPrompt(const LeaseWork& lease, int64_t prompt, int slot) override;

 private:
  struct LoadedTask {
    tasks::TaskSpec spec;
    std::vector<tasks::TaskRow> rows;
  };
  Result<std::shared_ptr<const LoadedTask>> Task(const std::string& name);
  Result<const LlamaModel*> ModelFor(const std::string& rope_scaling);

  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
  tasks::TaskPaths paths_;
  std::mutex mu_;
  NammArchitecture architecture_;
  std::string rope_override_;
  std::map<std::string, std::shared_ptr<const LoadedTask>> tasks_;
  std::map<std::string, std::unique_ptr<LlamaModel>> variants_;  // RoPE setting -> model sharing the weights
};

}  // namespace namm::worker
