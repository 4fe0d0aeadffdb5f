#include "namm/coordinator/prompt_costs.h"

#include <algorithm>
#include <numeric>

#include "namm/tasks/task_variant.h"

namespace namm::coordinator {

Result<PromptCosts> load_prompt_costs(const std::vector<std::string>& task_names, const tasks::TaskPaths& paths) {
  PromptCosts costs;
  for (const std::string& name : task_names) {
    NAMM_ASSIGN_OR_RETURN(const tasks::TaskVariant variant, tasks::parse_task_variant(name));
    if (costs.count(variant.base) == 0) {
      NAMM_ASSIGN_OR_RETURN(tasks::TaskSpec task, tasks::find_task(variant.base, paths));
      NAMM_ASSIGN_OR_RETURN(std::vector<tasks::TaskRow> rows, tasks::load_rows(task));
      if (rows.empty()) return Status::InvalidArgument("task " + name + ": " + task.data_path + " has no rows");
      std::vector<double> c;
      for (const tasks::TaskRow& row : rows) {
        if (task.prompt_source == tasks::PromptSource::kTokenIds) {
          const auto ids = row.fields.find("prompt_ids");
          c.push_back(ids != row.fields.end() && ids->is_array() ? static_cast<double>(ids->size()) : 1.0);
          continue;
        }
        NAMM_ASSIGN_OR_RETURN(std::string prompt, tasks::build_prompt(task, row));
        c.push_back(1.0 + static_cast<double>(prompt.size()) / 4.0);
      }
      costs[variant.base] = std::move(c);
    }
    if (name != variant.base) costs[name] = costs.at(variant.base);
  }
  return costs;
}

std::map<std::string, int64_t> row_counts(const PromptCosts& costs) {
  std::map<std::string, int64_t> rows;
  for (const auto& [task, c] : costs) rows[task] = static_cast<int64_t>(c.size());
  return rows;
}

double remaining_cost(const RunSpec& spec, const PromptCosts& costs, int64_t first) {
  const StageSchedule schedule = spec.schedule();
  // Per task: its rows and the mean cost of a prompt (1 for a task without costs).
  std::map<std::string, std::pair<int64_t, double>> tasks;
  for (const auto& [task, c] : costs) {
    if (!c.empty()) tasks[task] = {static_cast<int64_t>(c.size()), std::accumulate(c.begin(), c.end(), 0.0) / static_cast<double>(c.size())};
  }
  // `prompts` prompts of `task` (<= 0: all of them).
  const auto task_cost = [&](const std::string& task, int64_t prompts) {
    const auto it = tasks.find(task);
    if (it == tasks.end()) return static_cast<double>(prompts);
    const auto [rows, mean] = it->second;
    return mean * static_cast<double>(std::min(prompts <= 0 ? rows : prompts, rows));
  };
  double total = 0;
  for (int64_t g = std::max<int64_t>(0, first); g < schedule.total_generations(); ++g) {
    const ScheduledGeneration at = schedule.At(g);
    for (const std::string& task : spec.stages[static_cast<std::size_t>(at.stage)].tasks) {
      total += static_cast<double>(spec.cmaes.population) * task_cost(task, spec.prompts_per_task);
      if (at.evaluate_mean) total += task_cost(task, spec.eval_prompts);
    }
  }
  return total;
}

}  // namespace namm::coordinator
