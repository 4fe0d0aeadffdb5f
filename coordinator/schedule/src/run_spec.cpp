#include "namm/coordinator/run_spec.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "namm/file_util.h"
#include "namm/tasks/task_variant.h"
#include "namm/utf8.h"

namespace namm::coordinator {

namespace {

// Reads keys of one YAML map, refusing unknown keys (a typo must not silently fall back to a default).
class MapReader {
 public:
  MapReader(const YAML::Node& node, std::string where) : node_(node), where_(std::move(where)) {}

  Status Check(const std::set<std::string>& known) const {
    if (!node_.IsMap()) return Status::InvalidArgument(where_ + " must be a mapping");
    for (const auto& item : node_) {
      if (!item.first.IsScalar()) return Status::InvalidArgument(where_ + ": keys must be plain names");
      const std::string key = item.first.as<std::string>();
      if (!known.count(key)) return Status::InvalidArgument(where_ + ": unknown key '" + key + "'");
    }
    return Status::Ok();
  }

  template <typename T>
  Status Get(const std::string& key, T* value, bool required = false) const {
    const YAML::Node v = node_[key];
    if (!v) {
      if (required) return Status::InvalidArgument(where_ + ": missing '" + key + "'");
      return Status::Ok();
    }
    try {
      *value = v.as<T>();
    } catch (const YAML::Exception&) {
      return Status::InvalidArgument(where_ + "." + key + ": '" + YAML::Dump(v) + "' is not a valid value");
    }
    return Status::Ok();
  }

  YAML::Node Child(const std::string& key) const { return node_[key]; }
  const std::string& where() const { return where_; }

