#include "namm/tasks/task.h"

#include <yaml-cpp/yaml.h>

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "namm/file_util.h"
#include "namm/json_util.h"
#include "namm/tasks/python_text.h"

namespace namm::tasks {

namespace {

using Json = nlohmann::json;

// Task files in a directory, sorted.
std::vector<std::string> YamlFiles(const std::string& dir) {
  std::vector<std::string> files;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* entry = ::readdir(d)) {
      const std::string name = entry->d_name;
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".yaml") == 0) files.push_back(dir + "/" + name);
    }
    ::closedir(d);
  }
  std::sort(files.begin(), files.end());
  return files;
}

Result<Scoring> ParseScoring(const std::string& s, const std::string& where) {
  if (s == "generation") return Scoring::kGeneration;
  if (s == "likelihood") return Scoring::kLikelihood;
  if (s == "token_accuracy") return Scoring::kTokenAccuracy;
  return Status::InvalidArgument(where + ": unknown scoring '" + s + "' (known: generation, likelihood, token_accuracy)");
}

// Parses one YAML file of task definitions.
Status ParseTaskFile(const std::string& path, std::vector<TaskSpec>* out) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    return Status::Corruption(path + ": invalid YAML: " + e.what());
  }
  try {
    const std::string benchmark = root["benchmark"].as<std::string>("");
    if (benchmark.empty()) return Status::Corruption(path + ": missing 'benchmark'");
    const std::string prompts = root["prompts"].as<std::string>("inline");
    if (prompts != "config" && prompts != "inline" && prompts != "token_ids") {
      return Status::Corruption(path + ": 'prompts' must be config, inline or token_ids");
    }
    for (const auto& node : root["tasks"]) {
      TaskSpec spec;
      spec.benchmark = benchmark;
      spec.prompt_source = prompts == "config"   ? PromptSource::kConfig
                           : prompts == "inline" ? PromptSource::kInline
                                                 : PromptSource::kTokenIds;
      spec.name = node["name"].as<std::string>("");
      if (spec.name.empty()) return Status::Corruption(path + ": a task without a name");
      const std::string where = path + ": task " + spec.name;
      spec.dataset = node["dataset"].as<std::string>("");
      if (spec.dataset.empty()) return Status::Corruption(where + ": missing 'dataset'");
      spec.description = node["description"].as<std::string>("");
      spec.metric = node["metric"].as<std::string>("");
      NAMM_ASSIGN_OR_RETURN(spec.scoring, ParseScoring(node["scoring"].as<std::string>("generation"), where));
      if (spec.scoring == Scoring::kGeneration && !is_metric(spec.metric)) {
        return Status::Corruption(where + ": unknown metric '" + spec.metric + "'");
      }
      spec.first_line = node["first_line"].as<bool>(false);
      spec.chat = node["chat"].as<bool>(true);
      spec.answers_field = node["answers_field"].as<std::string>(root["answers_field"].as<std::string>("answers"));
      spec.classes_field = node["classes_field"].as<std::string>(root["classes_field"].as<std::string>("all_classes"));
      spec.rope_scaling = node["rope_scaling"].as<std::string>("");
      spec.max_context = node["max_context"].as<int64_t>(0);
      spec.chunk_size = node["chunk_size"].as<int64_t>(0);
      spec.update_interval = node["update_interval"].as<int64_t>(0);
      if (spec.chunk_size < 0 || spec.update_interval < 0 ||
          (spec.chunk_size > 0 && spec.update_interval > 0 && spec.update_interval % spec.chunk_size != 0)) {
        return Status::Corruption(where + ": 'update_interval' must be a positive multiple of 'chunk_size'");
      }
      if (node["stop"]) spec.stop_strings = node["stop"].as<std::vector<std::string>>();
      if (prompts == "inline") {
        spec.prompt_template = node["template"].as<std::string>("");
        if (spec.prompt_template.empty()) return Status::Corruption(where + ": missing 'template'");
      }
      // For config-prompt tasks the length comes with the template, from the config directory.
      spec.max_new_tokens = node["max_new_tokens"].as<int64_t>(prompts == "config" ? 0 : -1);
      if (spec.max_new_tokens < 0) return Status::Corruption(where + ": missing 'max_new_tokens'");
      out->push_back(std::move(spec));
    }
  } catch (const YAML::Exception& e) {
    return Status::Corruption(path + ": malformed task definition: " + e.what());
  }
  return Status::Ok();
}

}  // namespace

