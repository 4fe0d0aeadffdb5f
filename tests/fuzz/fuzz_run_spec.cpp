// Fuzz target: run spec YAML (namm-coordinator's --config). Any input must give a spec or a clear error.
#include <cstddef>
#include <cstdint>
#include <string>

#include "namm/coordinator/run_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string yaml(reinterpret_cast<const char*>(data), size);
  const auto spec = namm::coordinator::parse_run_spec(yaml, "fuzz");
  if (spec.ok()) (void)spec->total_generations();
  return 0;
}
