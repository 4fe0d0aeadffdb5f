#include "namm/tasks/task_variant.h"

#include "namm/option_spec.h"

namespace namm::tasks {

std::string base_task(const std::string& name) { return name.substr(0, name.find('@')); }

Result<TaskVariant> parse_task_variant(const std::string& name) {
  TaskVariant variant{base_task(name), std::nullopt, false};
  if (variant.base.empty()) return Status::InvalidArgument("task '" + name + "' has no name before '@'");
  if (variant.base.size() == name.size()) return variant;
  const std::string setting = name.substr(variant.base.size() + 1);
  const auto where = [&](const Status& s) {
    return s.WithContext("task '" + name + "' (a variant is TASK@budget=N or TASK@ratio=R, and/or prompt=keep)");
  };
  Result<OptionSpec> options = parse_option_spec("variant:" + setting);
  if (!options.ok()) return where(options.status());
  const Status keys = options->CheckKeys({"budget", "ratio", "prompt"});
  if (!keys.ok()) return where(keys);
  if (const auto prompt = options->options.find("prompt"); prompt != options->options.end()) {
    if (prompt->second != "keep") return where(Status::InvalidArgument("prompt= takes keep, got '" + prompt->second + "'"));
    variant.keep_prompt = true;
    options->options.erase(prompt);
    if (options->options.empty()) return variant;
  }
  Result<CacheBudget> budget = CacheBudget::FromSpec(*options);
  if (!budget.ok()) return where(budget.status());
  variant.budget = *budget;
  return variant;
}

}  // namespace namm::tasks
