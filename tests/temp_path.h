// Per-process scratch paths for tests (torch-free).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace namm::testing {

inline std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string base = dir ? dir : ::testing::TempDir();
  if (!base.empty() && base.back() != '/') base += '/';
  return base + std::to_string(::getpid()) + "_" + name;
}

// TempPath(name) with no leftover database there (nor its WAL and shared-memory files).
inline std::string FreshDatabasePath(const std::string& name) {
  const std::string path = TempPath(name);
  for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path + suffix).c_str());
  return path;
}

}  // namespace namm::testing
