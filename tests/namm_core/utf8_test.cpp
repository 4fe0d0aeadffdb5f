// The one UTF-8 decoder (namm/utf8.h): well-formed sequences only, and prefixes that are valid UTF-8 for
// protobuf and JSON whatever bytes they are cut from (the worker's error reports).
#include "namm/utf8.h"

#include <gtest/gtest.h>

#include <string>

namespace namm {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

bool ValidUtf8(const std::string& s) {
  for (std::size_t i = 0; i < s.size();) {
    const int n = utf8_sequence_length(s, i);
    if (n <= 0) return false;
    i += static_cast<std::size_t>(n);
  }
  return true;
}

TEST(Utf8, OverlongSurrogateAndOutOfRangeSequencesAreNotCharacters) {
  EXPECT_EQ(utf8_sequence_length("\xC0\xAF", 0), -1);          // overlong '/'
  EXPECT_EQ(utf8_sequence_length("\xE0\x80\xAF", 0), -1);      // overlong, 3 bytes
  EXPECT_EQ(utf8_sequence_length("\xED\xA0\x80", 0), -1);      // a surrogate
  EXPECT_EQ(utf8_sequence_length("\xF4\x90\x80\x80", 0), -1);  // past U+10FFFF
  EXPECT_EQ(utf8_sequence_length("\xE2\x82", 0), -2);          // truncated
  EXPECT_EQ(utf8_sequence_length("\xF0\x9F\x98\x80", 0), 4);
  EXPECT_EQ(utf8_decode("\xF0\x9F\x98\x80"), 0x1F600u);
  EXPECT_EQ(utf8_encode(0x1F600), "\xF0\x9F\x98\x80");
}

TEST(Utf8, PrefixesAreValidAndNeverSplitACharacter) {
  const std::string hostile = "ok \xC0\xAF \xED\xA0\x80 \xE2\x82\xAC \xF0\x9F\x98\x80 \xFF";
  EXPECT_EQ(sanitize_utf8(hostile),
            "ok " + kFffd + kFffd + " " + kFffd + kFffd + kFffd + " \xE2\x82\xAC \xF0\x9F\x98\x80 " + kFffd);
  for (std::size_t max = 0; max <= hostile.size() + 20; ++max) {
    const std::string prefix = utf8_prefix(hostile, max);
    EXPECT_LE(prefix.size(), max);
    EXPECT_TRUE(ValidUtf8(prefix)) << max;
    EXPECT_EQ(sanitize_utf8(hostile).compare(0, prefix.size(), prefix), 0) << max;
  }
}

}  // namespace
}  // namespace namm
