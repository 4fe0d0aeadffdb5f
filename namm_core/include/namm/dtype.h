// Element types of the array files namm reads and writes (.npy, .safetensors), independent of libtorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace namm {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// Size of one element in bytes.
std::size_t dtype_size(DType dtype);
// The safetensors spelling ("F32", "BF16", "I64", ...).
const char* safetensors_dtype_name(DType dtype);
std::optional<DType> dtype_from_safetensors_name(const std::string& name);

// Number of elements of a shape; nullopt if a dimension is negative or the product overflows int64.
std::optional<int64_t> shape_numel(const std::vector<int64_t>& shape);
// Bytes of a shape's elements; nullopt if a dimension is negative or the size overflows int64.
std::optional<int64_t> shape_nbytes(const std::vector<int64_t>& shape, std::size_t element_size);
// "[2, 3, 4]"
std::string shape_to_string(const std::vector<int64_t>& shape);

}  // namespace namm