const char* scoring_name(Scoring scoring) {
  switch (scoring) {
    case Scoring::kGeneration: return "generation";
    case Scoring::kLikelihood: return "likelihood";
    case Scoring::kTokenAccuracy: return "token_accuracy";
  }
  return "?";
}

namespace {

Status ApplyDirectoryFlags(const std::vector<std::string>& specs, const std::string& flag,
                           std::map<std::string, std::string>* dirs) {
  for (const auto& spec : specs) {
    const auto eq = spec.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size()) {
      return Status::InvalidArgument(flag + " expects BENCHMARK=DIR, got '" + spec + "'");
    }
    (*dirs)[spec.substr(0, eq)] = spec.substr(eq + 1);
  }
  return Status::Ok();
}

}  // namespace

Result<TaskPaths> task_paths_from_flags(const TaskPathFlags& flags) {
  TaskPaths paths = default_task_paths();
  if (!flags.tasks_dir.empty()) paths.tasks_dir = flags.tasks_dir;
  NAMM_RETURN_IF_ERROR(ApplyDirectoryFlags(flags.data_dirs, "--data-dir", &paths.data_dirs));
  NAMM_RETURN_IF_ERROR(ApplyDirectoryFlags(flags.config_dirs, "--config-dir", &paths.config_dirs));
  return paths;
}

namespace {

// The task definitions installed beside the running program (`cmake --install`: PREFIX/bin/<program> and
// PREFIX/share/namm/tasks), else those of the source tree it was built from.
std::string DefaultTasksDir() {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    const std::string installed = parent_directory(parent_directory(self)) + "/share/namm/tasks";
    if (!YamlFiles(installed).empty()) return installed;
  }
  return NAMM_TASKS_DIR;
}

}  // namespace

TaskPaths default_task_paths() {
  TaskPaths paths;
  paths.tasks_dir = DefaultTasksDir();
  paths.data_dirs["longbench"] = std::string(NAMM_SHARED_DIR) + "/data/longbench";
  return paths;
}

Result<std::vector<TaskSpec>> list_tasks(const TaskPaths& paths) {
  const std::vector<std::string> files = YamlFiles(paths.tasks_dir);
  if (files.empty()) return Status::NotFound(paths.tasks_dir + ": no task definitions (*.yaml)");
  std::vector<TaskSpec> tasks;
  for (const auto& file : files) NAMM_RETURN_IF_ERROR(ParseTaskFile(file, &tasks));
  std::set<std::string> names;
  for (const auto& t : tasks) {
    if (!names.insert(t.name).second) return Status::Corruption(paths.tasks_dir + ": task '" + t.name + "' is defined twice");
  }
  return tasks;
}

