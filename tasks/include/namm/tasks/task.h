// Tasks: what a prompt is, how long the answer may be, and how it is scored (spec §1.5-1.6, §8).
//
// Task definitions live in YAML files (tasks/*.yaml, in our own words). LongBench and ChouBun tasks take their
// prompt templates and answer lengths from the benchmark's config directory (dataset2prompt.json,
// dataset2maxlen.json), used verbatim as Python str.format templates; InfiniteBench and synthetic tasks carry
// their own. Rows come from JSONL files, one object per line, indexed from 0 in file order (the reference's
// dataset order, which its per-prompt reference scores use).
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "namm/status.h"
#include "namm/tasks/metrics.h"

namespace namm::tasks {

// How a task's answer is scored.
enum class Scoring {
  kGeneration,     // greedy generation, scored by `metric`
  kLikelihood,     // teacher-forced continuation: exp(-mean token NLL), in (0, 1]
  kTokenAccuracy,  // teacher-forced continuation: share of tokens the model ranks first
};
const char* scoring_name(Scoring scoring);

// Where a task's prompt comes from.
enum class PromptSource {
  kConfig,    // the benchmark's config directory: dataset2prompt.json / dataset2maxlen.json
  kInline,    // the task definition's own template
  kTokenIds,  // rows carry token ids (synthetic tasks): "prompt_ids", "continuation_ids"
};

struct TaskSpec {
  std::string name;        // "lb/narrativeqa", "choubun/wiki_qa", "ib/passkey", "syn/story_recall_plain"
  std::string benchmark;   // "longbench" | "choubun" | "infinitebench" | "synthetic"
  std::string dataset;     // the data file's stem
  std::string description;
  PromptSource prompt_source = PromptSource::kInline;
  std::string prompt_template;  // Python str.format with the row's fields; empty for token-id rows
  int64_t max_new_tokens = 0;
  std::string metric;           // for kGeneration
  Scoring scoring = Scoring::kGeneration;
  std::vector<std::string> stop_strings;  // cut the generated text at the first one
  bool first_line = false;      // score pred.lstrip("\n").split("\n")[0] (trec, triviaqa, samsum, lsht)
  // With `--chat`, whether the prompt goes into a user turn: LongBench (and the reference) leave its few-shot and
  // code tasks plain (trec, triviaqa, samsum, lsht, lcc, repobench-p: `chat: false`).
  bool chat = true;
  std::string answers_field = "answers";
  std::string classes_field = "all_classes";
  std::string rope_scaling;     // the RoPE setting the task is meant for ("" = the model's own)
  int64_t max_context = 0;      // longest sequence to run, beyond the trained length if larger (0 = the model's)
  // The memory-update schedule the task is meant for (0 = the engine's default, the reference's 128 / 512):
  // short synthetic prompts need updates inside the prompt for eviction to matter.
  int64_t chunk_size = 0;
  int64_t update_interval = 0;
  std::string data_path;        // resolved JSONL path
};

// What decides a task's prompts and scores once loaded (its YAML with the benchmark's dataset2prompt and
// dataset2maxlen resolved), one setting per line: an evaluation resumed under another definition would mix scores.
std::string task_definition_text(const TaskSpec& task);

// Where task files live. Data and config directories are per benchmark; a config directory defaults to
// "<data directory>/config".
struct TaskPaths {
  std::string tasks_dir;                            // the YAML definitions
  std::map<std::string, std::string> data_dirs;     // benchmark -> directory of <dataset>.jsonl
  std::map<std::string, std::string> config_dirs;   // benchmark -> directory of dataset2prompt.json etc.
};

// Command-line overrides of the default paths: --tasks-dir DIR, --data-dir BENCHMARK=DIR (repeatable),
// --config-dir BENCHMARK=DIR (repeatable).
struct TaskPathFlags {
  std::string tasks_dir;
  std::vector<std::string> data_dirs, config_dirs;
};
// default_task_paths() with the flags applied; a malformed BENCHMARK=DIR is an error naming the flag.
Result<TaskPaths> task_paths_from_flags(const TaskPathFlags& flags);

// The defaults of this build: the repository's tasks/ directory and ../shared/data/longbench for LongBench.
TaskPaths default_task_paths();

// Every task defined in paths.tasks_dir, without resolving templates or data (for listings).
Result<std::vector<TaskSpec>> list_tasks(const TaskPaths& paths);

// One task, with its template, answer length and data path resolved; errors name the task and the missing
// file.
Result<TaskSpec> find_task(const std::string& name, const TaskPaths& paths);

struct TaskRow {
  int64_t index = 0;  // line number among the file's rows, from 0
  nlohmann::json fields;
};

// The rows of a task's data file. A missing or malformed file is an error naming the task and the path.
Result<std::vector<TaskRow>> load_rows(const TaskSpec& task);

// The prompt text of a row (the template filled with its fields).
Result<std::string> build_prompt(const TaskSpec& task, const TaskRow& row);

// The text that is scored: the generated text, reduced to its first line for first_line tasks.
std::string scored_text(const TaskSpec& task, const std::string& generated);

// A generated answer's score in [0, 1] (kGeneration tasks).
Result<double> score_generation(const TaskSpec& task, const TaskRow& row, const std::string& generated,
                                const MetricOptions& options = {});

// "a:b" row ranges ("0:10", "5:", ":3", "7") into row indices, checked against `count`.
Result<std::vector<int64_t>> parse_row_range(const std::string& spec, int64_t count);

}  // namespace namm::tasks
