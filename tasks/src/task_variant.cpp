#include "namm/tasks/task_variant.h"

#include "namm/option_spec.h"

namespace namm::tasks {

std::string base_task(const std::string& name) { return name.substr(0, name.find('@')); }

Result<TaskVariant> parse_task_variant(const std::string& name) {
  TaskVariant variant{base_task(name), std::nullopt, false, false};
  if (variant.base.empty()) return Status::InvalidArgument("task '" + name + "' has no name before '@'");
  if (variant.base.size() == name.size()) return variant;
  const std::string setting = name.substr(variant.base.size() + 1);
  const auto where = [&](const Status& s) {
    return s.WithContext("task '" + name +
                         "' (a variant is TASK@budget=N or TASK@ratio=R, and/or prompt=keep, and/or heads=own)");
  };
  Result<OptionSpec> options = parse_option_spec("variant:" + setting);
  if (!options.ok()) return where(options.status());
  const Status keys = options->CheckKeys({"budget", "ratio", "prompt", "heads"});
  if (!keys.ok()) return where(keys);
  if (const auto heads = options->options.find("heads"); heads != options->options.end()) {
    if (heads->second != "own") return where(Status::InvalidArgument("heads= takes own, got '" + heads->second + "'"));
    variant.own_head_counts = true;
    options->options.erase(heads);
  }
  if (const auto prompt = options->options.find("prompt"); prompt != options->options.end()) {
    if (prompt->second != "keep") return where(Status::InvalidArgument("prompt= takes keep, got '" + prompt->second + "'"));
    variant.keep_prompt = true;
    options->options.erase(prompt);
  }
  if (options->options.empty()) return variant;
  Result<CacheBudget> budget = CacheBudget::FromSpec(*options);
  if (!budget.ok()) return where(budget.status());
  variant.budget = *budget;
  return variant;
}

std::string variant_flags(const TaskVariant& variant) {
  return std::string(variant.keep_prompt ? ",prompt=keep" : "") + (variant.own_head_counts ? ",heads=own" : "");
}

}  // namespace namm::tasks
