#include "namm/json_util.h"

#include <gtest/gtest.h>

#include <string>

namespace namm {
namespace {

std::string Nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// Nesting is refused before a tree is built (copying, comparing or dumping one recurses per level), naming
// the source and the limit; brackets inside strings do not count.
TEST(JsonUtil, ParseRefusesNestingBeyondTheLimit) {
  EXPECT_TRUE(parse_json_bounded(Nested(64), "f.json").ok());
  EXPECT_TRUE(parse_json_bounded(R"({"a": ")" + std::string(1000, '[') + R"(\"["})", "f.json").ok());
  for (const std::string& deep : {Nested(65), R"({"a": [{"b": )" + Nested(63) + "}]}", Nested(1000000)}) {
    const auto parsed = parse_json_bounded(deep, "f.json");
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), Status::Code::kCorruption);
    EXPECT_EQ(parsed.status().message(), "f.json: JSON nests arrays and objects more than 64 levels deep");
  }
  EXPECT_FALSE(parse_json_bounded(Nested(3), "f.json", 2).ok());
  const auto invalid = parse_json_bounded("{\"a\": ", "f.json");
  ASSERT_FALSE(invalid.ok());
  EXPECT_EQ(invalid.status().message().rfind("f.json: not valid JSON: ", 0), 0u)
      << invalid.status().message();
}

// Error messages describe outside values in a bounded number of characters, not by dumping them.
TEST(JsonUtil, SummaryIsBounded) {
  EXPECT_EQ(json_summary(nlohmann::json::parse("[1, [2, 3]]")), "an array of 2 items");
  EXPECT_EQ(json_summary(nlohmann::json::parse(R"({"b": [1], "a": 2})")),
            "an object with keys a, b (2 keys)");
  EXPECT_EQ(json_summary(nlohmann::json::object()), "an empty object");
  EXPECT_EQ(json_summary(nlohmann::json(1.5)), "1.5");
  EXPECT_EQ(json_summary(nlohmann::json("ab")), "\"ab\"");
  EXPECT_EQ(json_summary(nlohmann::json(std::string(1000, 'x')), 5), "\"xxxxx\"...");
  nlohmann::json wide = nlohmann::json::object();
  for (int k = 0; k < 10000; ++k) wide["key" + std::to_string(k)] = k;
  EXPECT_LT(json_summary(wide).size(), 300u);
}

}  // namespace
}  // namespace namm
