// Locating ../shared (models, tokenizers, datasets) from tests; tests that need it skip with a clear message
// when it is absent (CI always has it).
#pragma once

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <string>

namespace namm::testing {

inline std::string SharedPath(const std::string& relative) { return std::string(NAMM_SHARED_DIR) + "/" + relative; }

inline bool SharedExists(const std::string& relative) {
  struct stat st {};
  return ::stat(SharedPath(relative).c_str(), &st) == 0;
}

#define NAMM_REQUIRE_SHARED(relative)                                                              \
  do {                                                                                             \
    if (!::namm::testing::SharedExists(relative)) {                                                \
      GTEST_SKIP() << "shared data " << ::namm::testing::SharedPath(relative)                      \
                   << " is absent (tests read ../shared; CI provides it)";                         \
    }                                                                                              \
  } while (0)

inline const char* kStoriesModel = "models/stories260K/stories260K.bin";
inline const char* kStoriesTokenizer = "models/stories260K/tok512.bin";
inline const char* kGpt2Tokenizer = "tokenizers/gpt2/tokenizer.json";

}  // namespace namm::testing