Result<TaskSpec> find_task(const std::string& name, const TaskPaths& paths) {
  NAMM_ASSIGN_OR_RETURN(std::vector<TaskSpec> tasks, list_tasks(paths));
  auto it = std::find_if(tasks.begin(), tasks.end(), [&](const TaskSpec& t) { return t.name == name; });
  if (it == tasks.end()) {
    std::string known;
    for (const auto& t : tasks) known += (known.empty() ? "" : ", ") + t.name;
    return Status::NotFound("unknown task '" + name + "' (defined: " + known + ")");
  }
  TaskSpec task = *it;
  auto data_dir = paths.data_dirs.find(task.benchmark);
  if (data_dir == paths.data_dirs.end()) {
    return Status::FailedPrecondition("task " + task.name + ": no data directory for benchmark '" + task.benchmark +
                                      "' (pass it, e.g. --data-dir " + task.benchmark + "=DIR)");
  }
  task.data_path = data_dir->second + "/" + task.dataset + ".jsonl";
  if (task.prompt_source == PromptSource::kConfig) {
    auto config = paths.config_dirs.find(task.benchmark);
    const std::string dir = config != paths.config_dirs.end() ? config->second : data_dir->second + "/config";
    for (const char* file : {"dataset2prompt.json", "dataset2maxlen.json"}) {
      const std::string path = dir + "/" + file;
      auto text = read_file(path);
      if (!text.ok()) return text.status().WithContext("task " + task.name + ": " + task.benchmark + " config");
      NAMM_ASSIGN_OR_RETURN(const Json j, parse_json_bounded(*text, path));
      if (!j.is_object()) return Status::Corruption(path + ": not a JSON object");
      if (!j.contains(task.dataset)) {
        return Status::NotFound("task " + task.name + ": " + path + " has no entry '" + task.dataset + "'");
      }
      if (std::string(file) == "dataset2prompt.json") {
        if (!j[task.dataset].is_string()) return Status::Corruption(path + ": '" + task.dataset + "' is not a string");
        task.prompt_template = j[task.dataset].get<std::string>();
      } else {
        if (!j[task.dataset].is_number_integer()) return Status::Corruption(path + ": '" + task.dataset + "' is not an integer");
        task.max_new_tokens = j[task.dataset].get<int64_t>();
      }
    }
  }
  return task;
}

Result<std::vector<TaskRow>> load_rows(const TaskSpec& task) {
  std::ifstream in(task.data_path);
  if (!in) {
    return Status::NotFound("task " + task.name + ": data file " + task.data_path + " is missing");
  }
  std::vector<TaskRow> rows;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
    // Bounded nesting: py_str and the metrics recurse over a row's fields.
    const std::string where = "task " + task.name + ": " + task.data_path + " line " + std::to_string(lineno);
    NAMM_ASSIGN_OR_RETURN(Json j, parse_json_bounded(line, where));
    if (!j.is_object()) return Status::Corruption(where + " is not a JSON object");
    rows.push_back({static_cast<int64_t>(rows.size()), std::move(j)});
  }
  return rows;
}

Result<std::string> build_prompt(const TaskSpec& task, const TaskRow& row) {
  std::map<std::string, FormatValue> fields;
  for (auto it = row.fields.begin(); it != row.fields.end(); ++it) {
    FormatValue value{py_str(*it), {}};
    if (it->is_array()) {
      for (const auto& item : *it) value.items.push_back(py_str(item));
    }
    fields.emplace(it.key(), std::move(value));
  }
  auto prompt = py_format(task.prompt_template, fields);
  if (!prompt.ok()) return prompt.status().WithContext("task " + task.name + " row " + std::to_string(row.index));
  return prompt;
}

std::string scored_text(const TaskSpec& task, const std::string& generated) {
  if (!task.first_line) return generated;
  const std::string text = to_utf8(py_lstrip(to_u32(generated), U"\n"));
  return text.substr(0, text.find('\n'));
}

namespace {

// InfiniteBench scores code_debug and longbook_choice_eng against [answer, its option's letter], as its
// get_answer() builds them from the row's `answer` (a string or a one-element list) and `options`: the released
// rows hold the answer's text alone, so scoring the raw field scored every code_debug row 0.
Result<Json> InfiniteBenchLabel(const TaskSpec& task, const TaskRow& row) {
  const Json& answer = row.fields[task.answers_field];
  const auto bad = [&](const std::string& what) {
    return Status::InvalidArgument("task " + task.name + " row " + std::to_string(row.index) + ": " + what);
  };
  const auto letter = [](const Json& j) {
    return j.is_string() && j.get<std::string>().size() == 1 &&
           std::string("ABCD").find(j.get<std::string>()) != std::string::npos;
  };
  if (answer.is_array() && answer.size() == 2 && letter(answer[1])) return answer;  // already [text, letter]
  const Json text = answer.is_array() && answer.size() == 1 ? answer[0] : answer;
  if (!text.is_string()) return bad("'" + task.answers_field + "' is not a string or a one-element list");
  if (!row.fields.contains("options") || !row.fields["options"].is_array()) return bad("has no 'options' list");
  const Json& options = row.fields["options"];
  for (std::size_t i = 0; i < options.size() && i < 4; ++i) {
    if (options[i] == text) return Json::array({text, std::string(1, "ABCD"[i])});
  }
  return bad("its answer is not among the first four of its 'options'");
}

}  // namespace

