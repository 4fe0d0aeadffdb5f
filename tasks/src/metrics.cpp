#include "namm/tasks/metrics.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>

#include "namm/regex.h"
#include "namm/tasks/jieba.h"
#include "namm/tasks/mecab_tokenizer.h"
#include "namm/tasks/python_text.h"
#include "namm/tasks/sequence_matcher.h"

namespace namm::tasks {

namespace {

using Json = nlohmann::json;
using Tokens = std::vector<std::string>;

const Regex& CompiledRegex(const char* pattern) {
  // Patterns are fixed literals; each is compiled once.
  static std::map<std::string, Regex> cache;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(pattern);
  if (it == cache.end()) it = cache.emplace(pattern, std::move(Regex::Compile(pattern)).value()).first;
  return it->second;
}

// re.findall(pattern, text); for patterns "<literal prefix>(\d+)" pass the prefix's byte length to get the group.
Result<std::vector<std::string>> FindAll(const char* pattern, const std::string& text, std::size_t group_prefix = 0) {
  std::vector<std::string> out;
  const std::string clean = to_utf8(to_u32(text));  // PCRE2 needs valid UTF-8
  NAMM_ASSIGN_OR_RETURN(const auto matches, CompiledRegex(pattern).FindAll(clean));
  for (const auto& [begin, end] : matches) {
    out.push_back(clean.substr(begin + group_prefix, end - begin - group_prefix));
  }
  return out;
}

std::string JoinWhitespaceSplit(const std::u32string& text, const char* separator) {
  std::string out;
  for (const auto& word : py_split(text)) out += (out.empty() ? "" : separator) + to_utf8(word);
  return out;
}

// LongBench's normalize_answer.
Result<std::string> NormalizeAnswer(const std::string& s) {
  std::u32string no_punct;
  for (char32_t c : to_u32(py_lower(s))) {
    if (!is_ascii_punctuation(c)) no_punct.push_back(c);
  }
  const std::string text = to_utf8(no_punct);
  std::string no_articles;
  std::size_t cursor = 0;
  NAMM_ASSIGN_OR_RETURN(const auto articles, CompiledRegex(R"(\b(a|an|the)\b)").FindAll(text));
  for (const auto& [begin, end] : articles) {
    no_articles += text.substr(cursor, begin - cursor) + " ";
    cursor = end;
  }
  no_articles += text.substr(cursor);
  return JoinWhitespaceSplit(to_u32(no_articles), " ");
}

// LongBench's normalize_zh_answer (also ChouBun's normalize_ja_answer).
std::string NormalizeCjkAnswer(const std::string& s) {
  static const std::u32string kCjkPunctuation = to_u32(
      "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.");
  std::u32string kept;
  for (char32_t c : to_u32(py_lower(s))) {
    if (!is_ascii_punctuation(c) && kCjkPunctuation.find(c) == std::u32string::npos) kept.push_back(c);
  }
  return JoinWhitespaceSplit(kept, "");
}

// LongBench's f1_score over token lists (Counter intersection).
double TokenF1(const Tokens& prediction, const Tokens& truth) {
  std::map<std::string, int64_t> counts;
  for (const auto& t : truth) ++counts[t];
  int64_t same = 0;
  for (const auto& t : prediction) {
    auto it = counts.find(t);
    if (it != counts.end() && it->second > 0) {
      --it->second;
      ++same;
    }
  }
  if (same == 0) return 0.0;
  const double precision = 1.0 * static_cast<double>(same) / static_cast<double>(prediction.size());
  const double recall = 1.0 * static_cast<double>(same) / static_cast<double>(truth.size());
  return (2 * precision * recall) / (precision + recall);
}

Tokens SplitWords(const std::string& text) {
  Tokens out;
  for (const auto& w : py_split(to_u32(text))) out.push_back(to_utf8(w));
  return out;
}

// LongBench's qa_f1_score: token F1 of the normalized answers.
Result<double> QaF1(const std::string& prediction, const std::string& answer) {
  NAMM_ASSIGN_OR_RETURN(const std::string p, NormalizeAnswer(prediction));
  NAMM_ASSIGN_OR_RETURN(const std::string a, NormalizeAnswer(answer));
  return TokenF1(SplitWords(p), SplitWords(a));
}

Tokens NormalizedCjkTokens(const Tokens& raw) {
  Tokens out;
  for (const auto& t : raw) {
    std::string n = NormalizeCjkAnswer(t);
    if (!n.empty()) out.push_back(std::move(n));
  }
  return out;
}

Result<Tokens> JiebaCut(const std::string& text) {
  NAMM_ASSIGN_OR_RETURN(std::shared_ptr<const Jieba> jieba, Jieba::Default());
  return jieba->Cut(text);
}

Result<Tokens> MecabCut(const std::string& text) {
  NAMM_ASSIGN_OR_RETURN(std::shared_ptr<const MecabTokenizer> mecab, MecabTokenizer::Default());
  return mecab->Surfaces(text);
}

std::string Join(const Tokens& tokens, const std::string& separator) {
  std::string out;
  for (std::size_t i = 0; i < tokens.size(); ++i) out += (i ? separator : "") + tokens[i];
  return out;
}

Result<double> NumberMatchShare(const std::string& prediction, const std::string& target) {
  NAMM_ASSIGN_OR_RETURN(const Tokens numbers, FindAll(R"(\d+)", prediction));
  if (numbers.empty()) return 0.0;
  const auto right = std::count(numbers.begin(), numbers.end(), target);
  return static_cast<double>(right) / static_cast<double>(numbers.size());
}

// ---- InfiniteBench helpers ---------------------------------------------------------------------------------------

std::string ReplaceEach(std::string text, const std::vector<std::string>& targets, const std::string& with) {
  for (const auto& target : targets) {
    for (std::size_t pos = text.find(target); pos != std::string::npos; pos = text.find(target, pos + with.size())) {
      text.replace(pos, target.size(), with);
    }
  }
  return text;
}

std::string CollapseDoubleSpaces(std::string text) {  // while "  " in pred: pred = pred.replace("  ", " ")
  while (text.find("  ") != std::string::npos) text = ReplaceEach(text, {"  "}, " ");
  return text;
}

// re.split("[^0-9]", text), non-empty items.
Tokens AsciiDigitRuns(const std::string& text) {
  Tokens out;
  std::string run;
  for (char c : text) {
    if (c >= '0' && c <= '9') {
      run += c;
    } else if (!run.empty()) {
      out.push_back(std::move(run));
      run.clear();
    }
  }
  if (!run.empty()) out.push_back(run);
  return out;
}

// InfiniteBench's release wraps every answer in a list; scorers that expect a scalar take its first element.
Json Scalar(const Json& label) { return label.is_array() && !label.empty() ? label[0] : label; }

double IbFirstInt(const std::string& prediction, const Json& label) {
  const Tokens runs = AsciiDigitRuns(prediction);
  return (runs.empty() ? std::string() : runs[0]) == py_str(Scalar(label)) ? 1.0 : 0.0;
}

double IbKvRetrieval(const std::string& prediction, const Json& label) {
  const std::string cleaned = ReplaceEach(prediction, {"\n", ":", "\"", "'", ".", ",", "?", "!", "{", "}"}, " ");
  const Tokens words = SplitWords(cleaned);
  return std::find(words.begin(), words.end(), py_str(Scalar(label))) != words.end() ? 1.0 : 0.0;
}

double IbCodeRun(const std::string& prediction, const Json& label) {
  std::string pred = to_utf8(py_strip(to_u32(prediction)));
  pred = ReplaceEach(pred, {"\n", ".", "`", "'", "\"", ":"}, " ");
  const Tokens words = SplitWords(pred);
  if (words.empty()) return 0.0;
  const auto value = py_int(words.back());
  const Json expected = Scalar(label);
  return value && expected.is_number_integer() && *value == expected.get<int64_t>() ? 1.0 : 0.0;
}

// The reference's answer-prefix search: the first of `prefixes` found in `pred` and the text after it plus one
// skipped character (Python's pred[idx + len(prefix) + 1:], in code points). `rest` is nullopt when the
// prediction ends right after the prefix, which the reference scores as wrong.
struct AnswerPrefixMatch {
  bool found = false;
  std::optional<std::u32string> rest;
};

AnswerPrefixMatch FindAnswerPrefix(const std::u32string& pred, const std::vector<std::u32string>& prefixes) {
  for (const auto& prefix : prefixes) {
    const auto idx = pred.find(prefix);
    if (idx == std::u32string::npos) continue;
    const std::size_t begin = idx + prefix.size() + 1;
    if (begin > pred.size()) return {true, std::nullopt};
    return {true, pred.substr(begin)};
  }
  return {};
}

bool StartsWith(const std::u32string& s, const std::u32string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

double IbCodeDebug(const std::string& prediction, const Json& label) {
  if (!label.is_array() || label.size() < 2) return 0.0;
  const std::string fn_name = py_str(label[0]), letter = py_str(label[1]);
  const std::u32string p32 = to_u32(prediction);
  const std::string head = to_utf8(p32.substr(0, 2));  // the reference looks at pred[:2] before stripping
  if (head == letter + "." || head == letter + ":") return 1.0;
  std::string pred = to_utf8(py_strip(p32));
  pred = CollapseDoubleSpaces(ReplaceEach(pred, {"\n", "`", "'", "\"", "-", "*", "Option", "option"}, " "));
  const auto match = FindAnswerPrefix(to_u32(pred), {U"answer is:", U"is:", U"answer:"});
  if (!match.rest) return 0.0;
  return StartsWith(*match.rest, to_u32(letter)) || StartsWith(*match.rest, to_u32(fn_name)) ? 1.0 : 0.0;
}

Result<double> IbMathFind(const std::string& prediction, const Json& label_in) {
  const Json label = Scalar(label_in);
  NAMM_ASSIGN_OR_RETURN(const Tokens first, FindAll(R"(\d+\.\d+|\d+)", prediction));
  if (first.empty()) return 0.0;
  if (label.is_number_integer()) {
    // int() of a decimal match raises in the reference's scorer; a number that is not an integer scores 0.
    const auto value = py_int(first[0]);
    return value && *value == label.get<int64_t>() ? 1.0 : 0.0;
  }
  if (label.is_number_float()) {
    const auto value = py_float(first[0]);  // \d matches any script's digits; float() reads them too
    return value && *value == label.get<double>() ? 1.0 : 0.0;
  }
  return 0.0;
}

double IbMathCalc(const std::string& prediction, const Json& label) {
  if (!label.is_array() || label.empty()) return 0.0;
  const Tokens runs = AsciiDigitRuns(prediction);
  std::size_t count = 0;
  for (std::size_t i = 0; i < label.size() && i < runs.size(); ++i) {
    const auto value = py_int(runs[i]);
    if (!label[i].is_number_integer() || !value || *value != label[i].get<int64_t>()) break;
    ++count;
  }
  return static_cast<double>(count) / static_cast<double>(label.size());
}

double IbLongDialogue(const std::string& prediction, const Json& label) {
  const std::string name = py_str(Scalar(label));
  const std::string cleaned = ReplaceEach(prediction, {"\n", ":", "\"", "'", ".", ",", "?", "!", "{", "}"}, " ");
  for (const auto& word : SplitWords(cleaned)) {
    if (py_upper(word) == name) return 1.0;
  }
  return 0.0;
}

double IbChoice(const std::string& prediction, const Json& label) {
  std::vector<std::string> options;
  for (const auto& l : label.is_array() ? label : Json::array({label})) options.push_back(py_str(l));
  auto in_label = [&](const std::string& s) { return std::find(options.begin(), options.end(), s) != options.end(); };
  const std::u32string p32 = to_u32(prediction);
  if (p32.empty()) return 0.0;  // the reference indexes pred[0] and would raise
  if (p32[0] == 'A' || p32[0] == 'B' || p32[0] == 'C' || p32[0] == 'D') return in_label(to_utf8(p32[0])) ? 1.0 : 0.0;
  std::string pred = CollapseDoubleSpaces(ReplaceEach(prediction, {"\n", "\"", "'", ".", ",", "?", "!", "{", "}"}, " "));
  const auto match = FindAnswerPrefix(to_u32(pred), {U"answer is:", U"answer:", U"answer is", U"option is"});
  if (match.found) {
    for (const auto& option : options) {
      if (match.rest && StartsWith(*match.rest, to_u32(option))) return 1.0;
    }
    return 0.0;
  }
  for (const auto& word : SplitWords(pred)) {
    if (std::string("ABCD").find(word) != std::string::npos) return in_label(word) ? 1.0 : 0.0;  // `word in "ABCD"`
  }
  return 0.0;
}

double CharF1Zh(const std::string& prediction, const std::string& truth) {
  Tokens p, t;
  for (char32_t c : to_u32(NormalizeCjkAnswer(prediction))) p.push_back(to_utf8(c));
  for (char32_t c : to_u32(NormalizeCjkAnswer(truth))) t.push_back(to_utf8(c));
  return TokenF1(p, t);
}

// ---- registry ----------------------------------------------------------------------------------------------------

using AnswerMetric = std::function<Result<double>(const std::string&, const std::string&, const std::vector<std::string>&,
                                                  const MetricOptions&)>;
using LabelMetric = std::function<Result<double>(const std::string&, const Json&, const MetricOptions&)>;

const std::map<std::string, AnswerMetric>& AnswerMetrics() {
  static const std::map<std::string, AnswerMetric> metrics = {
      {"qa_f1",
       [](const std::string& p, const std::string& a, const auto&, const auto&) -> Result<double> {
         return QaF1(p, a);
       }},
      {"qa_f1_zh",
       [](const std::string& p, const std::string& a, const auto&, const auto&) -> Result<double> {
         NAMM_ASSIGN_OR_RETURN(Tokens pt, JiebaCut(p));
         NAMM_ASSIGN_OR_RETURN(Tokens at, JiebaCut(a));
         return TokenF1(NormalizedCjkTokens(pt), NormalizedCjkTokens(at));
       }},
      {"qa_f1_ja",
       [](const std::string& p, const std::string& a, const auto&, const auto&) -> Result<double> {
         NAMM_ASSIGN_OR_RETURN(Tokens pt, MecabCut(p));
         NAMM_ASSIGN_OR_RETURN(Tokens at, MecabCut(a));
         return TokenF1(NormalizedCjkTokens(pt), NormalizedCjkTokens(at));
       }},
      {"rouge",
       [](const std::string& p, const std::string& a, const auto&, const MetricOptions& o) -> Result<double> {
         return rouge_l_f(p, a, o.rouge);
       }},
      {"rouge_zh",
       [](const std::string& p, const std::string& a, const auto&, const MetricOptions& o) -> Result<double> {
         NAMM_ASSIGN_OR_RETURN(Tokens pt, JiebaCut(p));
         NAMM_ASSIGN_OR_RETURN(Tokens at, JiebaCut(a));
         return rouge_l_f(Join(pt, " "), Join(at, " "), o.rouge);
       }},
      {"rouge_ja",
       [](const std::string& p, const std::string& a, const auto&, const MetricOptions& o) -> Result<double> {
         NAMM_ASSIGN_OR_RETURN(Tokens pt, MecabCut(p));
         NAMM_ASSIGN_OR_RETURN(Tokens at, MecabCut(a));
         return rouge_l_f(Join(pt, " "), Join(at, " "), o.rouge);
       }},
      {"classification",
       [](const std::string& p, const std::string& a, const std::vector<std::string>& classes,
          const auto&) -> Result<double> {
         std::vector<std::string> matches;
         for (const auto& c : classes) {
           if (p.find(c) != std::string::npos) matches.push_back(c);
         }
         // Python's `for term in list: list.remove(term)` advances an index over a shrinking list.
         for (std::size_t i = 0; i < matches.size(); ++i) {
           const std::string term = matches[i];
           if (a.find(term) != std::string::npos && term != a) matches.erase(std::find(matches.begin(), matches.end(), term));
         }
         const bool hit = std::find(matches.begin(), matches.end(), a) != matches.end();
         return hit ? 1.0 / static_cast<double>(matches.size()) : 0.0;
       }},
      {"retrieval",
       [](const std::string& p, const std::string& a, const auto&, const auto&) -> Result<double> {
         NAMM_ASSIGN_OR_RETURN(const Tokens ids, FindAll(R"(Paragraph (\d+))", a, std::string("Paragraph ").size()));
         if (ids.empty()) return Status::InvalidArgument("retrieval: the answer '" + a + "' names no 'Paragraph N'");
         return NumberMatchShare(p, ids[0]);
       }},
      {"retrieval_zh",
       [](const std::string& p, const std::string& a, const auto&, const auto&) -> Result<double> {
         NAMM_ASSIGN_OR_RETURN(const Tokens ids, FindAll(R"(段落(\d+))", a, std::string("段落").size()));
         if (ids.empty()) return Status::InvalidArgument("retrieval_zh: the answer '" + a + "' names no '段落N'");
         return NumberMatchShare(p, ids[0]);
       }},
      {"count",
       [](const std::string& p, const std::string& a, const auto&, const auto&) -> Result<double> {
         return NumberMatchShare(p, a);
       }},
      {"code_sim",
       [](const std::string& p, const std::string& a, const auto&, const auto&) -> Result<double> {
         const std::string body = to_utf8(py_lstrip(to_u32(p), U"\n"));
         std::string line;
         std::size_t start = 0;
         while (true) {
           const auto nl = body.find('\n', start);
           const std::string candidate = body.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
           if (candidate.find('`') == std::string::npos && candidate.find('#') == std::string::npos &&
               candidate.find("//") == std::string::npos) {
             line = candidate;
             break;
           }
           if (nl == std::string::npos) break;
           start = nl + 1;
         }
         return fuzz_ratio(line, a) / 100.0;
       }},
  };
  return metrics;
}

// Metrics that want the best score over several answer strings.
Result<double> BestOverAnswers(const Json& answers, const std::function<Result<double>(const std::string&)>& score) {
  double best = 0;
  for (const auto& a : answers.is_array() ? answers : Json::array({answers})) {
    NAMM_ASSIGN_OR_RETURN(const double s, score(py_str(a)));
    best = std::max(best, s);
  }
  return best;
}

const std::map<std::string, LabelMetric>& LabelMetrics() {
  static const std::map<std::string, LabelMetric> metrics = {
      {"ib_passkey", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbFirstInt(p, l); }},
      {"ib_number_string", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbFirstInt(p, l); }},
      {"ib_kv_retrieval", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbKvRetrieval(p, l); }},
      {"ib_code_run", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbCodeRun(p, l); }},
      {"ib_code_debug", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbCodeDebug(p, l); }},
      {"ib_math_find", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbMathFind(p, l); }},
      {"ib_math_calc", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbMathCalc(p, l); }},
      {"ib_longdialogue_qa", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbLongDialogue(p, l); }},
      {"ib_choice", [](const std::string& p, const Json& l, const auto&) -> Result<double> { return IbChoice(p, l); }},
      {"ib_qa_eng",
       [](const std::string& p, const Json& l, const auto&) -> Result<double> {
         return BestOverAnswers(l, [&](const std::string& a) { return QaF1(p, a); });
       }},
      {"ib_qa_chn",
       [](const std::string& p, const Json& l, const auto&) -> Result<double> {
         return BestOverAnswers(l, [&](const std::string& a) -> Result<double> { return CharF1Zh(p, a); });
       }},
      {"ib_sum",
       [](const std::string& p, const Json& l, const auto&) -> Result<double> {
         std::vector<std::string> targets;
         for (const auto& a : l.is_array() ? l : Json::array({l})) targets.push_back(py_str(a));
         return rouge_lsum_f(p, targets);
       }},
  };
  return metrics;
}

}  // namespace

