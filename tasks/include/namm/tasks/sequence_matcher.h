// difflib.SequenceMatcher(None, a, b).ratio() on code points, with autojunk (Python 3's default): in a `b` of
// 200 or more elements, elements occurring more than 1 + len(b) // 100 times are "popular" and never start a
// match (they can still extend one). Matching blocks are found recursively around the longest match, exactly
// as difflib does, so the ratio is bit-identical. Used by LongBench's code_sim (via fuzzywuzzy's ratio).
#pragma once

#include <string>

namespace namm::tasks {

// 2 M / (len(a) + len(b)), M = the matched elements; 1.0 when both are empty.
double sequence_matcher_ratio(const std::u32string& a, const std::u32string& b);

// fuzzywuzzy 0.18 `fuzz.ratio(a, b)` without python-Levenshtein: 100 if a == b, 0 if either is empty,
// else int(round(100 * ratio)) with Python's round-half-to-even.
int fuzz_ratio(const std::string& a, const std::string& b);

}  // namespace namm::tasks
