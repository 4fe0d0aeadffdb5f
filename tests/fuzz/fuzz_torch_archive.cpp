// Fuzz target: torch.save archives (the reference's ckpt.pt), as `namm-coordinator import-checkpoint` reads them:
// the zip directory, the pickle and the tensors' views into their storages.
#include <cstddef>
#include <cstdint>
#include <string>

#include "namm/torch_archive.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const auto value = namm::parse_torch_archive(std::string(reinterpret_cast<const char*>(data), size), "fuzz.pt");
  if (value.ok()) (void)value->Find("evolution_state");
  return 0;
}
