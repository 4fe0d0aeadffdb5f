// NAMM files: a NammModel stored as .safetensors.
//
// Tensors: "params" F32 [N]; "norm.mean" F64 [17]; "norm.var" F64 [17]; "norm.count" I64 [1].
// Metadata: "namm.format" = "1"; "namm.architecture" = NammArchitecture::ToJson(); "namm.norm_state" =
// "collecting" | "frozen"; every other key is the model's free-form provenance metadata.
#pragma once

#include <string>

#include "namm/namm_model.h"
#include "namm/status.h"

namespace namm {

constexpr int kNammFileFormat = 1;

// Validates the model, then writes it atomically (a crash never leaves a half-written file at `path`).
Status write_namm_file(const std::string& path, const NammModel& model);

// Reads and validates a NAMM file; a corrupt or inconsistent file is refused with a message naming the problem.
Result<NammModel> read_namm_file(const std::string& path);

}  // namespace namm
