#include "namm/coordinator/spec_revision.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>

#include "namm/tasks/normalized_score.h"

namespace namm::coordinator {

namespace {

using Flat = std::vector<std::pair<std::string, nlohmann::json>>;

const char* const kEigen[] = {"lazy", "every_generation"};
const char* const kCovariance[] = {"full", "diagonal"};

// The spec as (key, value) pairs in spec order: what two specs are compared by, so that comments, layout and
// spelled-out defaults never count as changes.
Flat Flatten(const RunSpec& s) {
  Flat f = {{"name", s.name},
            {"model.path", s.model.path},
            {"model.tokenizer", s.model.tokenizer},
            {"model.rope_scaling", s.model.rope_scaling},
            {"model.fingerprint", s.model.fingerprint}};
  const nlohmann::json arch = nlohmann::json::parse(s.architecture.ToJson()).flatten();
  for (const auto& [pointer, value] : arch.items()) {
    std::string key = "namm" + pointer;
    std::replace(key.begin(), key.end(), '/', '.');
    f.emplace_back(key, value);
  }
  // Only when given (specs from before it flatten as they did). Not a location: the run began from that file.
  if (!s.init.empty()) f.emplace_back("namm.init", s.init);
  const CmaesOptions& c = s.cmaes;
  f.insert(f.end(), {{"cmaes.population", c.population},
                     {"cmaes.elite_ratio", c.elite_ratio},
                     {"cmaes.sigma0", c.sigma0},
                     {"cmaes.c_m", c.c_m},
                     {"cmaes.seed", c.seed},
                     {"cmaes.eigen", kEigen[c.eigen_schedule == EigenSchedule::kLazy ? 0 : 1]},
                     {"cmaes.eigen_gap_factor", c.eigen_gap_factor},
                     {"cmaes.eigen_delay", c.eigen_delay},
                     {"cmaes.covariance", kCovariance[c.covariance == Covariance::kFull ? 0 : 1]},
                     {"prompts_per_task", s.prompts_per_task},
                     {"eval_interval", s.eval_interval},
                     {"eval_prompts", s.eval_prompts == 0 ? nlohmann::json("all") : nlohmann::json(s.eval_prompts)},
                     {"zero_base", s.zero_base == tasks::ZeroBase::kOnePlusCandidate ? "one_plus_candidate"
                                                                                     : "reference_epsilon"},
                     {"fitness", s.rank_fitness ? "mean_rank" : "mean"},
                     {"cache_weight", s.cache_weight}});
  for (std::size_t k = 0; k < s.stages.size(); ++k) {
    const std::string stage = "stages[" + std::to_string(k) + "]";
    f.emplace_back(stage + ".tasks", s.stages[k].tasks);
    // Only when given, so that a spec from before weights existed flattens as it did.
    if (!s.stages[k].weights.empty()) f.emplace_back(stage + ".weights", s.stages[k].weights);
    f.emplace_back(stage + ".generations", s.stages[k].generations);
  }
  return f;
}

// Where workers find the model: its fingerprint (checked against every worker's) still says which model it is.
bool IsLocation(const std::string& key) { return key == "model.path" || key == "model.tokenizer"; }

// `given`'s stages are `stored`'s, the last one possibly longer, then possibly more.
bool ExtendsStages(const RunSpec& stored, const RunSpec& given) {
  if (given.stages.size() < stored.stages.size()) return false;
  for (std::size_t k = 0; k < stored.stages.size(); ++k) {
    const StageSpec &a = stored.stages[k], &b = given.stages[k];
    const bool last = k + 1 == stored.stages.size();
    const bool same = a.tasks == b.tasks && a.weights == b.weights;
    if (!same || b.generations < a.generations || (!last && b.generations != a.generations)) {
      return false;
    }
  }
  return true;
}

bool IsStageKey(const std::string& key) { return key.rfind("stages[", 0) == 0; }

}  // namespace

std::vector<SpecDifference> diff_run_specs(const RunSpec& stored, const RunSpec& given) {
  const Flat a = Flatten(stored), b = Flatten(given);
  const auto find = [](const Flat& f, const std::string& key) -> const nlohmann::json* {
    for (const auto& [k, v] : f) {
      if (k == key) return &v;
    }
    return nullptr;
  };
  std::vector<SpecDifference> diff;
  const auto compare = [&](const std::string& key) {
    const nlohmann::json *x = find(a, key), *y = find(b, key);
    if (x != nullptr && y != nullptr && *x == *y) return;
    diff.push_back({key, x ? x->dump() : "(none)", y ? y->dump() : "(none)"});
  };
  for (const auto& [key, value] : a) compare(key);
  for (const auto& [key, value] : b) {
    if (find(a, key) == nullptr) compare(key);
  }
  return diff;
}

Status check_spec_revision(const RunSpec& stored, const RunSpec& given, bool finished) {
  const bool extension = ExtendsStages(stored, given);
  std::string refused;
  bool stages_refused = false;
  for (const SpecDifference& d : diff_run_specs(stored, given)) {
    if (IsLocation(d.key) || (IsStageKey(d.key) && extension && !finished)) continue;
    refused += "\n  " + d.key + ": " + d.stored + " -> " + d.given;
    stages_refused = stages_refused || IsStageKey(d.key);
  }
  if (refused.empty()) return Status::Ok();
  std::string why = "these changes would alter the run's trajectory (stored -> given):" + refused;
  if (stages_refused) {
    why += finished ? "\n(the run is finished: its schedule can no longer be extended; start a new run)"
                    : "\n(stages may only be extended: more generations for the last stage, or stages after it)";
  }
  return Status::FailedPrecondition(why);
}

}  // namespace namm::coordinator
