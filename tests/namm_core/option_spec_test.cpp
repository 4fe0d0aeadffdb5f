#include "namm/option_spec.h"

#include <gtest/gtest.h>

namespace namm {
namespace {

TEST(OptionSpec, ParsesNameAndOptions) {
  auto spec = parse_option_spec("h2o:budget=512,recent=128");
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->name, "h2o");
  EXPECT_EQ(*spec->GetInt("budget", 0), 512);
  EXPECT_EQ(*spec->GetInt("absent", 7), 7);
  EXPECT_TRUE(spec->CheckKeys({"budget", "recent"}).ok());
  EXPECT_FALSE(spec->CheckKeys({"budget"}).ok());
  auto plain = parse_option_spec("full");
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->options.empty());
  auto ntk = parse_option_spec("ntk:factor=4,alpha=2.5");
  EXPECT_DOUBLE_EQ(*ntk->GetDouble("alpha", 0), 2.5);
}

TEST(OptionSpec, RejectsMalformedSpecs) {
  for (const char* bad : {"", ":a=1", "x:", "x:a", "x:=1", "x:a=", "x:a=1,a=2", "x:a=1,"}) {
    EXPECT_FALSE(parse_option_spec(bad).ok()) << bad;
  }
  auto spec = parse_option_spec("topk:budget=lots");
  ASSERT_TRUE(spec.ok());
  auto value = spec->GetInt("budget", 0);
  ASSERT_FALSE(value.ok());
  EXPECT_NE(value.status().message().find("'lots'"), std::string::npos);
}

}  // namespace
}  // namespace namm
