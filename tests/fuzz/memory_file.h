// The fuzz input as a file that readers taking a path can open: an in-memory file (memfd), closed at scope end.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace namm::fuzz {

class MemoryFile {
 public:
  MemoryFile(const char* name, const uint8_t* data, std::size_t size) : fd_(::memfd_create(name, MFD_CLOEXEC)) {
    for (std::size_t at = 0; fd_ >= 0 && at < size;) {
      const ssize_t n = ::write(fd_, data + at, size - at);
      if (n <= 0) break;
      at += static_cast<std::size_t>(n);
    }
  }
  ~MemoryFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;

  bool ok() const { return fd_ >= 0; }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

}  // namespace namm::fuzz
