// namm-tool metric: score predictions with a benchmark metric, bit-compatible with the reference scorers.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "namm/json_util.h"
#include "namm/tasks/metrics.h"
#include "namm/tasks/python_text.h"

namespace namm::tool {

namespace {

struct MetricOptions {
  std::string name, prediction, answer, all_classes, jsonl;
  bool exact_rouge = false;
};

std::vector<std::string> SplitClasses(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  return out;
}

Status RunMetric(const MetricOptions& o) {
  tasks::MetricOptions options;
  options.rouge.recursion_limit_zero = !o.exact_rouge;
  if (o.jsonl.empty()) {
    NAMM_ASSIGN_OR_RETURN(double score, tasks::score_prompt(o.name, o.prediction, nlohmann::json(o.answer),
                                                            SplitClasses(o.all_classes), options));
    std::cout << tasks::py_repr_float(score) << "\n";
    return Status::Ok();
  }
  std::ifstream in(o.jsonl);
  if (!in) return Status::NotFound(o.jsonl + ": cannot open");
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
    auto where = o.jsonl + " line " + std::to_string(lineno);
    // Bounded: the metrics walk `answers` recursively (a line nesting 20,000 arrays overflowed the stack).
    NAMM_ASSIGN_OR_RETURN(const nlohmann::json row, parse_json_bounded(line, where));
    if (!row.is_object()) return Status::InvalidArgument(where + ": not a JSON object");
    if (!row.contains("prediction") || !row["prediction"].is_string() || !row.contains("answers")) {
      return Status::InvalidArgument(where + ": needs a string 'prediction' and 'answers'");
    }
    std::vector<std::string> classes;
    if (row.contains("all_classes") && row["all_classes"].is_array()) {
      for (const auto& c : row["all_classes"]) {
        if (!c.is_string()) return Status::InvalidArgument(where + ": all_classes must hold strings");
        classes.push_back(c.get<std::string>());
      }
    }
    auto score = tasks::score_prompt(o.name, row["prediction"].get<std::string>(), row["answers"], classes, options);
    if (!score.ok()) return score.status().WithContext(where);
    std::cout << tasks::py_repr_float(*score) << "\n";
  }
  return Status::Ok();
}

}  // namespace

void AddMetricCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<MetricOptions>();
  std::string names;
  for (const auto& n : tasks::metric_names()) names += (names.empty() ? "" : ", ") + n;
  CLI::App* cmd = app.add_subcommand(
      "metric", "Score a prediction with a benchmark metric (0-1), bit-compatible with the reference scorer.\n"
                "Metrics: " + names);
  cmd->add_option("name", o->name, "Metric name")->required();
  auto* prediction = cmd->add_option("--prediction", o->prediction, "Predicted text");
  auto* answer = cmd->add_option("--answer", o->answer, "Ground-truth answer");
  cmd->add_option("--all-classes", o->all_classes, "Comma-separated class names (classification)");
  auto* jsonl = cmd->add_option("--jsonl", o->jsonl,
                                "Batch mode: one {\"prediction\", \"answers\", \"all_classes\"} per line; prints one "
                                "score per line (the best over the answers)");
  jsonl->excludes(prediction)->excludes(answer);
  cmd->add_flag("--exact-rouge", o->exact_rouge,
                "Score long sentences that the reference's rouge 1.0.1 gives 0 (recursion limit) exactly instead");
  cmd->callback([o, &run] {
    if (o->jsonl.empty() && (o->prediction.empty() && o->answer.empty())) {
      throw CLI::RequiredError("--prediction and --answer, or --jsonl");
    }
    run = [o] {
      Status s = RunMetric(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::tool
