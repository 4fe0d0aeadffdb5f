// A full disk without privileges: this process's file size limit (RLIMIT_FSIZE). Writes past `bytes` into any file
// fail with EFBIG and a write that crosses the limit stops there, as a write to a full disk does (SQLite reports
// SQLITE_FULL). SIGXFSZ, which the kernel sends with EFBIG, is ignored meanwhile. Both are restored on destruction.
#pragma once

#include <sys/resource.h>

#include <csignal>

namespace namm::testing {

class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    handler_ = std::signal(SIGXFSZ, SIG_IGN);
    Set(bytes);
  }
  ~FileSizeLimit() {
    Lift();
    std::signal(SIGXFSZ, handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

  void Set(rlim_t bytes) {
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  // Room again (the limit this process had before).
  void Lift() { ::setrlimit(RLIMIT_FSIZE, &saved_); }

 private:
  rlimit saved_{};
  void (*handler_)(int) = SIG_DFL;
};

}  // namespace namm::testing