bool is_metric(const std::string& name) { return AnswerMetrics().count(name) || LabelMetrics().count(name); }

std::vector<std::string> metric_names() {
  std::vector<std::string> names;
  for (const auto& [name, fn] : AnswerMetrics()) names.push_back(name);
  for (const auto& [name, fn] : LabelMetrics()) names.push_back(name);
  return names;
}

Result<double> score_answer(const std::string& metric, const std::string& prediction, const std::string& answer,
                            const std::vector<std::string>& all_classes, const MetricOptions& options) {
  auto it = AnswerMetrics().find(metric);
  if (it != AnswerMetrics().end()) return it->second(prediction, answer, all_classes, options);
  return score_prompt(metric, prediction, Json(answer), all_classes, options);
}

Result<double> score_prompt(const std::string& metric, const std::string& prediction, const Json& answers,
                            const std::vector<std::string>& all_classes, const MetricOptions& options) {
  auto answer_metric = AnswerMetrics().find(metric);
  if (answer_metric != AnswerMetrics().end()) {
    double best = 0;  // LongBench's get_score: max over the answers, starting at 0
    for (const auto& a : answers.is_array() ? answers : Json::array({answers})) {
      NAMM_ASSIGN_OR_RETURN(double s, answer_metric->second(prediction, py_str(a), all_classes, options));
      best = std::max(best, s);
    }
    return best;
  }
  auto label_metric = LabelMetrics().find(metric);
  if (label_metric != LabelMetrics().end()) return label_metric->second(prediction, answers, options);
  std::string known;
  for (const auto& n : metric_names()) known += (known.empty() ? "" : ", ") + n;
  return Status::InvalidArgument("unknown metric '" + metric + "' (known: " + known + ")");
}

}  // namespace namm::tasks
