// namm-worker eval: memory policies compared on task rows (docs/evaluation.md). Resumable (rows already in a
// predictions file are skipped), shardable (--shard I/N, joined by eval --merge), and its results are
// computed from the predictions files alone.
#include <algorithm>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "commands.h"
#include "namm/build_info.h"
#include "namm/file_util.h"
#include "namm/tasks/task_path_options.h"
#include "namm/worker/evaluation.h"
#include "namm/worker/explain_page.h"
#include "namm/worker/model_fingerprint.h"
#include "namm/worker/policy_spec.h"
#include "namm/worker/task_runner.h"
#include "setup.h"

namespace namm::worker::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct EvalOptions {
  ModelOptions model;
  InferenceOptions inference;
  tasks::TaskPathFlags paths;
  std::vector<std::string> tasks, policies, budgets, ratios, merge;
  std::string rows = ":", shard, out;
  bool overwrite = false;
  int64_t explain_rows = 0;  // explain pages for the first N rows of each task (of this shard)
};

std::string Duration(double seconds) {
  const auto s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  std::ostringstream out;
  out << s / 3600 << ":" << std::setw(2) << std::setfill('0') << (s / 60) % 60 << ":" << std::setw(2)
      << s % 60;
  return out.str();
}

// Progress over every (task, policy, row) unit: a bar redrawn in place on a terminal, plain lines otherwise.
class Progress {
 public:
  explicit Progress(int64_t total) : total_(total), tty_(::isatty(STDERR_FILENO) != 0) {}

  void Skipped(int64_t n) { done_ += n; }
  void Ran(const std::string& task, const std::string& policy) {
    ++done_;
    ++ran_;
    if (!tty_) return;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    const double eta = elapsed / static_cast<double>(ran_) * static_cast<double>(total_ - done_);
    const int width = 30, filled = static_cast<int>(width * done_ / std::max<int64_t>(1, total_));
    std::cerr << "\r[" << std::string(static_cast<std::size_t>(filled), '#')
              << std::string(static_cast<std::size_t>(width - filled), '.') << "] " << done_ << "/" << total_
              << "  " << task << "  " << policy << "  ETA " << Duration(eta) << "\033[K" << std::flush;
  }
  void Finished(const std::string& task, const std::string& policy, int64_t rows, double score,
                double seconds) {
    if (tty_) std::cerr << "\r\033[K";
    std::cerr << task << "  " << policy << ": " << rows << " rows, score " << std::fixed
              << std::setprecision(4) << score << " (" << std::setprecision(1) << seconds << " s; " << done_
              << "/" << total_ << " done)\n";
  }

 private:
  int64_t total_, done_ = 0, ran_ = 0;
  bool tty_;
  Clock::time_point start_ = Clock::now();
};