Result<double> score_generation(const TaskSpec& task, const TaskRow& row, const std::string& generated,
                                const MetricOptions& options) {
  if (!row.fields.contains(task.answers_field)) {
    return Status::InvalidArgument("task " + task.name + " row " + std::to_string(row.index) + " has no '" +
                                   task.answers_field + "' field");
  }
  if (task.metric == "ib_code_debug" || task.metric == "ib_choice") {
    NAMM_ASSIGN_OR_RETURN(const Json label, InfiniteBenchLabel(task, row));
    auto score = score_prompt(task.metric, scored_text(task, generated), label, {}, options);
    if (!score.ok()) return score.status().WithContext("task " + task.name + " row " + std::to_string(row.index));
    return score;
  }
  std::vector<std::string> classes;
  if (row.fields.contains(task.classes_field) && row.fields[task.classes_field].is_array()) {
    for (const auto& c : row.fields[task.classes_field]) classes.push_back(py_str(c));
  }
  auto score = score_prompt(task.metric, scored_text(task, generated), row.fields[task.answers_field], classes, options);
  if (!score.ok()) return score.status().WithContext("task " + task.name + " row " + std::to_string(row.index));
  return score;
}

std::string task_definition_text(const TaskSpec& t) {
  std::ostringstream out;
  out << "benchmark " << t.benchmark << "\ndataset " << t.dataset << "\nprompt_source "
      << static_cast<int>(t.prompt_source) << "\ntemplate " << t.prompt_template.size() << ":" << t.prompt_template
      << "\nmax_new_tokens " << t.max_new_tokens << "\nmetric " << t.metric << "\nscoring "
      << static_cast<int>(t.scoring) << "\nstop_strings";
  for (const std::string& stop : t.stop_strings) out << " " << stop.size() << ":" << stop;
  out << "\nfirst_line " << t.first_line << "\nchat " << t.chat << "\nanswers_field " << t.answers_field
      << "\nclasses_field " << t.classes_field << "\nrope_scaling " << t.rope_scaling << "\nmax_context "
      << t.max_context << "\nchunk_size " << t.chunk_size << "\nupdate_interval " << t.update_interval << "\n";
  return out.str();
}

Result<std::vector<int64_t>> parse_row_range(const std::string& spec, int64_t count) {
  auto bad = [&] { return Status::InvalidArgument("row range '" + spec + "': expected N, A:B, A: or :B"); };
  int64_t begin = 0, end = count;
  // Whole numbers only: "0-3" or "1,4" read as their first number ran one row without a word.
  const auto whole = [](const std::string& text, int64_t* out) {
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos || text.size() > 18) return false;
    *out = std::stoll(text);
    return true;
  };
  const auto colon = spec.find(':');
  if (colon == std::string::npos) {
    if (!whole(spec, &begin)) return bad();
    end = begin + 1;
  } else if ((colon > 0 && !whole(spec.substr(0, colon), &begin)) ||
             (colon + 1 < spec.size() && !whole(spec.substr(colon + 1), &end))) {
    return bad();
  }
  if (begin < 0 || end > count || begin >= end) {
    return Status::InvalidArgument("row range '" + spec + "' is outside the task's " + std::to_string(count) + " rows");
  }
  std::vector<int64_t> rows;
  for (int64_t i = begin; i < end; ++i) rows.push_back(i);
  return rows;
}

}  // namespace namm::tasks
