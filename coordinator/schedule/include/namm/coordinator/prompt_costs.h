// How long each prompt of a run's tasks takes to run, relatively: what leases are balanced by. A prompt's cost
// is its length in tokens: counted for token-id rows, estimated as UTF-8 bytes / 4 for text prompts (the
// coordinator has no tokenizer; only the order and the rough ratios matter) until a worker reports the tokens it
// ran for the prompt (the run server then uses those).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "namm/coordinator/run_spec.h"
#include "namm/status.h"
#include "namm/tasks/task.h"

namespace namm::coordinator {

using PromptCosts = std::map<std::string, std::vector<double>>;  // task -> cost of each row

// Costs of every row of `task_names`, read from their data files. Errors name the task and the file. A task
// variant ("T@budget=16") gets its base task's rows, and the base task is listed too (its references run).
Result<PromptCosts> load_prompt_costs(const std::vector<std::string>& task_names, const tasks::TaskPaths& paths);

// The number of rows of each task, as Trainer::Create wants it.
std::map<std::string, int64_t> row_counts(const PromptCosts& costs);

// The expected cost of `spec`'s generations from `first` to its end: each generation runs population ×
// prompts_per_task prompts of each task of its stage at the task's mean cost, plus the evaluation of the mean
// where the schedule has one. What an ETA weighs the generations left by: a stage with twice the tasks, or
// longer prompts, takes longer per generation. Tasks missing from `costs` count 1 per prompt.
double remaining_cost(const RunSpec& spec, const PromptCosts& costs, int64_t first);

}  // namespace namm::coordinator
