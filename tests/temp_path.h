// Per-process scratch paths for tests (torch-free).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace namm::testing {

// One directory per test process ($TEST_TMPDIR or gtest's TempDir(), then namm-test-<pid>), removed with all it
// holds when the process exits normally: the suite runs twice in CI (plain and sanitized) and used to leave ~550 MB
// of databases, checkpoints and reports behind each time. A failed or crashed test's files stay for a look. A forked
// child (a death test) leaves it to the process that made it.
class ScratchDirectory {
 public:
  static const std::string& Path() {
    static const ScratchDirectory directory;
    return directory.path_;
  }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;
  ~ScratchDirectory() {
    std::error_code ignored;
    // gtest's UnitTest is never destroyed, so it can still be asked here.
    if (::getpid() == owner_ && !::testing::UnitTest::GetInstance()->Failed()) {
      std::filesystem::remove_all(path_, ignored);
    }
  }

 private:
  ScratchDirectory() : owner_(::getpid()) {
    const char* dir = std::getenv("TEST_TMPDIR");
    path_ = dir ? dir : ::testing::TempDir();
    if (!path_.empty() && path_.back() != '/') path_ += '/';
    path_ += "namm-test-" + std::to_string(owner_);
    std::error_code error;
    std::filesystem::create_directories(path_, error);
    if (error) {
      std::fprintf(stderr, "cannot make the tests' scratch directory %s: %s\n", path_.c_str(), error.message().c_str());
      std::abort();
    }
  }

  pid_t owner_;
  std::string path_;
};

inline std::string TempPath(const std::string& name) { return ScratchDirectory::Path() + "/" + name; }

// TempPath(name) with no leftover database there (nor its WAL and shared-memory files).
inline std::string FreshDatabasePath(const std::string& name) {
  const std::string path = TempPath(name);
  for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path + suffix).c_str());
  return path;
}

}  // namespace namm::testing
