// `namm-worker eval`'s data: what an evaluation is (its configuration), its per-row predictions, and the
// results computed from them (docs/evaluation.md).
//
// An output directory holds:
//   config.yaml                        everything needed to re-run the evaluation, and the project commit
//   <task>/<policy>/predictions.jsonl  one LongBench-format line per row, appended as rows finish
//   results.json, results.csv          per (task, policy): score, score normalized by the full cache on the
//                                      same rows, cache sizes, time; the JSON adds the matched-cache and the
//                                      paired comparisons
//   results.html                       self-contained: score vs relative cache per task, one line per policy
//   plot_<task>.svg                    each task's chart as a standalone image
// Results are computed from the predictions files alone, so a resumed run, a merge of shards and an unsharded
// run produce the same results from the same predictions.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "namm/status.h"

namespace namm::worker {

struct EvalConfig {
  std::string commit;  // the project commit the binary was built from ("-dirty": with local changes)
  std::string model, tokenizer, rope_scaling, device = "cpu";
  std::string dtype;  // --dtype as given ("": the device's default)
  bool chat = false;  // prompts formatted with the model's chat template (--chat)
  // What the inputs were, so that a resumed run or a merge cannot mix in other files behind the same paths:
  // "model" (the model and tokenizer files), "namm:<path>" (each NAMM file), "data:<task>" (each task's
  // rows).
  std::map<std::string, std::string> fingerprints;
  std::vector<std::string> tasks;
  std::map<std::string, std::string> task_rows;  // task -> resolved row range "A:B"
  std::vector<std::string> policies;             // expanded specs, "full" first
  std::vector<std::string> budgets, ratios;      // as given (already expanded into `policies`)
  int64_t chunk_size = 0, update_interval = 0, max_context = 0;  // 0: each task's setting
  int threads = 0;
  std::string tasks_dir;
  std::vector<std::string> data_dirs, config_dirs;  // BENCHMARK=DIR, as given
  int64_t shard_index = 0, shard_count = 1;

  std::string ToYaml() const;
  static Result<EvalConfig> FromYaml(const std::string& text, const std::string& source);
  // The first setting in which two configurations describe different evaluations, as "key: a vs b", or ""
  // when they describe the same one. The commit, the thread count, the shard and the device's index (cuda:0
  // vs cuda:1) do not change what is evaluated.
  std::string DifferenceFrom(const EvalConfig& other) const;
  // The row indices of `task` this shard evaluates: every shard_count-th row of the range, from shard_index.
  Result<std::vector<int64_t>> ShardRows(const std::string& task) const;
};

// Splits --policies values into specs. Commas separate specs, except that a piece without ':' containing '='
// continues the spec before it: "full,h2o:budget=256,recent=8" is two specs. "namm:FILE" takes the rest of
// its piece verbatim.
Result<std::vector<std::string>> split_policy_list(const std::vector<std::string>& values);

// Expands every budgeted baseline without budget= or ratio= over `budgets` (budget=N each) and `ratios`
// (ratio=R each); puts "full" first (added when absent: every score is normalized by it); refuses duplicates
// and a budgeted baseline with no cache setting at all.
Result<std::vector<std::string>> expand_policies(const std::vector<std::string>& specs,
                                                 const std::vector<std::string>& budgets,
                                                 const std::vector<std::string>& ratios);

// Directory names inside the output: "syn/interruption" -> "syn_interruption", "h2o:budget=256" ->
// "h2o_budget=256", "namm:runs/a.safetensors" -> "namm_runs_a.safetensors".
std::string output_directory_name(const std::string& name);

// One line of predictions.jsonl: LongBench's fields (pred, answers, all_classes, length: the row's "length",
// or the prompt's token count when the row has none) and ours.
struct PredictionRecord {
  int64_t row = 0;
  std::string pred;
  nlohmann::json answers = nlohmann::json::array(), all_classes, length;
  double score = 0;
  double mean_kv_tokens = 0, answer_kv_tokens = 0, peak_kv_tokens = 0;  // see GenerationResult
  int64_t prompt_tokens = 0, generated_tokens = 0, prefill_tokens = 0, decode_tokens = 0;
  double seconds = 0;

