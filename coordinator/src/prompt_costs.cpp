#include "namm/coordinator/prompt_costs.h"

namespace namm::coordinator {

Result<PromptCosts> load_prompt_costs(const std::vector<std::string>& task_names, const tasks::TaskPaths& paths) {
  PromptCosts costs;
  for (const std::string& name : task_names) {
    NAMM_ASSIGN_OR_RETURN(tasks::TaskSpec task, tasks::find_task(name, paths));
    NAMM_ASSIGN_OR_RETURN(std::vector<tasks::TaskRow> rows, tasks::load_rows(task));
    if (rows.empty()) return Status::InvalidArgument("task " + name + ": " + task.data_path + " has no rows");
    std::vector<double>& c = costs[name];
    for (const tasks::TaskRow& row : rows) {
      if (task.prompt_source == tasks::PromptSource::kTokenIds) {
        const auto ids = row.fields.find("prompt_ids");
        c.push_back(ids != row.fields.end() && ids->is_array() ? static_cast<double>(ids->size()) : 1.0);
        continue;
      }
      NAMM_ASSIGN_OR_RETURN(std::string prompt, tasks::build_prompt(task, row));
      c.push_back(1.0 + static_cast<double>(prompt.size()) / 4.0);
    }
  }
  return costs;
}

std::map<std::string, int64_t> row_counts(const PromptCosts& costs) {
  std::map<std::string, int64_t> rows;
  for (const auto& [task, c] : costs) rows[task] = static_cast<int64_t>(c.size());
  return rows;
}

}  // namespace namm::coordinator
