// Builds the memory policy of a generation from the command line: a NAMM file, or a baseline spec
// "full" | "h2o:budget=N[,recent=R]" (R defaults to N/2) | "l2:budget=N".
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "namm/memory_policy.h"
#include "namm/status.h"

namespace namm::worker {

Result<std::unique_ptr<MemoryPolicy>> make_baseline_policy(const std::string& spec);

// A NammPolicy from a NAMM file, its parameters placed on `device`.
Result<std::unique_ptr<MemoryPolicy>> make_namm_policy(const std::string& path, at::Device device);

}  // namespace namm::worker
