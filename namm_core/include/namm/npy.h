// NumPy .npy files <-> CPU tensors (format versions 1.0, 2.0 and 3.0; C order; little-endian).
// Supported element types: float64, float32, float16, int64, int32, int16, int8, uint8, bool.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "namm/status.h"

namespace namm {

// Reads an .npy file into a contiguous CPU tensor of the stored dtype. Fortran-ordered, big-endian, object and
// truncated files are refused with a message naming the file and the problem.
Result<at::Tensor> read_npy(const std::string& path);

// Writes a tensor (any device; copied to CPU and made contiguous) as an .npy file, atomically.
Status write_npy(const std::string& path, const at::Tensor& tensor);

}  // namespace namm
