// Per-process scratch paths for tests (torch-free).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace namm::testing {

inline std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string base = dir ? dir : ::testing::TempDir();
  if (!base.empty() && base.back() != '/') base += '/';
  return base + std::to_string(::getpid()) + "_" + name;
}

}  // namespace namm::testing
