#include "namm/auth_lockout.h"

#include <gtest/gtest.h>

#include <string>

namespace namm {
namespace {

using Clock = AuthLockout::Clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

AuthLockout::Options Small() {
  AuthLockout::Options o;
  o.max_failures = 3;
  o.window = seconds(60);
  o.lockout = seconds(60);
  o.max_addresses = 4;
  o.warn_interval = seconds(1);
  return o;
}

TEST(AuthLockout, LocksAnAddressOutAfterTooManyFailuresForAWhile) {
  AuthLockout lockout(Small());
  const Clock::time_point t0;
  EXPECT_FALSE(lockout.Failed("ipv4:10.0.0.1", "wrong", t0).locked_out);
  EXPECT_FALSE(lockout.Failed("ipv4:10.0.0.1", "wrong", t0 + seconds(1)).locked_out);
  const AuthLockout::Verdict third = lockout.Failed("ipv4:10.0.0.1", "wrong", t0 + seconds(2));
  EXPECT_FALSE(third.locked_out) << "the lockout starts with the next call";
  EXPECT_NE(third.warning.find("ipv4:10.0.0.1 failed authentication 3 times"), std::string::npos) << third.warning;
  EXPECT_TRUE(lockout.Failed("ipv4:10.0.0.1", "wrong", t0 + seconds(3)).locked_out);
  EXPECT_FALSE(lockout.Failed("ipv4:10.0.0.2", "wrong", t0 + seconds(3)).locked_out) << "another address";
  EXPECT_TRUE(lockout.Failed("ipv4:10.0.0.1", "wrong", t0 + seconds(61)).locked_out);
  EXPECT_FALSE(lockout.Failed("ipv4:10.0.0.1", "wrong", t0 + seconds(63)).locked_out) << "a minute after the third";
  // Failures spread wider than the window never lock out.
  for (int i = 0; i < 10; ++i) {
    EXPECT_FALSE(lockout.Failed("ipv4:10.0.0.3", "wrong", t0 + seconds(61 * i)).locked_out) << i;
  }
}

TEST(AuthLockout, AFloodOfAddressesCannotGrowTheTable) {
  AuthLockout lockout(Small());
  const Clock::time_point t0;
  for (int i = 0; i < 1000; ++i) {
    (void)lockout.Failed("ipv4:10.1." + std::to_string(i / 256) + "." + std::to_string(i % 256), "wrong",
                         t0 + milliseconds(i));
    EXPECT_LE(lockout.addresses(), 4u);
  }
}

TEST(AuthLockout, WarningsAreRateLimitedAndCountWhatTheyLeftOut) {
  AuthLockout::Options o = Small();
  o.max_failures = 0;  // no lockout: only the warnings
  AuthLockout lockout(o);
  const Clock::time_point t0;
  EXPECT_NE(lockout.Failed("a", "wrong secret", t0).warning.find("refused a call of workers: a: wrong secret"),
            std::string::npos);
  for (int i = 1; i < 500; ++i) EXPECT_TRUE(lockout.Failed("a", "wrong secret", t0 + milliseconds(i)).warning.empty());
  const std::string next = lockout.Failed("b", "no secret", t0 + milliseconds(1000)).warning;
  EXPECT_NE(next.find("b: no secret (and 499 more authentication failures not logged)"), std::string::npos) << next;
  EXPECT_EQ(lockout.addresses(), 0u) << "nothing tracked without a lockout";
}

}  // namespace
}  // namespace namm
