#include "namm/status.h"

#include <gtest/gtest.h>

#include <string>

namespace namm {
namespace {

TEST(Status, ContextAndNoteKeepTheCode) {
  const Status s = Status::NotFound("no such file").WithContext("loading x").WithNote("give --model");
  EXPECT_EQ(s.code(), Status::Code::kNotFound);
  EXPECT_EQ(s.message(), "loading x: no such file; give --model");
  EXPECT_TRUE(Status::Ok().WithNote("ignored").ok());
}

TEST(Result, HoldsAValueOrAnError) {
  Result<std::string> good = std::string("v");
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, "v");
  EXPECT_EQ(good->size(), 1u);
  const Result<int> bad = Status::Corruption("torn");
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Status::Code::kCorruption);
  const Result<int> no_value = Status::Ok();  // a bug of its maker: an error, not an empty value
  EXPECT_EQ(no_value.status().code(), Status::Code::kInternal);
}

// Taking the value of an error was undefined behaviour (an empty std::optional dereferenced): it aborts now, with
// the error printed.
TEST(ResultDeathTest, TheValueOfAnErrorAbortsNamingTheError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const Result<int> bad = Status::NotFound("table 'x'");
  EXPECT_DEATH((void)bad.value(), "the value of an error was taken .*not found: table 'x'");
  EXPECT_DEATH((void)*bad, "not found: table 'x'");
  Result<std::string> moved = Status::IOError("disk");
  EXPECT_DEATH((void)std::move(moved).value(), "I/O error: disk");
  EXPECT_DEATH((void)moved->size(), "I/O error: disk");
}

}  // namespace
}  // namespace namm