  nlohmann::ordered_json ToJson() const;
  static Result<PredictionRecord> FromJson(const nlohmann::json& j, const std::string& where);
};

// The records of a predictions.jsonl (none if the file does not exist). A torn last line (a crash mid-write)
// is cut off the file when `repair`, else refused; any other malformed line is an error naming the file and
// the line, and the file is left as it is.
Result<std::vector<PredictionRecord>> load_predictions(const std::string& path, bool repair);

// Appends records to a predictions.jsonl, each line flushed and fsync'ed before the next row starts.
class PredictionWriter {
 public:
  static Result<PredictionWriter> Open(const std::string& path);
  PredictionWriter(PredictionWriter&& other) noexcept;
  PredictionWriter& operator=(PredictionWriter&&) = delete;
  ~PredictionWriter();
  Status Append(const PredictionRecord& record);

 private:
  PredictionWriter(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

// The predictions file of (task, policy) under an output directory.
std::string predictions_path(const std::string& dir, const std::string& task, const std::string& policy);
// Where `eval --explain-rows` writes the explain page of one row, beside the predictions: DIR/TASK/POLICY/
// explain-row-R.html. results.html links every one that exists.
std::string explain_path(const std::string& dir, const std::string& task, const std::string& policy, int64_t row);
// The row of an explain page's file name ("explain-row-12.html": 12), or nullopt for any other name.
std::optional<int64_t> explain_page_row(const std::string& file_name);

struct PolicyResult {
  std::string task, policy;
  std::string family;  // the policy without its cache setting ("tova", "fastgen:recovery=0.5"): one curve
  std::string cache_setting;  // "budget=256", "ratio=0.5" or ""
  int64_t rows = 0;
  double score = 0;             // mean over rows
  double normalized_score = 0;  // score / the full cache's score on the same rows
  double mean_kv_tokens = 0, answer_kv_tokens = 0, peak_kv_tokens = 0;  // means over rows
  double relative_cache = 0;  // mean_kv_tokens / the full cache's mean_kv_tokens
  // answer_kv_tokens / the full cache's: the cache while answering, which is all that prompt-compressing
  // policies (SnapKV, FastGen) save.
  double answer_relative_cache = 0;
  double seconds = 0;            // summed over rows
  double tokens_per_second = 0;  // (prefill + decode tokens) / seconds
  std::vector<double> row_scores;  // per row, in the configuration's row order: what paired comparisons pair
};

// Results of every (task, policy) of `config` from the predictions under `dir`; an error names the first
// (task, policy) whose predictions miss a row of the configuration (all shards when shard_count > 1 is not
// merged: pass the merged configuration).
Result<std::vector<PolicyResult>> compute_results(const EvalConfig& config, const std::string& dir);

// results.json, results.csv, results.html and plot_<task>.svg in `dir`.
Status write_results(const EvalConfig& config, const std::vector<PolicyResult>& results,
                     const std::string& dir);

// The paper's Table 1 layout: a row per policy; a column per task (mean score), the mean normalized score
// over tasks (those where the full cache scored above 0: no other has one) and the mean relative cache.
std::string results_table(const EvalConfig& config, const std::vector<PolicyResult>& results);

// A policy without a cache setting (a NAMM, the oracle) against a fixed-budget family at the same relative
// cache: the family's score interpolated linearly between its two settings whose relative caches enclose the
// policy's (NaN, with `note`, when the policy's cache is outside the family's range).
struct MatchedComparison {
  std::string task, policy, family;
  double relative_cache = 0, score = 0;  // the policy's
  double family_score = 0;               // at the same relative cache
  std::string note;                      // e.g. "below the smallest setting (budget=8: 0.21)"
};
std::vector<MatchedComparison> matched_cache_comparison(const std::vector<PolicyResult>& results);
std::string matched_table(const std::vector<MatchedComparison>& comparisons);

// A NAMM against every other policy of its task at the same cache setting (budget=8 against the baselines at
// budget=8; a NAMM at its own threshold against the full cache), paired per row: the mean of the NAMM's score
// minus the other's, its standard error (the differences' sample standard deviation / sqrt(rows)), t = mean /
// standard error (NaN when the differences do not vary), and the rows the NAMM scores higher on.
struct PairedComparison {
  std::string task, policy, other, cache_setting;
  int64_t rows = 0, wins = 0;
  double mean_difference = 0, standard_error = 0, t = 0;
};
std::vector<PairedComparison> paired_comparison(const std::vector<PolicyResult>& results);
std::string paired_table(const std::vector<PairedComparison>& comparisons);

// eval --merge: joins the shards' predictions into `out` (configurations must agree, every shard 0..N-1
// present exactly once) and writes the merged configuration and results.
Result<std::vector<PolicyResult>> merge_shards(const std::vector<std::string>& shard_dirs,
                                               const std::string& out);

}  // namespace namm::worker
