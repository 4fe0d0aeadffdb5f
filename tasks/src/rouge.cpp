#include "namm/tasks/rouge.h"

#include <algorithm>
#include <map>
#include <set>

#include "namm/tasks/python_text.h"

namespace namm::tasks {

namespace {

using Words = std::vector<std::string>;

// [" ".join(s.split()) for s in text.split(".") if len(s) > 0]
std::vector<std::string> RougeSentences(const std::string& text) {
  std::vector<std::string> sentences;
  std::size_t start = 0;
  while (true) {
    const auto dot = text.find('.', start);
    const std::string piece = text.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!piece.empty()) {
      std::string joined;
      for (const auto& word : py_split(to_u32(piece))) joined += (joined.empty() ? "" : " ") + to_utf8(word);
      sentences.push_back(joined);
    }
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return sentences;
}

// sentence.split(" ")
Words SplitOnSpace(const std::string& sentence) {
  Words words;
  std::size_t start = 0;
  while (true) {
    const auto space = sentence.find(' ', start);
    words.push_back(sentence.substr(start, space == std::string::npos ? std::string::npos : space - start));
    if (space == std::string::npos) return words;
    start = space + 1;
  }
}

// LCS length table, (n + 1) x (m + 1), row-major.
std::vector<int32_t> LcsTable(const Words& x, const Words& y) {
  const std::size_t n = x.size(), m = y.size();
  std::vector<int32_t> t((n + 1) * (m + 1), 0);
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      t[i * (m + 1) + j] = x[i - 1] == y[j - 1] ? t[(i - 1) * (m + 1) + j - 1] + 1
                                               : std::max(t[(i - 1) * (m + 1) + j], t[i * (m + 1) + j - 1]);
    }
  }
  return t;
}

// rouge 1.0.1's _recon_lcs as a set of words; *depth = the number of nested _recon calls it makes.
std::set<std::string> ReconLcsWords(const Words& x, const Words& y, int64_t* depth) {
  const std::vector<int32_t> t = LcsTable(x, y);
  const std::size_t m = y.size();
  std::set<std::string> words;
  std::size_t i = x.size(), j = m;
  *depth = 1;
  while (i > 0 && j > 0) {
    ++*depth;
    if (x[i - 1] == y[j - 1]) {
      words.insert(x[i - 1]);
      --i;
      --j;
    } else if (t[(i - 1) * (m + 1) + j] > t[i * (m + 1) + j - 1]) {
      --i;
    } else {
      --j;
    }
  }
  return words;
}

// Google rouge_score's tokenizer: lower-case, anything but [a-z0-9] separates tokens.
Words GoogleTokens(const std::string& text) {
  Words tokens;
  std::string token;
  for (char32_t c : to_u32(py_lower(text))) {
    if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) {
      token += static_cast<char>(c);
    } else if (!token.empty()) {
      tokens.push_back(std::move(token));
      token.clear();
    }
  }
  if (!token.empty()) tokens.push_back(std::move(token));
  return tokens;
}

// Indices into `ref` of one LCS with `can` (rouge_score's _backtrack_norec).
std::vector<std::size_t> LcsIndices(const Words& ref, const Words& can) {
  const std::vector<int32_t> t = LcsTable(ref, can);
  const std::size_t m = can.size();
  std::vector<std::size_t> out;
  std::size_t i = ref.size(), j = m;
  while (i > 0 && j > 0) {
    if (ref[i - 1] == can[j - 1]) {
      out.push_back(i - 1);
      --i;
      --j;
    } else if (t[i * (m + 1) + j - 1] > t[(i - 1) * (m + 1) + j]) {
      --j;
    } else {
      --i;
    }
  }
  return out;
}

double FMeasure(double precision, double recall) {
  return precision + recall > 0 ? 2 * precision * recall / (precision + recall) : 0.0;
}

}  // namespace

double rouge_l_f(const std::string& prediction, const std::string& ground_truth, const RougeCompat& compat) {
  const std::vector<std::string> hyp = RougeSentences(prediction), ref = RougeSentences(ground_truth);
  if (hyp.empty() || ref.empty()) return 0.0;  // rouge-1 raises "Hypothesis/Reference is empty."

  std::set<std::string> ref_vocabulary, hyp_vocabulary, lcs_union;
  std::vector<Words> hyp_words;
  for (const auto& s : hyp) {
    hyp_words.push_back(SplitOnSpace(s));
    hyp_vocabulary.insert(hyp_words.back().begin(), hyp_words.back().end());
  }
  for (const auto& r : ref) {
    const Words ref_words = SplitOnSpace(r);
    ref_vocabulary.insert(ref_words.begin(), ref_words.end());
    for (const auto& h : hyp_words) {
      int64_t depth = 0;
      const std::set<std::string> lcs = ReconLcsWords(ref_words, h, &depth);
      if (compat.recursion_limit_zero && depth > compat.max_recursion_depth) return 0.0;  // RecursionError
      lcs_union.insert(lcs.begin(), lcs.end());
    }
  }
  const double llcs = static_cast<double>(lcs_union.size());
  const double r_lcs = llcs / static_cast<double>(ref_vocabulary.size());
  const double p_lcs = llcs / static_cast<double>(hyp_vocabulary.size());
  return 2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8));
}

double rouge_lsum_f(const std::string& prediction, const std::string& target) {
  auto sentences = [](const std::string& text) {
    std::vector<Words> out;
    std::size_t start = 0;
    while (true) {
      const auto nl = text.find('\n', start);
      const std::string s = text.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
      if (!s.empty()) out.push_back(GoogleTokens(s));
      if (nl == std::string::npos) return out;
      start = nl + 1;
    }
  };
  const std::vector<Words> ref = sentences(target), can = sentences(prediction);
  if (ref.empty() || can.empty()) return 0.0;
  std::size_t m = 0, n = 0;
  std::map<std::string, int64_t> ref_counts, can_counts;
  for (const auto& s : ref) {
    m += s.size();
    for (const auto& t : s) ++ref_counts[t];
  }
  for (const auto& s : can) {
    n += s.size();
    for (const auto& t : s) ++can_counts[t];
  }
  if (m == 0 || n == 0) return 0.0;
  int64_t hits = 0;
  for (const auto& r : ref) {
    std::set<std::size_t> union_indices;
    for (const auto& c : can) {
      for (std::size_t i : LcsIndices(r, c)) union_indices.insert(i);
    }
    for (std::size_t i : union_indices) {
      const std::string& token = r[i];
      if (can_counts[token] > 0 && ref_counts[token] > 0) {
        ++hits;
        --can_counts[token];
        --ref_counts[token];
      }
    }
  }
  return FMeasure(static_cast<double>(hits) / static_cast<double>(n), static_cast<double>(hits) / static_cast<double>(m));
}

double rouge_lsum_f(const std::string& prediction, const std::vector<std::string>& targets) {
  double best = 0.0;
  bool first = true;
  for (const auto& t : targets) {
    const double f = rouge_lsum_f(prediction, t);
    if (first || f > best) best = f;
    first = false;
  }
  return best;
}

}  // namespace namm::tasks
