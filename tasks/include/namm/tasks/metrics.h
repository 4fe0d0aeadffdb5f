// The benchmarks' scoring functions, bit-compatible with the reference scorers (spec §8.3): LongBench
// (and ChouBun) metrics as in LongBench's metrics.py, InfiniteBench's as in its compute_scores.py.
//
// LongBench/ChouBun metrics compare one prediction with one answer string; a prompt's score is the best over
// its answers (score_answers). InfiniteBench metrics receive the prompt's whole label (which may be a list,
// a number or a string) because their scorers interpret it themselves.
//
//   qa_f1          LongBench normalize_answer (lower, drop ASCII punctuation, drop articles a/an/the, collapse
//                  whitespace), token-multiset F1
//   qa_f1_zh       jieba tokens, each lower-cased, stripped of ASCII + CJK punctuation and whitespace, empties
//                  dropped, F1
//   qa_f1_ja       the same with MeCab (UniDic) surfaces
//   rouge          ROUGE-L of `rouge` 1.0.1 (see rouge.h), 0 where it raises
//   rouge_zh/_ja   rouge over jieba / MeCab tokens joined by spaces
//   classification every class name found in the prediction, minus those that are substrings of (but not equal
//                  to) the answer (removed while iterating, so the entry after a removed one escapes), score
//                  1 / #matches if the answer is among them
//   retrieval      the answer's "Paragraph N" id vs every \d+ run in the prediction (retrieval_zh: "段落N")
//   count          every \d+ run in the prediction vs the answer
//   code_sim       first line (after leading newlines) without ` # or //, fuzzywuzzy ratio / 100
//   ib_*           InfiniteBench: ib_passkey, ib_number_string, ib_kv_retrieval, ib_code_run, ib_code_debug,
//                  ib_math_find, ib_math_calc, ib_longdialogue_qa, ib_choice, ib_qa_eng (qa_f1, best over
//                  answers), ib_qa_chn (character F1), ib_sum (Google rougeLsum, best over answers)
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "namm/status.h"
#include "namm/tasks/rouge.h"

namespace namm::tasks {

struct MetricOptions {
  RougeCompat rouge;  // quirks of `rouge` 1.0.1
};

// Whether `name` is a known metric.
bool is_metric(const std::string& name);
std::vector<std::string> metric_names();

// One prediction against one answer string (LongBench/ChouBun metrics only).
Result<double> score_answer(const std::string& metric, const std::string& prediction, const std::string& answer,
                            const std::vector<std::string>& all_classes = {}, const MetricOptions& options = {});

// One prompt as its benchmark scores it: LongBench/ChouBun metrics take the best score over `answers`
// (a JSON array of strings, or one string); InfiniteBench metrics receive `answers` as the label.
Result<double> score_prompt(const std::string& metric, const std::string& prediction, const nlohmann::json& answers,
                            const std::vector<std::string>& all_classes = {}, const MetricOptions& options = {});

}  // namespace namm::tasks