 private:
  YAML::Node node_;
  std::string where_;
};

// Bounds far above any run (the paper's: 3 stages, a few hundred generations, 6 tasks), so that what a hostile or
// mistyped spec costs stays small: yaml-cpp keeps an alias (`*a`) as one node but reading a list copies it for
// every mention, and budgets multiply a stage's tasks (issue 35).
constexpr std::size_t kMaxSpecBytes = 1 << 20;
constexpr std::size_t kMaxStages = 256;
constexpr std::size_t kMaxStageTasks = 1024;  // after budgets or ratios expand them
constexpr std::size_t kMaxRunTasks = 4096;    // every stage's together
constexpr std::size_t kMaxSettings = 64;      // budgets or ratios
constexpr std::size_t kMaxNameBytes = 256;    // a task's name or a setting
constexpr int64_t kMaxGenerations = 1000000;  // the whole run
constexpr int64_t kMaxPrompts = 1000000;
constexpr double kMaxCacheWeight = 10;  // a relative cache is at most ~1, a normalized score a few units
// A task's weight in [1/1000, 1000]: so one weighs at most 10^6 times another (any sharper is another run),
// and no weight is so small that w x score loses the score's digits.
constexpr double kMinTaskWeight = 0.001, kMaxTaskWeight = 1000;

Status InRange(const std::string& where, int64_t value, int64_t most) {
  if (value <= 0 || value > most) {
    return Status::InvalidArgument(where + " must be in 1.." + std::to_string(most) + ", got " + std::to_string(value));
  }
  return Status::Ok();
}

Status Generations(const std::string& where, int64_t value) { return InRange(where, value, kMaxGenerations); }

// A list of names (tasks, budgets) read with its bounds checked before anything is copied.
Status GetNames(const MapReader& r, const std::string& key, std::size_t most, std::vector<std::string>* names,
                bool required = false) {
  const YAML::Node list = r.Child(key);
  const std::string where = r.where() + "." + key;
  if (list && list.IsSequence()) {
    if (list.size() > most) {
      return Status::InvalidArgument(where + " lists " + std::to_string(list.size()) + " items, over the limit of " +
                                     std::to_string(most));
    }
    for (const YAML::Node& item : list) {
      if (item.IsScalar() && item.Scalar().size() > kMaxNameBytes) {
        return Status::InvalidArgument(where + ": a name of " + std::to_string(item.Scalar().size()) +
                                       " bytes, over the limit of " + std::to_string(kMaxNameBytes));
      }
    }
  }
  return r.Get(key, names, required);
}

// A stage's `weights`: a map from its tasks (as budgets: / ratios: expanded them) to weights in
// [kMinTaskWeight, kMaxTaskWeight]. A weight of 1 is the default and is not kept, so that spelling it out is
// no change of the spec (spec_revision.h).
Status GetWeights(const MapReader& r, const std::vector<std::string>& tasks, tasks::TaskWeights* weights) {
  const YAML::Node node = r.Child("weights");
  const std::string where = r.where() + ".weights";
  if (!node) return Status::Ok();
  if (!node.IsMap()) return Status::InvalidArgument(where + " must map the stage's tasks to weights");
  if (node.size() > tasks.size()) {
    return Status::InvalidArgument(where + " names " + std::to_string(node.size()) + " tasks; the stage has " +
                                   std::to_string(tasks.size()));
  }
  std::set<std::string> named;
  for (const auto& item : node) {
    if (!item.first.IsScalar()) return Status::InvalidArgument(where + ": keys must be task names");
    const std::string task = item.first.Scalar();
    if (std::find(tasks.begin(), tasks.end(), task) == tasks.end()) {
      return Status::InvalidArgument(
          where + ": '" + task.substr(0, kMaxNameBytes) +
          "' is not one of the stage's tasks (after budgets or ratios expand them)");
    }
    if (!named.insert(task).second) return Status::InvalidArgument(where + " names " + task + " twice");
    double w = 0;
    try {
      w = item.second.as<double>();
    } catch (const YAML::Exception&) {
      return Status::InvalidArgument(where + "." + task + ": '" + YAML::Dump(item.second) + "' is not a number");
    }
    if (!std::isfinite(w) || w < kMinTaskWeight || w > kMaxTaskWeight) {
      return Status::InvalidArgument(where + "." + task + " must be in 0.001..1000, got " +
                                     YAML::Dump(item.second));
    }
    if (w != 1) weights->emplace(task, w);
  }
  return Status::Ok();
}

Status ParseArchitecture(const YAML::Node& node, const std::string& where, NammArchitecture* arch,
                         std::string* init) {
  if (!node) return Status::Ok();  // the paper's BAM with binary selection
  MapReader r(node, where);
  NAMM_RETURN_IF_ERROR(
      r.Check({"scorer", "hidden", "attention_bias", "mlp_bias", "selection", "attention_precision", "budget_input",
               "init"}));
  NAMM_RETURN_IF_ERROR(r.Get("init", init));
  if (r.Child("init") && init->empty()) return Status::InvalidArgument(where + ".init: an empty path");
  std::string scorer = "bam", selection = "binary", precision = "bf16";
  NAMM_RETURN_IF_ERROR(r.Get("scorer", &scorer));
  if (scorer != "bam" && scorer != "mlp") {
    return Status::InvalidArgument(where + ".scorer: '" + scorer + "' is not bam or mlp");
  }
  arch->scorer = default_scorer_config(scorer == "bam" ? ScorerKind::kBam : ScorerKind::kMlp);
  NAMM_RETURN_IF_ERROR(r.Get("hidden", &arch->scorer.hidden));
  NAMM_RETURN_IF_ERROR(r.Get("attention_bias", &arch->scorer.attention_bias));
  NAMM_RETURN_IF_ERROR(r.Get("mlp_bias", &arch->scorer.mlp_bias));
  NAMM_RETURN_IF_ERROR(r.Get("selection", &selection));
  NAMM_ASSIGN_OR_RETURN(arch->selection, parse_selection_spec(selection));
  NAMM_RETURN_IF_ERROR(r.Get("attention_precision", &precision));
  if (precision != "bf16" && precision != "f32") {
    return Status::InvalidArgument(where + ".attention_precision: '" + precision + "' is not bf16 or f32");
  }
  arch->attention_precision = precision == "bf16" ? AttentionPrecision::kBf16 : AttentionPrecision::kF32;
  NAMM_RETURN_IF_ERROR(r.Get("budget_input", &arch->budget_input));
  return arch->Validate().WithContext(where);
}

// A run's decompositions overlap the 8 generations after their request (a generation of LLM evaluations takes
// far longer than the 9 s a decomposition takes at N = 4172); the library's default is 0.
constexpr int64_t kRunEigenDelay = 8;

Status ParseCmaes(const YAML::Node& node, const std::string& where, CmaesOptions* o) {
  o->eigen_delay = kRunEigenDelay;
  if (!node) return Status::Ok();
  MapReader r(node, where);
  NAMM_RETURN_IF_ERROR(r.Check({"population", "elite_ratio", "sigma0", "c_m", "seed", "eigen", "eigen_gap_factor",
                                "eigen_delay", "covariance"}));
  NAMM_RETURN_IF_ERROR(r.Get("eigen_delay", &o->eigen_delay));
  NAMM_RETURN_IF_ERROR(r.Get("population", &o->population));
  NAMM_RETURN_IF_ERROR(r.Get("elite_ratio", &o->elite_ratio));
  NAMM_RETURN_IF_ERROR(r.Get("sigma0", &o->sigma0));
  NAMM_RETURN_IF_ERROR(r.Get("c_m", &o->c_m));
  NAMM_RETURN_IF_ERROR(r.Get("seed", &o->seed));
  NAMM_RETURN_IF_ERROR(r.Get("eigen_gap_factor", &o->eigen_gap_factor));
  std::string eigen = "lazy", covariance = "full";
  NAMM_RETURN_IF_ERROR(r.Get("eigen", &eigen));
  NAMM_RETURN_IF_ERROR(r.Get("covariance", &covariance));
  if (eigen != "lazy" && eigen != "every_generation") {
    return Status::InvalidArgument(where + ".eigen: '" + eigen + "' is not lazy or every_generation");
  }
  if (covariance != "full" && covariance != "diagonal") {
    return Status::InvalidArgument(where + ".covariance: '" + covariance + "' is not full or diagonal");
  }
  o->eigen_schedule = eigen == "lazy" ? EigenSchedule::kLazy : EigenSchedule::kEveryGeneration;
  o->covariance = covariance == "full" ? Covariance::kFull : Covariance::kDiagonal;
  return Status::Ok();
}

}  // namespace

StageSchedule RunSpec::schedule() const {
  std::vector<int64_t> generations;
  for (const StageSpec& s : stages) generations.push_back(s.generations);
  return StageSchedule(generations, eval_interval);
}

int64_t RunSpec::total_generations() const {
  int64_t total = 0;
  for (const StageSpec& s : stages) total += s.generations;
  return total;
}

std::vector<std::string> RunSpec::all_tasks() const {
  std::set<std::string> tasks;
  for (const StageSpec& s : stages) tasks.insert(s.tasks.begin(), s.tasks.end());
  return {tasks.begin(), tasks.end()};
}

// The top-level budgets: / ratios: applied to a stage's tasks: each plain task becomes its variants
// "T@budget=N" (or "T@ratio=R"), one per setting, and the task itself for the setting "own" (the NAMM's own
// selection); "T@prompt=keep" becomes "T@budget=N,prompt=keep" and itself (so with heads=own); a task that
// names a budget already is kept as it is.
static std::vector<std::string> AtEachSetting(const std::vector<std::string>& tasks, const std::string& knob,
                                       const std::vector<std::string>& settings) {
  std::vector<std::string> out;
  for (const std::string& task : tasks) {
    const Result<tasks::TaskVariant> variant = tasks::parse_task_variant(task);
    if (!variant.ok() || variant->budget) {  // an error is reported where the stage's tasks are checked
      out.push_back(task);
      continue;
    }
    for (const std::string& setting : settings) {
      out.push_back(setting == "own" ? task : variant->base + "@" + knob + "=" + setting + tasks::variant_flags(*variant));
    }
  }
  return out;
}

// parse_run_spec() without its guard against yaml-cpp's exceptions.
static Result<RunSpec> ParseRunSpec(const std::string& yaml, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source + ": not valid YAML: " + e.what());
  }
  RunSpec spec;
  spec.yaml = yaml;
  MapReader r(root, source);
  NAMM_RETURN_IF_ERROR(r.Check({"name", "model", "namm", "cmaes", "prompts_per_task", "eval_interval",
                                "eval_prompts", "zero_base", "fitness", "cache_weight", "budgets", "ratios", "stages"}));
  NAMM_RETURN_IF_ERROR(r.Get("name", &spec.name, true));

  MapReader model(r.Child("model"), source + ".model");
  if (!r.Child("model")) return Status::InvalidArgument(source + ": missing 'model'");
  NAMM_RETURN_IF_ERROR(model.Check({"path", "tokenizer", "rope_scaling", "fingerprint"}));
  NAMM_RETURN_IF_ERROR(model.Get("path", &spec.model.path, true));
  NAMM_RETURN_IF_ERROR(model.Get("tokenizer", &spec.model.tokenizer));
  NAMM_RETURN_IF_ERROR(model.Get("rope_scaling", &spec.model.rope_scaling));
  NAMM_RETURN_IF_ERROR(model.Get("fingerprint", &spec.model.fingerprint, true));

  NAMM_RETURN_IF_ERROR(ParseArchitecture(r.Child("namm"), source + ".namm", &spec.architecture, &spec.init));
  NAMM_RETURN_IF_ERROR(ParseCmaes(r.Child("cmaes"), source + ".cmaes", &spec.cmaes));
  NAMM_RETURN_IF_ERROR(r.Get("prompts_per_task", &spec.prompts_per_task));
  NAMM_RETURN_IF_ERROR(InRange(source + ".prompts_per_task", spec.prompts_per_task, kMaxPrompts));
  NAMM_RETURN_IF_ERROR(r.Get("eval_interval", &spec.eval_interval));
  NAMM_RETURN_IF_ERROR(Generations(source + ".eval_interval", spec.eval_interval));
  std::string eval_prompts = "all";
  NAMM_RETURN_IF_ERROR(r.Get("eval_prompts", &eval_prompts));
  if (eval_prompts != "all") {
    try {
      std::size_t used = 0;
      spec.eval_prompts = std::stoll(eval_prompts, &used);
      if (used != eval_prompts.size() || spec.eval_prompts <= 0) throw std::invalid_argument(eval_prompts);
    } catch (const std::exception&) {
      return Status::InvalidArgument(source + ".eval_prompts: '" + eval_prompts + "' is not 'all' or a count > 0");
    }
    NAMM_RETURN_IF_ERROR(InRange(source + ".eval_prompts", spec.eval_prompts, kMaxPrompts));
  }
  std::string zero_base = "one_plus_candidate";
  NAMM_RETURN_IF_ERROR(r.Get("zero_base", &zero_base));
  if (zero_base == "reference_epsilon") {
    spec.zero_base = tasks::ZeroBase::kReferenceEpsilon;
  } else if (zero_base != "one_plus_candidate") {
    return Status::InvalidArgument(source + ".zero_base: '" + zero_base +
                                   "' is not one_plus_candidate or reference_epsilon");
  }

  std::string fitness = "mean";
  NAMM_RETURN_IF_ERROR(r.Get("fitness", &fitness));
  if (fitness != "mean" && fitness != "mean_rank") {
    return Status::InvalidArgument(source + ".fitness: '" + fitness + "' is not mean or mean_rank");
  }
  spec.rank_fitness = fitness == "mean_rank";
  std::vector<std::string> budgets, ratios;
  NAMM_RETURN_IF_ERROR(GetNames(r, "budgets", kMaxSettings, &budgets));
  NAMM_RETURN_IF_ERROR(GetNames(r, "ratios", kMaxSettings, &ratios));
  if (!budgets.empty() && !ratios.empty()) {
    return Status::InvalidArgument(source + ": give 'budgets' or 'ratios', not both");
  }
  NAMM_RETURN_IF_ERROR(r.Get("cache_weight", &spec.cache_weight));
  if (!std::isfinite(spec.cache_weight) || spec.cache_weight < 0 || spec.cache_weight > kMaxCacheWeight) {
    return Status::InvalidArgument(source + ".cache_weight must be in 0.." +
                                   std::to_string(static_cast<int>(kMaxCacheWeight)) + ", got " +
                                   std::to_string(spec.cache_weight));
  }
  if (spec.cache_weight > 0 && (spec.rank_fitness || !budgets.empty() || !ratios.empty())) {
    return Status::InvalidArgument(source + ".cache_weight charges the cache the NAMM's own threshold keeps: it needs "
                                   "fitness: mean and neither budgets nor ratios (they fix the cache)");
  }
  const std::string knob = budgets.empty() ? "ratio" : "budget";
  const std::vector<std::string>& settings = budgets.empty() ? ratios : budgets;
  if (std::set<std::string>(settings.begin(), settings.end()).size() != settings.size()) {
    return Status::InvalidArgument(source + "." + knob + "s lists a value twice");
  }

  const YAML::Node stages = r.Child("stages");
  if (!stages || !stages.IsSequence() || stages.size() == 0) {
    return Status::InvalidArgument(source + ": 'stages' must be a non-empty list");
  }
  if (stages.size() > kMaxStages) {
    return Status::InvalidArgument(source + ": " + std::to_string(stages.size()) + " stages, over the limit of " +
                                   std::to_string(kMaxStages));
  }
  std::size_t run_tasks = 0;
  int64_t run_generations = 0;
  for (std::size_t k = 0; k < stages.size(); ++k) {
    const std::string where = source + ".stages[" + std::to_string(k) + "]";
    MapReader s(stages[k], where);
    NAMM_RETURN_IF_ERROR(s.Check({"tasks", "weights", "generations"}));
    StageSpec stage;
    NAMM_RETURN_IF_ERROR(GetNames(s, "tasks", kMaxStageTasks, &stage.tasks, true));
    NAMM_RETURN_IF_ERROR(s.Get("generations", &stage.generations, true));
    NAMM_RETURN_IF_ERROR(Generations(where + ".generations", stage.generations));
    run_generations += stage.generations;  // (each at most kMaxGenerations: no overflow)
    NAMM_RETURN_IF_ERROR(InRange(source + ": the stages' generations", run_generations, kMaxGenerations));
    if (stage.tasks.empty()) return Status::InvalidArgument(where + ".tasks must not be empty");
    if (stage.tasks.size() * std::max<std::size_t>(settings.size(), 1) > kMaxStageTasks) {
      return Status::InvalidArgument(where + ": " + std::to_string(stage.tasks.size()) + " tasks at " +
                                     std::to_string(settings.size()) + " " + knob + "s are over the limit of " +
                                     std::to_string(kMaxStageTasks) + " a stage");
    }
    if (!settings.empty()) stage.tasks = AtEachSetting(stage.tasks, knob, settings);
    run_tasks += stage.tasks.size();
    if (run_tasks > kMaxRunTasks) {
      return Status::InvalidArgument(source + ": the stages list " + std::to_string(run_tasks) +
                                     " tasks, over the limit of " + std::to_string(kMaxRunTasks));
    }
    for (const std::string& task : stage.tasks) {
      NAMM_RETURN_IF_ERROR(tasks::parse_task_variant(task).status().WithContext(where + ".tasks"));
    }
    if (std::set<std::string>(stage.tasks.begin(), stage.tasks.end()).size() != stage.tasks.size()) {
      return Status::InvalidArgument(where + ".tasks lists a task twice");
    }
    NAMM_RETURN_IF_ERROR(GetWeights(s, stage.tasks, &stage.weights));
    spec.stages.push_back(std::move(stage));
  }
  // The names that reach protobuf strings (a worker registering for a run so named looped for ever on the
  // coordinator's answer), JSON and HTML must be UTF-8; the rest of the text may be anything (a stored spec is
  // parsed again at every resume).
  const auto utf8 = [&](const std::string& what, const std::string& value) -> Status {
    if (sanitize_utf8(value) == value) return Status::Ok();
    return Status::InvalidArgument(source + ": " + what + " '" + sanitize_utf8(value) + "' is not valid UTF-8");
  };
  NAMM_RETURN_IF_ERROR(utf8("name", spec.name));
  for (const StageSpec& stage : spec.stages) {
    for (const std::string& task : stage.tasks) NAMM_RETURN_IF_ERROR(utf8("the task", task));
  }
  NAMM_RETURN_IF_ERROR(make_cmaes_params(spec.architecture.param_count(), spec.cmaes).status().WithContext(source));
  return spec;
}

Result<RunSpec> parse_run_spec(const std::string& yaml, const std::string& source) {
  if (yaml.size() > kMaxSpecBytes) {
    return Status::InvalidArgument(source + ": " + std::to_string(yaml.size()) + " bytes, over a run spec's limit of " +
                                   std::to_string(kMaxSpecBytes));
  }
  // yaml-cpp throws on shapes the readers above do not expect (found by tests/fuzz): a clear error, never a crash.
  try {
    return ParseRunSpec(yaml, source);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source + ": not a valid run spec: " + e.what());
  }
}

Result<RunSpec> load_run_spec(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(std::string text, read_file(path));
  return parse_run_spec(text, path);
}

}  // namespace namm::coordinator