// An exclusive lock on an output directory (DIR/.lock) for as long as the object lives, so that two
// evaluations never append to, repair or merge into the same files at once.
class DirectoryLock {
 public:
  static Result<DirectoryLock> Acquire(const std::string& dir) {
    NAMM_RETURN_IF_ERROR(make_directories(dir));
    const std::string path = dir + "/.lock";
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return Status::IOError(path + ": cannot open: " + std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      return Status::FailedPrecondition(dir + " is in use by another namm-worker eval");
    }
    return DirectoryLock(fd);
  }
  DirectoryLock(DirectoryLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  DirectoryLock& operator=(DirectoryLock&&) = delete;
  ~DirectoryLock() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  explicit DirectoryLock(int fd) : fd_(fd) {}
  int fd_;
};

// Removes what an earlier evaluation wrote to `dir` (the files its configuration names: predictions, explain
// pages, results, plots, the configuration), nothing else. Refuses a configuration it cannot read: it cannot
// know what is ours.
Status RemoveEvaluation(const std::string& dir) {
  const std::string config_path = dir + "/config.yaml";
  if (!path_exists(config_path)) return Status::Ok();
  NAMM_ASSIGN_OR_RETURN(std::string text, read_file(config_path));
  Result<EvalConfig> old = EvalConfig::FromYaml(text, config_path);
  if (!old.ok()) {
    return old.status().WithContext(
        "--overwrite removes only an evaluation's own files, and " + config_path +
        " is not an evaluation configuration this build reads; remove it yourself");
  }
  for (const auto& task : old->tasks) {
    NAMM_RETURN_IF_ERROR(remove_path(dir + "/plot_" + output_directory_name(task) + ".svg"));
    for (const auto& policy : old->policies) {
      const std::string file = predictions_path(dir, task, policy);
      NAMM_RETURN_IF_ERROR(remove_path(file));
      const std::string policy_dir = parent_directory(file);
      // Its explain pages too: the next results page links whatever pages the directory holds.
      if (Result<std::vector<std::string>> names = list_directory(policy_dir); names.ok()) {
        for (const std::string& name : *names) {
          if (explain_page_row(name)) NAMM_RETURN_IF_ERROR(remove_path(policy_dir + "/" + name));
        }
      }
      // The policy's and the task's directories go only if that left them empty (rmdir refuses otherwise).
      if (remove_path(policy_dir).ok()) (void)remove_path(parent_directory(policy_dir));
    }
  }
  for (const char* name : {"results.json", "results.csv", "results.html", "config.yaml"}) {
    NAMM_RETURN_IF_ERROR(remove_path(dir + "/" + name));
  }
  return Status::Ok();
}

// Checks `config` against an evaluation already in `dir`; true when there is one to resume.
Result<bool> CheckResumable(const EvalConfig& config, const std::string& dir) {
  const std::string path = dir + "/config.yaml";
  if (!path_exists(path)) {
    // Predictions without a configuration (a merge that stopped, files copied by hand) are of unknown origin.
    for (const auto& task : config.tasks) {
      for (const auto& policy : config.policies) {
        if (path_exists(predictions_path(dir, task, policy))) {
          return Status::FailedPrecondition(
              dir + " holds " + predictions_path(dir, task, policy) +
              " but no config.yaml saying what it is; choose another --out or remove it");
        }
      }
    }
    return false;
  }
  NAMM_ASSIGN_OR_RETURN(std::string text, read_file(path));
  NAMM_ASSIGN_OR_RETURN(EvalConfig old, EvalConfig::FromYaml(text, path));
  if (const std::string diff = config.DifferenceFrom(old); !diff.empty()) {
    return Status::InvalidArgument(dir + " holds another evaluation (" + diff +
                                   "); pass --overwrite to start over, or choose another --out");
  }
  if (old.shard_index != config.shard_index || old.shard_count != config.shard_count) {
    return Status::InvalidArgument(dir + " holds shard " + std::to_string(old.shard_index) + "/" +
                                   std::to_string(old.shard_count) + " of this evaluation, not " +
                                   std::to_string(config.shard_index) + "/" +
                                   std::to_string(config.shard_count));
  }
  if (old.commit != config.commit) {
    std::cerr << "namm-worker: warning: resuming an evaluation started by commit " << old.commit << " with "
              << config.commit << "\n";
  }
  return true;
}

// "I/N": digits only (no sign, space or suffix), 0 <= I < N <= 100,000.
Status ParseShard(const std::string& text, EvalConfig* config) {
  if (text.empty()) return Status::Ok();
  const auto digits = [](const std::string& s) {
    return !s.empty() && s.size() <= 6 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  const auto slash = text.find('/');
  if (slash == std::string::npos || !digits(text.substr(0, slash)) || !digits(text.substr(slash + 1))) {
    return Status::InvalidArgument("--shard expects I/N (two whole numbers, e.g. 0/4), got '" + text + "'");
  }
  config->shard_index = std::stoll(text.substr(0, slash));
  config->shard_count = std::stoll(text.substr(slash + 1));
  if (config->shard_count < 1 || config->shard_count > 100000 || config->shard_index >= config->shard_count) {
    return Status::InvalidArgument("--shard " + text + ": needs 0 <= I < N <= 100000");
  }
  return Status::Ok();
}

Status Report(const EvalConfig& config, const std::vector<PolicyResult>& results, const std::string& out) {
  NAMM_RETURN_IF_ERROR(write_results(config, results, out));
  std::cout << results_table(config, results);
  if (const std::string matched = matched_table(matched_cache_comparison(results)); !matched.empty()) {
    std::cout
        << "\nAt the same cache (fixed-budget families interpolated between their two nearest settings):\n"
        << matched;
  }
  if (const std::string paired = paired_table(paired_comparison(results)); !paired.empty()) {
    std::cout << "\nPaired per row, each NAMM against the other policies at its cache setting (at its own threshold: "
                 "the full cache):\n"
              << paired;
  }
  std::cout << "\nwrote " << out << "/results.csv, " << out << "/results.json, " << out << "/results.html\n";
  return Status::Ok();
}

Status RunMerge(const EvalOptions& o) {
  NAMM_ASSIGN_OR_RETURN(DirectoryLock lock, DirectoryLock::Acquire(o.out));
  NAMM_ASSIGN_OR_RETURN(std::vector<PolicyResult> results, merge_shards(o.merge, o.out));
  NAMM_ASSIGN_OR_RETURN(std::string text, read_file(o.out + "/config.yaml"));
  NAMM_ASSIGN_OR_RETURN(EvalConfig config, EvalConfig::FromYaml(text, o.out + "/config.yaml"));
  std::cout << "merged " << o.merge.size() << " shards into " << o.out << "\n";
  return Report(config, results, o.out);
}

Status RunEval(const EvalOptions& o) {
  if (o.model.model.empty()) return Status::InvalidArgument("--model is required (except with --merge)");
  if (o.tasks.empty()) return Status::InvalidArgument("--tasks is required");
  EvalConfig config;
  config.commit = NAMM_GIT_COMMIT;
  config.model = o.model.model;
  config.tokenizer = o.model.tokenizer;
  config.rope_scaling = o.model.rope_scaling;
  config.dtype = o.model.dtype;
  config.chat = o.model.chat;
  config.device = o.model.device;
  config.tasks = o.tasks;
  config.budgets = o.budgets;
  config.ratios = o.ratios;
  config.chunk_size = o.inference.chunk_size;
  config.update_interval = o.inference.update_interval;
  config.max_context = o.inference.max_context;
  config.threads = o.inference.threads;
  config.tasks_dir = o.paths.tasks_dir;
  config.data_dirs = o.paths.data_dirs;
  config.config_dirs = o.paths.config_dirs;
  NAMM_RETURN_IF_ERROR(ParseShard(o.shard, &config));
  NAMM_ASSIGN_OR_RETURN(std::vector<std::string> specs, split_policy_list(o.policies));
  NAMM_ASSIGN_OR_RETURN(config.policies, expand_policies(specs, o.budgets, o.ratios));

  // Tasks, their rows and what they are run with.
  NAMM_ASSIGN_OR_RETURN(tasks::TaskPaths paths, tasks::task_paths_from_flags(o.paths));
  std::set<std::string> task_directories;
  std::map<std::string, tasks::TaskSpec> specs_by_task;
  std::map<std::string, std::vector<tasks::TaskRow>> rows_by_task;
  for (const auto& name : config.tasks) {
    if (specs_by_task.count(name)) return Status::InvalidArgument("task " + name + " is listed twice");
    NAMM_ASSIGN_OR_RETURN(tasks::TaskSpec task, tasks::find_task(name, paths));
    NAMM_ASSIGN_OR_RETURN(std::vector<tasks::TaskRow> rows, tasks::load_rows(task));
    NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> selected,
                          tasks::parse_row_range(o.rows, static_cast<int64_t>(rows.size())));
    config.task_rows[name] = std::to_string(selected.front()) + ":" + std::to_string(selected.back() + 1);
    if (!task_directories.insert(output_directory_name(name)).second) {
      return Status::InvalidArgument("task " + name + " would share its output directory with another task");
    }
    const int64_t chunk = o.inference.chunk_size > 0 ? o.inference.chunk_size
                          : task.chunk_size > 0      ? task.chunk_size
                                                     : 128;
    const int64_t interval = o.inference.update_interval > 0 ? o.inference.update_interval
                             : task.update_interval > 0      ? task.update_interval
                                                             : 512;
    if (interval % chunk != 0) {
      return Status::InvalidArgument("task " + name + ": the chunk size " + std::to_string(chunk) +
                                     " does not divide the update interval " + std::to_string(interval));
    }
    NAMM_ASSIGN_OR_RETURN(config.fingerprints["data:" + name], file_fingerprint(task.data_path));
    // And its definition as loaded (its YAML, the benchmark's templates and answer lengths): paths alone let a
    // resumed evaluation score its new rows under another metric or template.
    NAMM_ASSIGN_OR_RETURN(config.fingerprints["task:" + name], text_fingerprint(tasks::task_definition_text(task)));
    specs_by_task[name] = std::move(task);
    rows_by_task[name] = std::move(rows);
  }

  ApplyThreads(o.inference);
  const std::string first_rope = specs_by_task[config.tasks.front()].rope_scaling;
  NAMM_ASSIGN_OR_RETURN(LoadedModelAndTokenizer loaded, LoadModelAndTokenizer(o.model, first_rope));
  // Every policy must build before anything is written (the oracle checks each task's first row for marks).
  PolicyFactory policies = MakePolicyFactory(loaded);
  for (const auto& spec : config.policies) {
    for (const auto& task : config.tasks) {
      const auto& rows = rows_by_task[task];
      if (!rows.empty())
        NAMM_RETURN_IF_ERROR(policies.Make(spec, &rows.front().fields).status().WithContext(task));
    }
  }

  // What the model and the NAMM files are, beyond their paths.
  NAMM_ASSIGN_OR_RETURN(config.fingerprints["model"], model_fingerprint(o.model.model, FingerprintedTokenizer(o.model)));
  for (const auto& spec : config.policies) {
    if (spec.rfind("namm:", 0) != 0) continue;
    NAMM_ASSIGN_OR_RETURN(const NammSpec namm, parse_namm_spec(spec));  // one file, whatever its knob
    NAMM_ASSIGN_OR_RETURN(config.fingerprints["namm:" + namm.path], file_fingerprint(namm.path));
  }

  // The output directory: a new evaluation, or the same one resumed.
  NAMM_ASSIGN_OR_RETURN(DirectoryLock lock, DirectoryLock::Acquire(o.out));
  if (o.overwrite) NAMM_RETURN_IF_ERROR(RemoveEvaluation(o.out));
  NAMM_ASSIGN_OR_RETURN(bool resuming, CheckResumable(config, o.out));  // the lock made the directory
  if (!resuming) NAMM_RETURN_IF_ERROR(write_file_atomically(o.out + "/config.yaml", {config.ToYaml()}));

  // Tasks meant for another RoPE setting run a variant sharing the weights (unless --rope-scaling fixes one).
  std::map<std::string, std::unique_ptr<LlamaModel>> variants;
  const auto model_for = [&](const tasks::TaskSpec& task) -> Result<const LlamaModel*> {
    if (!o.model.rope_scaling.empty() || task.rope_scaling == first_rope) return loaded.model.get();
    auto& variant = variants[task.rope_scaling];
    if (!variant) {
      LlamaConfig model_config = loaded.model->config();
      if (task.rope_scaling.empty())
        return Status::InvalidArgument("task " + task.name + " runs with the checkpoint's RoPE and " +
                                       config.tasks.front() +
                                       " with another: evaluate them separately or pass --rope-scaling");
      NAMM_ASSIGN_OR_RETURN(model_config.rope_scaling, RopeScaling::Parse(task.rope_scaling));
      variant = std::make_unique<LlamaModel>(LoadedModel{model_config, loaded.model->weights()},
                                             loaded.model->options());
    }
    return variant.get();
  };

  int64_t total = 0;
  for (const auto& task : config.tasks) {
    NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> rows, config.ShardRows(task));
    total += static_cast<int64_t>(rows.size() * config.policies.size());
  }
  Progress progress(total);
  TaskRunOptions run_options;
  run_options.max_context = config.max_context;
  run_options.chunk_size = config.chunk_size;
  run_options.memory_update_interval = config.update_interval;
  for (const auto& name : config.tasks) {
    const tasks::TaskSpec& task = specs_by_task[name];
    const std::vector<tasks::TaskRow>& rows = rows_by_task[name];
    NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> shard_rows, config.ShardRows(name));
    NAMM_ASSIGN_OR_RETURN(const LlamaModel* model, model_for(task));
    TaskRunner runner(*model, *loaded.tokenizer);
    run_options.explain_rows.clear();
    for (std::size_t i = 0; i < shard_rows.size() && static_cast<int64_t>(i) < o.explain_rows; ++i) {
      run_options.explain_rows.insert(shard_rows[i]);
    }
    for (const auto& policy_spec : config.policies) {
      const std::string path = predictions_path(o.out, name, policy_spec);
      NAMM_ASSIGN_OR_RETURN(std::vector<PredictionRecord> existing, load_predictions(path, /*repair=*/true));
      std::set<int64_t> done;
      for (const auto& r : existing) done.insert(r.row);
      NAMM_ASSIGN_OR_RETURN(PredictionWriter writer, PredictionWriter::Open(path));
      double score = 0, seconds = 0;
      for (const auto& r : existing) score += r.score, seconds += r.seconds;
      int64_t counted = static_cast<int64_t>(existing.size());
      std::vector<int64_t> pending;
      for (int64_t index : shard_rows) {
        if (done.count(index)) {
          progress.Skipped(1);
        } else {
          pending.push_back(index);
        }
      }
      for (std::size_t first = 0; first < pending.size(); first += static_cast<std::size_t>(o.inference.batch)) {
        const std::size_t end = std::min(pending.size(), first + static_cast<std::size_t>(o.inference.batch));
        NAMM_ASSIGN_OR_RETURN(RowBatch batch, MakeRowBatch(policies, policy_spec, rows, pending, first, end));
        std::vector<Result<PromptResult>> ran = runner.RunBatch(task, batch.items, run_options);
        for (std::size_t i = first; i < end; ++i) {
          const int64_t index = pending[i];
          const tasks::TaskRow& row = rows[static_cast<std::size_t>(index)];
          if (!ran[i - first].ok())
            return ran[i - first].status().WithContext(name + " row " + std::to_string(index) + " with " + policy_spec);
          const PromptResult& r = *ran[i - first];
          if (r.explained) {
            ExplainInput explain{policy_spec, model->config().Describe(), explain_token_texts(*loaded.tokenizer, r.explained_ids),
                                 r.prompt_tokens, r.explained.get()};
            NAMM_RETURN_IF_ERROR(write_file_atomically(explain_path(o.out, name, policy_spec, index),
                                                       {render_explain_page(explain)}));
          }
          PredictionRecord record;
          record.row = index;
          record.pred = r.prediction;
          record.answers = row.fields.value(task.answers_field, nlohmann::json::array());
          record.all_classes = row.fields.value(task.classes_field, nlohmann::json());
          record.length =
              row.fields.contains("length") ? row.fields["length"] : nlohmann::json(r.prompt_tokens);
          record.score = r.score;
          record.mean_kv_tokens = r.mean_kv_tokens;
          record.answer_kv_tokens = r.answer_kv_tokens;
          record.peak_kv_tokens = r.peak_kv_tokens;
          record.prompt_tokens = r.prompt_tokens;
          record.generated_tokens = r.generated_tokens;
          record.prefill_tokens = r.prefill_tokens;
          record.decode_tokens = r.decode_tokens;
          record.seconds = r.seconds;
          NAMM_RETURN_IF_ERROR(writer.Append(record));
          score += r.score;
          seconds += record.seconds;
          ++counted;
          progress.Ran(name, policy_spec);
        }
      }
      progress.Finished(name, policy_spec, counted, counted ? score / static_cast<double>(counted) : 0.0,
                        seconds);
    }
  }
  NAMM_ASSIGN_OR_RETURN(std::vector<PolicyResult> results, compute_results(config, o.out));
  if (config.shard_count > 1) {
    std::cout << "shard " << config.shard_index << "/" << config.shard_count << " done; join the shards with "
              << "namm-worker eval --merge DIR... --out DIR (results below cover this shard's rows only)\n";
  }
  return Report(config, results, o.out);
}

}  // namespace

void AddEvalCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<EvalOptions>();
  CLI::App* cmd = app.add_subcommand(
      "eval",
      "Compare memory policies on task rows: predictions, scores normalized by the full cache, cache sizes, "
      "a table, CSV/JSON and an HTML plot (resumable; --shard / --merge)");
  AddModelOptions(cmd, o->model, /*required=*/false);
  AddInferenceOptions(cmd, o->inference);
  AddBatchOption(cmd, o->inference);
  tasks::add_task_path_options(cmd, o->paths);
  cmd->add_option("--tasks", o->tasks, "Tasks, comma-separated (e.g. syn/interruption_heldout,lb/dureader)")
      ->delimiter(',');
  cmd->add_option("--policies", o->policies,
                  "Policies, comma-separated (full is always included): full, namm:FILE.safetensors, "
                  "h2o|l2|streaming|tova|snapkv|fastgen[:budget=N|ratio=R,...], oracle");
  cmd->add_option("--rows", o->rows, "Rows of every task: N, A:B, A: or :B (default: all)");
  auto* budgets =
      cmd->add_option("--budgets", o->budgets,
                      "Expand each baseline without a cache setting over these budgets (tokens per KV "
                      "head), comma-separated")
          ->delimiter(',');
  auto* ratios =
      cmd->add_option("--ratios", o->ratios, "... or over these shares of each prompt, comma-separated")
          ->delimiter(',');
  budgets->excludes(ratios);
  cmd->add_option("--shard", o->shard, "Evaluate only every N-th row, starting at row I of each range: I/N");
  cmd->add_flag("--overwrite", o->overwrite, "Start over: remove the evaluation already in --out");
  cmd->add_option("--explain-rows", o->explain_rows,
                  "Also write, for the first N rows of each task and every policy, a page of what the policy kept "
                  "(as generate --explain), linked from results.html")
      ->check(CLI::NonNegativeNumber);
  auto* merge = cmd->add_option("--merge", o->merge,
                                "Join the output directories of the shards of one evaluation "
                                "into --out (nothing is run)")
                    ->expected(1, -1);
  cmd->add_option("--out", o->out, "Output directory")->required();
  cmd->callback([o, &run, merge] {
    run = [o, merge] {
      Status s = merge->count() > 0 ? RunMerge(*o) : RunEval(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::worker::cli
