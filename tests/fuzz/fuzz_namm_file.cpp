// Fuzz target: NAMM files (.safetensors with the architecture in the header), as namm-worker --namm reads them.
// The input becomes an in-memory file.
#include <cstddef>
#include <cstdint>

#include "memory_file.h"
#include "namm/namm_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const namm::fuzz::MemoryFile file("namm_file", data, size);
  if (!file.ok()) return 0;
  const auto model = namm::read_namm_file(file.path());
  if (model.ok()) (void)model->architecture.param_count();
  return 0;
}
