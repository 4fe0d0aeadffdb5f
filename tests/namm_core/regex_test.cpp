#include "namm/regex.h"

#include <gtest/gtest.h>

#include <string>

namespace namm {
namespace {

// A repeated group on a long text outgrows the JIT's 32 KB stack; the interpreter finishes the match. (Earlier,
// the error counted as "no more matches" and the text's matches were silently lost.)
TEST(Regex, AMatchBeyondTheJitStackIsDoneByTheInterpreter) {
  const Regex r = Regex::Compile("(a|b)*c").value();
  const std::string text = "x" + std::string(200000, 'a') + "c yy abc";
  const auto matches = r.FindAll(text);
  ASSERT_TRUE(matches.ok()) << matches.status().ToString();
  ASSERT_EQ(matches->size(), 2u);
  EXPECT_EQ((*matches)[0], std::make_pair(std::size_t{1}, std::size_t{200002}));
  EXPECT_EQ((*matches)[1], std::make_pair(text.size() - 3, text.size()));
}

// Catastrophic backtracking hits PCRE2's match limit: an error naming it and where, not a partial result.
TEST(Regex, AMatchLimitIsAnErrorNotTheEndOfTheMatches) {
  const Regex r = Regex::Compile("(a+)+$").value();
  const std::string text = "aa b " + std::string(40, 'a') + "b";
  const auto matches = r.FindAll(text);
  ASSERT_FALSE(matches.ok());
  EXPECT_NE(matches.status().message().find("match limit exceeded"), std::string::npos) << matches.status().ToString();
  EXPECT_NE(matches.status().message().find("of a 46-byte text"), std::string::npos) << matches.status().ToString();
}

// PCRE2's default limit (10 million steps per attempt) let this pattern, from a tokenizer file, backtrack
// through every split of the run of a's at each start and report no match after seconds; ours stops it.
TEST(Regex, BacktrackingIsLimitedToAMillionStepsPerAttempt) {
  const Regex r = Regex::Compile("(a+)+$").value();
  const auto matches = r.FindAll(std::string(21, 'a') + "b");
  ASSERT_FALSE(matches.ok());
  EXPECT_NE(matches.status().message().find("match limit exceeded"), std::string::npos)
      << matches.status().ToString();
}

TEST(Regex, FindsSuccessiveMatchesAndStepsOverEmptyOnes) {
  const auto digits = Regex::Compile(R"(\d+)").value().FindAll("a12 b3 ٤٥");  // Arabic-Indic digits are \d too
  ASSERT_TRUE(digits.ok());
  ASSERT_EQ(digits->size(), 3u);
  EXPECT_EQ((*digits)[0], std::make_pair(std::size_t{1}, std::size_t{3}));
  const auto empty = Regex::Compile("x*").value().FindAll("ab");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  EXPECT_FALSE(Regex::Compile("(unclosed").ok());
}

}  // namespace
}  // namespace namm
