// The scorers' quirks, with expected values computed by hand (derivations in the comments) or, for difflib,
// with CPython's own difflib while writing the test.
#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>

#include "namm/tasks/mecab_tokenizer.h"
#include "namm/tasks/metrics.h"
#include "namm/tasks/python_text.h"
#include "namm/tasks/rouge.h"
#include "namm/tasks/sequence_matcher.h"

namespace namm::tasks {
namespace {

double Score(const std::string& metric, const std::string& prediction, const std::string& answer,
             const std::vector<std::string>& classes = {}) {
  auto s = score_answer(metric, prediction, answer, classes);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : -1;
}

TEST(PythonText, SplitLowerAndFormat) {
  EXPECT_EQ(py_split(U" a\u3000b\u00a0c\x1c d "), (std::vector<std::u32string>{U"a", U"b", U"c", U"d"}));
  EXPECT_EQ(py_lower("ÉCOLE ΟΔΟΣ İ"), "école οδος i\xcc\x87");  // final sigma; İ lowers to i + combining dot
  auto s = py_format("{{x}} {a} {b[1]}!", {{"a", {"A", {}}}, {"b", {"['p', 'q']", {"p", "q"}}}});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, "{x} A q!");
  auto missing = py_format("{nope}", {});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("'nope'"), std::string::npos);
}

