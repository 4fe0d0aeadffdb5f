// A task run with the NAMM's cache held to a budget: "syn/interruption@budget=16" (tokens per KV head) or
// "syn/interruption@ratio=0.1" (a share of the prompt).
//
// Evolution over budgets (issue 36) trains one NAMM to serve several cache sizes by scoring each candidate on
// several variants of a task. A variant is a task of its own wherever scores are kept (the store, fitness, the
// report, the metrics: per-budget scores come with it), while its rows, its prompts and its base-model reference
// scores are the base task's: the full cache does not depend on the NAMM's budget. The reference trains one NAMM
// per operating point and has no variants (docs/namm-core.md).
#pragma once

#include <optional>
#include <string>

#include "namm/cache_budget.h"
#include "namm/status.h"

namespace namm::tasks {

struct TaskVariant {
  std::string base;                   // the task the rows come from: "syn/interruption"
  std::optional<CacheBudget> budget;  // the NAMM's budget knob; nullopt: the task itself (its own selection)
  bool keep_prompt = false;           // "@prompt=keep": the NAMM evicts from the prompt's end on (NammPolicy)
  bool own_head_counts = false;       // "@heads=own": each KV head keeps its own count (NammPolicy)
};

// "TASK", "TASK@budget=N" / "TASK@ratio=R", "TASK@prompt=keep", "TASK@heads=own", or a budget with either or
// both ("TASK@budget=N,prompt=keep,heads=own"); anything else after '@' is an error naming the task.
Result<TaskVariant> parse_task_variant(const std::string& name);
// What a variant adds to a budget: ",prompt=keep" and/or ",heads=own" (empty for neither).
std::string variant_flags(const TaskVariant& variant);

// The part before '@' (the name itself for a plain task): where rows, prompts and reference scores come from.
std::string base_task(const std::string& name);

}  // namespace namm::tasks
