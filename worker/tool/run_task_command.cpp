// namm-worker run-task: run rows of a benchmark task end to end and print per-prompt predictions and scores.
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "namm/file_util.h"
#include "namm/tasks/normalized_score.h"
#include "namm/tasks/task_path_options.h"
#include "namm/worker/policy_spec.h"
#include "namm/worker/task_runner.h"
#include "setup.h"

namespace namm::worker::cli {

namespace {

struct RunTaskOptions {
  ModelOptions model;
  PolicyOptions policy;
  std::string task, rows = ":", record_reference;
  tasks::TaskPathFlags paths;
  InferenceOptions inference;
  bool clean_context = false, json = false;
};

Status RunTask(const RunTaskOptions& o) {
  NAMM_ASSIGN_OR_RETURN(tasks::TaskPaths paths, tasks::task_paths_from_flags(o.paths));
  NAMM_ASSIGN_OR_RETURN(tasks::TaskSpec task, tasks::find_task(o.task, paths));
  NAMM_ASSIGN_OR_RETURN(std::vector<tasks::TaskRow> rows, tasks::load_rows(task));
  NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> selected, tasks::parse_row_range(o.rows, static_cast<int64_t>(rows.size())));
  ApplyThreads(o.inference);
  NAMM_ASSIGN_OR_RETURN(LoadedModelAndTokenizer loaded, LoadModelAndTokenizer(o.model, task.rope_scaling));
  const std::string spec = o.policy.Spec();
  NAMM_ASSIGN_OR_RETURN(std::string family, policy_family(spec));
  if (family == "oracle" && o.clean_context) {
    return Status::InvalidArgument("the oracle's marks are positions in the full prompt: it cannot run with "
                                   "--clean-context");
  }
  PolicyFactory policies = MakePolicyFactory(loaded);
  std::string policy_name;
  tasks::ReferenceScores reference;
  if (!o.record_reference.empty()) {
    if (spec != "full" || o.clean_context) {
      return Status::InvalidArgument("--record-reference records the base model's scores: run with --policy full "
                                     "and without --clean-context");
    }
    if (path_exists(o.record_reference)) {
      NAMM_ASSIGN_OR_RETURN(reference, tasks::ReferenceScores::Load(o.record_reference));
    }
  }

  TaskRunner runner(*loaded.model, *loaded.tokenizer);
  TaskRunOptions options;
  options.max_context = o.inference.max_context;
  options.chunk_size = o.inference.chunk_size;
  options.memory_update_interval = o.inference.update_interval;
  options.clean_context = o.clean_context;
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  double total = 0;
  // Rows in batches of --batch, each printed as its batch ends.
  for (std::size_t first = 0; first < selected.size(); first += static_cast<std::size_t>(o.inference.batch)) {
    const std::size_t end = std::min(selected.size(), first + static_cast<std::size_t>(o.inference.batch));
    NAMM_ASSIGN_OR_RETURN(RowBatch batch, MakeRowBatch(policies, spec, rows, selected, first, end));
    policy_name = batch.policies.front()->name();
    std::vector<PromptResult> ran_rows;
    for (Result<PromptResult>& r : runner.RunBatch(task, batch.items, options)) {
      if (!r.ok()) return r.status();
      ran_rows.push_back(std::move(r).value());
    }
    for (const PromptResult& r : ran_rows) {
      total += r.score;
      if (!o.record_reference.empty()) NAMM_RETURN_IF_ERROR(reference.Set(task.name, r.row, r.score));
      if (o.json) {
        nlohmann::ordered_json updates = nlohmann::ordered_json::array();
        for (const auto& u : r.updates) {
          updates.push_back({{"sequence_length", u.sequence_length},
                             {"cache_sizes", u.cache_sizes},
                             {"end_of_prefill", u.end_of_prefill}});
        }
        results.push_back({{"row", r.row},
                           {"score", r.score},
                           {"prediction", r.prediction},
                           {"prompt_tokens", r.prompt_tokens},
                           {"generated_tokens", r.generated_tokens},
                           {"memory_updates", updates},
                           {"final_cache_sizes", r.final_cache_sizes},
                           {"mean_kv_tokens", r.mean_kv_tokens},
                           {"peak_kv_tokens", r.peak_kv_tokens},
                           {"seconds", r.seconds}});
      } else {
        std::cout << "row " << std::setw(4) << r.row << "  score " << std::fixed << std::setprecision(4)
                  << r.score << "  prompt " << r.prompt_tokens << "  mean cache " << std::setprecision(0)
                  << r.mean_kv_tokens << "  peak " << r.peak_kv_tokens << "  " << std::setprecision(2)
                  << r.seconds << " s";
        if (!r.prediction.empty()) std::cout << "  | " << r.prediction.substr(0, r.prediction.find('\n'));
        std::cout << "\n";
      }
    }
  }
  const double mean = total / static_cast<double>(selected.size());
  if (!o.record_reference.empty()) NAMM_RETURN_IF_ERROR(reference.Save(o.record_reference));
  if (o.json) {
    nlohmann::ordered_json j;
    j["task"] = task.name;
    j["scoring"] =
        task.scoring == tasks::Scoring::kGeneration ? task.metric : tasks::scoring_name(task.scoring);
    j["policy"] = policy_name;
    j["model"] = loaded.model->config().Describe();
    j["clean_context"] = o.clean_context;
    j["mean_score"] = mean;
    j["rows"] = results;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << task.name << ": mean score " << std::setprecision(4) << mean << " over " << selected.size()
              << " prompts (" << policy_name << ")\n";
  }
  return Status::Ok();
}

}  // namespace

void AddRunTaskCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<RunTaskOptions>();
  CLI::App* cmd = app.add_subcommand("run-task", "Run rows of a benchmark task end to end: prompt, generation with a "
                                                 "memory policy, score");
  AddModelOptions(cmd, o->model);
  AddPolicyOptions(cmd, o->policy);
  cmd->add_option("--task", o->task, "Task name, e.g. lb/passage_retrieval_zh or syn/story_recall")->required();
  cmd->add_option("--rows", o->rows, "Rows to run: N, A:B, A: or :B (default: all)");
  tasks::add_task_path_options(cmd, o->paths);
  AddInferenceOptions(cmd, o->inference);
  AddBatchOption(cmd, o->inference);
  cmd->add_flag("--clean-context", o->clean_context, "Synthetic tasks: score with the distractor-free prompt");
  cmd->add_flag("--json", o->json, "Print a JSON report");
  cmd->add_option("--record-reference", o->record_reference,
                  "Merge the per-prompt scores into this base-model reference file (the reference's per-request "
                  "JSON format; needs --policy full)");
  cmd->callback([o, &run] {
    run = [o] {
      Status s = RunTask(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::worker::cli