TEST(PythonText, IntAndFloatReadAnyScriptsDigits) {
  EXPECT_EQ(py_int(" \u0663\u0664\u3000"), 34);  // int(" ٣٤\u3000"): Arabic-Indic digits, Unicode whitespace
  EXPECT_EQ(py_int("+1_000"), 1000);
  EXPECT_EQ(py_int("-7"), -7);
  for (const char* bad : {"", "+", "1__0", "_1", "1_", "1.0", "0x10", "\u00b2", "99999999999999999999"}) {
    EXPECT_FALSE(py_int(bad).has_value()) << bad;  // "²" is a digit but not decimal (Nd) in Python either
  }
  EXPECT_EQ(py_float("\u0663.\u0665"), 3.5);
  EXPECT_EQ(py_float(".5"), 0.5);
  EXPECT_EQ(py_float("5."), 5.0);
  EXPECT_EQ(py_float("1_0.5e1"), 105.0);
  EXPECT_EQ(py_float(" -Infinity "), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(py_float("1e999"), std::numeric_limits<double>::infinity());
  for (const char* bad : {".", "e5", "1e", "0x10", "nan(1)", "1._5", "--1"}) {
    EXPECT_FALSE(py_float(bad).has_value()) << bad;
  }
}

TEST(PythonText, ReprAndStrFollowCPython) {
  EXPECT_EQ(py_repr_float(1.0), "1.0");
  EXPECT_EQ(py_repr_float(0.1), "0.1");
  EXPECT_EQ(py_repr_float(-0.0), "-0.0");
  EXPECT_EQ(py_repr_float(0.0001), "0.0001");
  EXPECT_EQ(py_repr_float(0.00001), "1e-05");
  EXPECT_EQ(py_repr_float(1.5e-7), "1.5e-07");
  EXPECT_EQ(py_repr_float(1e15), "1000000000000000.0");
  EXPECT_EQ(py_repr_float(1e16), "1e+16");
  EXPECT_EQ(py_repr_float(123456789012345678.0), "1.2345678901234568e+17");
  EXPECT_EQ(py_repr_float(1e100), "1e+100");
  EXPECT_EQ(py_repr_float(2.0 / 3.0), "0.6666666666666666");
  using nlohmann::json;
  EXPECT_EQ(py_str(json::parse(R"(["a", 1, true, null, 2.5, "it's", "a\nb\u0007\u200b\u00e9\\"])")),
            R"(['a', 1, True, None, 2.5, "it's", 'a\nb\x07\u200bé\\'])");
  EXPECT_EQ(py_str(json::parse(R"({"k": ["v"]})")), "{'k': ['v']}");
  EXPECT_EQ(py_str(json("plain")), "plain");
  EXPECT_EQ(py_str(json(false)), "False");
}

TEST(QaF1, NormalizesLikeLongBench) {
  EXPECT_DOUBLE_EQ(Score("qa_f1", "The Eiffel Tower!", "eiffel tower"), 1.0);
  // pred tokens [apple, and, banana], truth [banana, apple, apple]: 2 in common, P = R = 2/3.
  EXPECT_DOUBLE_EQ(Score("qa_f1", "an apple and the banana", "banana apple apple"), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(Score("qa_f1", "ÉCOLE", "école"), 1.0);                 // Unicode lower-casing
  EXPECT_DOUBLE_EQ(Score("qa_f1", "theater", "the ater"), 0.0);          // "the" only as a whole word
  EXPECT_DOUBLE_EQ(Score("qa_f1", "", "anything"), 0.0);
}

// Python's \w is str.isalnum() plus '_': a combining mark (Mn) is not a word character, so "a\u0301" still
// holds the article "a" between word boundaries. PCRE2 10.43 and later count Mn as \w under UCP; this pins
// the Python behaviour should the library change under us.
TEST(QaF1, WordBoundariesFollowPythonAroundCombiningMarks) {
  EXPECT_DOUBLE_EQ(Score("qa_f1", "a\u0301 cat", "\u0301 cat"), 1.0);
  EXPECT_DOUBLE_EQ(Score("qa_f1", "the\u0301 cat", "\u0301 cat"), 1.0);
  EXPECT_DOUBLE_EQ(Score("qa_f1", "an\u0301 cat", "cat"), 2.0 / 3.0);  // tokens [\u0301, cat] against [cat]
}

TEST(QaF1Zh, SegmentsThenDropsPunctuation) {
  // jieba: [北京, 清华大学] vs [清华大学, 。]; "。" normalizes to empty and is dropped: P = 1/2, R = 1.
  auto s = score_answer("qa_f1_zh", "北京清华大学", "清华大学。");
  if (!s.ok()) GTEST_SKIP() << s.status().ToString();
  EXPECT_DOUBLE_EQ(*s, 2.0 / 3.0);
}

TEST(Japanese, MecabSurfacesAndQaF1Ja) {
  // Expected segmentation from Debian's mecab command with UniDic (mecab -Owakati -d /var/lib/mecab/dic/unidic).
  auto mecab = MecabTokenizer::Default();
  if (!mecab.ok()) GTEST_SKIP() << mecab.status().ToString();
  EXPECT_EQ((*mecab)->Surfaces("売上高は前年比１２．５％増加した"),
            (std::vector<std::string>{"売上", "高", "は", "前年", "比", "１", "２", "．", "５", "％", "増加", "し", "た"}));
  // pred [東京 都 に 住ん で い ます 。] -> 7 tokens once "。" is dropped; truth [東京 都]: P = 2/7, R = 1.
  EXPECT_DOUBLE_EQ(Score("qa_f1_ja", "東京都に住んでいます。", "東京都"), 2 * (2.0 / 7) / (2.0 / 7 + 1));
  // rouge_ja joins the surfaces with spaces: identical texts score ~1.
  EXPECT_NEAR(Score("rouge_ja", "東京都に住んでいます", "東京都に住んでいます"), 1.0, 1e-7);
}

TEST(Rouge, SetBasedSummaryLevelLcs) {
  EXPECT_DOUBLE_EQ(rouge_l_f("the cat sat", "the cat sat"), 2.0 * (1.0 / (2.0 + 1e-8)));
  // Sets: "a a b" vs "a b b" has m = n = |{a, b}| = 2 and LCS words {a, b}: a perfect score.
  EXPECT_DOUBLE_EQ(rouge_l_f("a a b", "a b b"), 2.0 * (1.0 / (2.0 + 1e-8)));
  // '.' separates sentences: hyp [x y, z], ref [x, y z]; the union of LCS word sets is {x, y, z}.
  EXPECT_DOUBLE_EQ(rouge_l_f("x y. z", "x. y z"), 2.0 * (1.0 / (2.0 + 1e-8)));
  // "a. ." -> sentences ["a", ""]: the empty sentence contributes the word "" (n = 2): P = 1/2, R = 1.
  EXPECT_DOUBLE_EQ(rouge_l_f("a. .", "a"), 2.0 * ((0.5 * 1.0) / (1.5 + 1e-8)));
  // Empty predictions raise inside ROUGE-1: 0.
  EXPECT_EQ(rouge_l_f("", "a"), 0.0);
  EXPECT_EQ(rouge_l_f("...", "a"), 0.0);
}

TEST(Rouge, RecursionLimitQuirkIsAnExplicitSwitch) {
  // ref "common w0 .. w999", pred "v0 .. v999 common": the LCS reconstruction walks 1000 rows up before the
  // match, 1002 nested calls: beyond Python's recursion limit, so the reference scored 0.
  std::string ref = "common", pred;
  for (int i = 0; i < 1000; ++i) {
    ref += " w" + std::to_string(i);
    pred += "v" + std::to_string(i) + " ";
  }
  pred += "common";
  EXPECT_EQ(rouge_l_f(pred, ref), 0.0);
  RougeCompat exact{/*recursion_limit_zero=*/false};
  const double r = 1.0 / 1001.0;
  EXPECT_DOUBLE_EQ(rouge_l_f(pred, ref, exact), 2.0 * ((r * r) / (2 * r + 1e-8)));
  // 900 words stay under the limit: scored normally.
  std::string short_ref = "common", short_pred;
  for (int i = 0; i < 900; ++i) {
    short_ref += " w" + std::to_string(i);
    short_pred += "v" + std::to_string(i) + " ";
  }
  short_pred += "common";
  EXPECT_GT(rouge_l_f(short_pred, short_ref), 0.0);
}

TEST(Rouge, GoogleRougeLsum) {
  // Tokens: pred [the cat sat] [it was happy]; target [the cat sat on the mat] [it was happy]. m = 9, n = 6,
  // hits 6 (each sentence's union LCS): R = 2/3, P = 1, F = 0.8.
  EXPECT_DOUBLE_EQ(rouge_lsum_f("The cat sat.\nIt was happy", "the cat sat on the mat\nit was happy"), 0.8);
  EXPECT_EQ(rouge_lsum_f("", "x"), 0.0);
  EXPECT_DOUBLE_EQ(rouge_lsum_f("a b", std::vector<std::string>{"z", "a b"}), 1.0);  // best reference
}

TEST(SequenceMatcher, MatchesCPythonDifflib) {
  // Ratios computed with CPython's difflib.SequenceMatcher(None, a, b).ratio().
  EXPECT_EQ(sequence_matcher_ratio(U"abcd", U"bcde"), 0.75);
  EXPECT_EQ(sequence_matcher_ratio(U"return self.value", U"return self._value"), 0.9714285714285714);
  EXPECT_EQ(sequence_matcher_ratio(U"for i in range(10):", U"for j in range(len(xs)):"), 0.7441860465116279);
  EXPECT_EQ(sequence_matcher_ratio(U"中文字符串", U"中文的字符"), 0.8);
  // Autojunk: b has >= 200 elements, so characters occurring more than 1 + len(b)/100 times never start a match.
  std::u32string a = U"def f(x):\n", b = U"def f(y):\n";
  for (int i = 0; i < 12; ++i) {
    a += U"    x = x + 1  # increment the value\n";
    b += U"    y = y + 2  # increase the value\n";
  }
  EXPECT_EQ(sequence_matcher_ratio(a, b), 0.029017857142857144);
  std::u32string c, d;
  for (int i = 0; i < 12; ++i) {
    c += U"aaaaaaaaaaaaaaaaaaaab";
    d += U"aaaaaaaaaaaaaaaaaaaac";
  }
  EXPECT_EQ(sequence_matcher_ratio(c, d), 0.07936507936507936);
}

TEST(SequenceMatcher, FuzzRatioRoundsHalfToEven) {
  EXPECT_EQ(fuzz_ratio("abcdefgh", "aijklmno"), 12);  // 100 * 2/16 = 12.5 -> 12
  EXPECT_EQ(fuzz_ratio("abcdefgh", "abcijklm"), 38);  // 100 * 6/16 = 37.5 -> 38
  EXPECT_EQ(fuzz_ratio("", ""), 100);                 // equal strings first
  EXPECT_EQ(fuzz_ratio("", "x"), 0);
}

TEST(Classification, RemovalWhileIteratingSkipsTheNextEntry) {
  // Matches in order: [A, AB, B, ABC]. Removing "A" shifts "AB" into its slot, so "AB" is never examined; then
  // "B" is removed; the list ends as [AB, ABC] and the answer scores 1/2 (without the quirk it would be 1).
  EXPECT_DOUBLE_EQ(Score("classification", "ABC", "ABC", {"A", "AB", "B", "ABC"}), 0.5);
  EXPECT_DOUBLE_EQ(Score("classification", "sports news", "sports", {"sports", "news", "finance"}), 0.5);
  EXPECT_DOUBLE_EQ(Score("classification", "finance", "sports", {"sports", "finance"}), 0.0);
}

TEST(RetrievalAndCount, ShareOfMatchingNumbers) {
  EXPECT_DOUBLE_EQ(Score("retrieval", "The answer is Paragraph 3, not 13", "Paragraph 3"), 0.5);
  EXPECT_DOUBLE_EQ(Score("retrieval", "no idea", "Paragraph 3"), 0.0);
  EXPECT_DOUBLE_EQ(Score("retrieval_zh", "段落16", "段落16"), 1.0);
  EXPECT_DOUBLE_EQ(Score("retrieval_zh", "段落\xEF\xBC\x91\xEF\xBC\x96", "段落16"), 0.0);  // full-width digits differ
  EXPECT_DOUBLE_EQ(Score("count", "There are 7 unique paragraphs out of 12", "7"), 0.5);
  EXPECT_FALSE(score_answer("retrieval", "3", "the third").ok());  // no "Paragraph N" in the answer
}

TEST(CodeSim, FirstCodeLineAndFuzzRatio) {
  // Leading newlines dropped, the comment line skipped; ratio 0.9714 -> 97 -> 0.97.
  EXPECT_DOUBLE_EQ(Score("code_sim", "\n\n# comment\nreturn self.value\nmore", "return self._value"), 0.97);
  EXPECT_DOUBLE_EQ(Score("code_sim", "// only comments\n# here", "x = 1"), 0.0);
}

TEST(ScorePrompt, BestOverAnswersAndUnknownMetrics) {
  auto s = score_prompt("qa_f1", "paris", nlohmann::json::array({"london", "Paris"}));
  ASSERT_TRUE(s.ok());
  EXPECT_DOUBLE_EQ(*s, 1.0);
  auto unknown = score_prompt("bleu", "x", "y");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("unknown metric 'bleu'"), std::string::npos);
}

TEST(InfiniteBench, ScorersFollowComputeScores) {
  using nlohmann::json;
  auto ib = [](const std::string& m, const std::string& p, const json& label) {
    auto s = score_prompt(m, p, label);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? *s : -1;
  };
  EXPECT_EQ(ib("ib_passkey", " 71432.", json::array({"71432"})), 1.0);
  EXPECT_EQ(ib("ib_passkey", "The key is 12 then 71432", json::array({"71432"})), 0.0);  // the first number counts
  EXPECT_EQ(ib("ib_kv_retrieval", "\"c9a1-77\": foo", json::array({"c9a1-77"})), 1.0);
  EXPECT_EQ(ib("ib_code_run", "The value is 42.", json::array({42})), 1.0);
  EXPECT_EQ(ib("ib_code_debug", "B. because", json::array({"func_b", "B"})), 1.0);
  EXPECT_EQ(ib("ib_code_debug", "The answer is: func_b", json::array({"func_b", "B"})), 1.0);
  EXPECT_EQ(ib("ib_math_find", "17 is it", json::array({17})), 1.0);
  EXPECT_EQ(ib("ib_math_find", "3.0", json::array({3})), 0.0);  // int("3.0") fails in the reference
  EXPECT_EQ(ib("ib_math_find", "2.5", json::array({2.5})), 1.0);
  EXPECT_EQ(ib("ib_math_find", "\u0663.\u0665!", json::array({3.5})), 1.0);  // \d and float() take any Nd digit
  EXPECT_EQ(ib("ib_math_find", "x \u0663\u0664", json::array({34})), 1.0);
  EXPECT_EQ(ib("ib_code_run", "value: \u0664\u0662\u3000", json::array({42})), 1.0);
  // The character after an answer prefix is skipped whole, even when it takes several bytes.
  EXPECT_EQ(ib("ib_code_debug", "The answer is:\u00e9B", json::array({"func_b", "B"})), 1.0);
  EXPECT_EQ(ib("ib_code_debug", "The answer is:", json::array({"func_b", "B"})), 0.0);
  EXPECT_EQ(ib("ib_choice", "the answer is:\u00e9C", json::array({"C"})), 1.0);
  EXPECT_EQ(ib("ib_math_calc", "[1, 4, 8, 9]", json::array({1, 4, 8, 2})), 0.75);
  EXPECT_EQ(ib("ib_longdialogue_qa", "It is john.", json::array({"JOHN"})), 1.0);
  EXPECT_EQ(ib("ib_choice", "C", json::array({"C"})), 1.0);
  EXPECT_EQ(ib("ib_choice", "I think the answer is: B", json::array({"B"})), 1.0);
  EXPECT_DOUBLE_EQ(ib("ib_qa_chn", "北京大学", json::array({"北京"})), 2.0 / 3.0);  // characters, not words
  EXPECT_DOUBLE_EQ(ib("ib_qa_eng", "the Paris", json::array({"Rome", "paris"})), 1.0);
}

}  // namespace
}  // namespace namm::tasks
