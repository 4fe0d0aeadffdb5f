#include "namm/tasks/normalized_score.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "namm/file_util.h"
#include "namm/json_util.h"
#include "namm/tasks/task_variant.h"

namespace namm::tasks {

using Json = nlohmann::json;

Result<ReferenceScores> ReferenceScores::Load(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(std::string text, read_file(path));
  NAMM_ASSIGN_OR_RETURN(Json j, parse_json_bounded(text, path));
  if (j.is_array() && j.size() == 1 && j[0].is_object() && j[0].contains("performance_per_request")) {
    j = j[0]["performance_per_request"];  // the aggregate file
  }
  if (!j.is_object()) return Status::Corruption(path + ": expected an object of tasks");
  ReferenceScores scores;
  for (auto task = j.begin(); task != j.end(); ++task) {
    if (!task->is_object()) return Status::Corruption(path + ": '" + task.key() + "' is not an object of row scores");
    for (auto row = task->begin(); row != task->end(); ++row) {
      int64_t index = -1;
      try {
        index = std::stoll(row.key());
      } catch (const std::exception&) {
      }
      // Written as the reference writes a row (and Save() does): " 5", "+5" and "05" would each be row 5, and
      // which of their scores won depended on the keys' order.
      if (index < 0 || std::to_string(index) != row.key()) {
        return Status::Corruption(path + ": '" + task.key() + "' has a row '" + row.key() +
                                  "', not a row index written as a plain decimal number");
      }
      if (!row->is_number()) return Status::Corruption(path + ": " + task.key() + "[" + row.key() + "] is not a number");
      Status s = scores.Set(task.key(), index, row->get<double>());
      if (!s.ok()) return s.WithContext(path);
    }
  }
  return scores;
}

Status ReferenceScores::Save(const std::string& path) const {
  Json j = Json::object();
  for (const auto& [task, rows] : scores_) {
    Json t = Json::object();
    for (const auto& [row, score] : rows) t[std::to_string(row)] = score;
    j[task] = t;
  }
  const std::string text = j.dump(1);
  return write_file_atomically(path, {text});
}

std::optional<double> ReferenceScores::Get(const std::string& task, int64_t row) const {
  auto t = scores_.find(base_task(task));  // a variant's reference is its base task's (task_variant.h)
  if (t == scores_.end()) return std::nullopt;
  auto r = t->second.find(row);
  if (r == t->second.end()) return std::nullopt;
  return r->second;
}

Status ReferenceScores::Set(const std::string& task, int64_t row, double score) {
  if (base_task(task) != task) {
    return Status::InvalidArgument(task + ": reference scores are kept for the base task " + base_task(task));
  }
  if (!std::isfinite(score) || score < 0 || score > 1) {
    return Status::InvalidArgument(task + " row " + std::to_string(row) + ": score " + std::to_string(score) +
                                   " is outside [0, 1]");
  }
  if (row < 0) return Status::InvalidArgument(task + ": negative row index");
  scores_[task][row] = score;
  return Status::Ok();
}

Result<Fitness> normalized_fitness(const PromptScores& candidate, const ReferenceScores& reference, ZeroBase zero_base,
                                   const TaskWeights& weights) {
  if (candidate.empty()) return Status::InvalidArgument("no task scores to normalize");
  Fitness fitness;
  double weight_sum = 0;
  for (const auto& [task, rows] : candidate) {
    if (rows.empty()) return Status::InvalidArgument("task " + task + " has no sampled prompts");
    TaskFitness t{task, static_cast<int64_t>(rows.size()), 0, 0, 0};
    for (const auto& [row, score] : rows) {
      const std::optional<double> base = reference.Get(task, row);
      if (!base) return Status::NotFound("no base-model reference score for " + task + " row " + std::to_string(row));
      t.candidate_mean += score;
      t.base_mean += *base;
    }
    t.candidate_mean /= static_cast<double>(rows.size());
    t.base_mean /= static_cast<double>(rows.size());
    if (zero_base == ZeroBase::kReferenceEpsilon) {
      t.normalized = (100.0 * t.candidate_mean) / (100.0 * t.base_mean + 1e-7);
    } else {
      t.normalized = t.base_mean > 0 ? t.candidate_mean / t.base_mean : 1.0 + t.candidate_mean;
    }
    const double w = task_weight(weights, task);
    fitness.value += w * t.normalized;
    weight_sum += w;
    fitness.tasks.push_back(t);
  }
  fitness.value /= weight_sum;
  return fitness;
}

}  // namespace namm::tasks
