// Fuzz target: NAMM files (.safetensors with the architecture in the header), as namm-worker --namm reads them.
// The input becomes an in-memory file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "namm/namm_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const int fd = ::memfd_create("namm_file", MFD_CLOEXEC);
  if (fd < 0) return 0;
  for (std::size_t at = 0; at < size;) {
    const ssize_t n = ::write(fd, data + at, size - at);
    if (n <= 0) break;
    at += static_cast<std::size_t>(n);
  }
  const auto model = namm::read_namm_file("/proc/self/fd/" + std::to_string(fd));
  if (model.ok()) (void)model->architecture.param_count();
  ::close(fd);
  return 0;
}
