// ROUGE-L as the reference's scorers compute it.
//
// rouge_l_f: LongBench's `rouge_score`, i.e. the `rouge` package 1.0.1 (pltrdy) through
// `Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]`, returning 0.0 where that call
// raises. Its quirks, reproduced: sentences are the pieces between ASCII '.' (empty pieces dropped before
// whitespace is collapsed), words are split on single spaces; summary-level ROUGE-L over *sets*: m and n
// count distinct words, and llcs is the size of the union of the word sets of every reconstructed LCS
// (reference sentence x prediction sentence); F = 2 (P R) / (P + R + 1e-8). An empty prediction or
// reference raises inside ROUGE-1 (score 0), and the LCS reconstruction is recursive: when a sentence pair
// needs more than about 950 nested calls Python's recursion limit raises and the score is 0 — emulated when
// `recursion_limit_zero` is set (the default), because the reference scored with that behaviour.
//
// rouge_lsum_f: Google's rouge_score `rougeLsum` F-measure (InfiniteBench's summarization scorer, through
// HF `evaluate`): lower-cased [a-z0-9]+ tokens, sentences split on "\n", union LCS per reference sentence with
// token counts preventing double counting.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace namm::tasks {

struct RougeCompat {
  // Return 0 when the reference's recursive LCS reconstruction would exceed Python's recursion limit.
  bool recursion_limit_zero = true;
  // Nested `_recon` calls the reference's call stack leaves room for (Python's limit of 1000 frames minus
  // the ~50 frames of its evaluation code above the metric; spec §8.3 puts the cut-off at about 950 words).
  int64_t max_recursion_depth = 950;
};

double rouge_l_f(const std::string& prediction, const std::string& ground_truth, const RougeCompat& compat = {});

double rouge_lsum_f(const std::string& prediction, const std::string& target);
// Several references: the best F-measure (rouge_score's score_multi).
double rouge_lsum_f(const std::string& prediction, const std::vector<std::string>& targets);

}  // namespace namm::tasks
