// Fuzz target: llama2.c tokenizer.bin files (namm-worker --tokenizer FILE.bin). The input becomes an in-memory
// file; a tokenizer that loads must encode and decode, whatever its pieces and scores (NaN, duplicates, empty).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "namm/worker/llama2c_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const int fd = ::memfd_create("tokenizer_bin", MFD_CLOEXEC);
  if (fd < 0) return 0;
  for (std::size_t at = 0; at < size;) {
    const ssize_t n = ::write(fd, data + at, size - at);
    if (n <= 0) break;
    at += static_cast<std::size_t>(n);
  }
  const auto tokenizer = namm::worker::Llama2cTokenizer::Load("/proc/self/fd/" + std::to_string(fd));
  ::close(fd);
  if (!tokenizer.ok()) return 0;
  const auto ids = (*tokenizer)->EncodeForModel("Once upon a time, wörld 123 \xe4\xbd\xa0\xe5\xa5\xbd \xff!");
  if (ids.ok()) (void)(*tokenizer)->Decode(*ids, /*skip_special_tokens=*/false);
  std::vector<int64_t> every;
  for (int64_t id = -1; id <= (*tokenizer)->vocab_size(); ++id) every.push_back(id);
  (void)(*tokenizer)->Decode(every, /*skip_special_tokens=*/false);
  return 0;
}
