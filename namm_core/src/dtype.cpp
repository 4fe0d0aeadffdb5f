#include "namm/dtype.h"

#include <limits>

namespace namm {

namespace {
struct DTypeInfo {
  DType dtype;
  std::size_t size;
  const char* safetensors_name;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, 8, "F64"}, {DType::kF32, 4, "F32"}, {DType::kF16, 2, "F16"}, {DType::kBF16, 2, "BF16"},
    {DType::kI64, 8, "I64"}, {DType::kI32, 4, "I32"}, {DType::kI16, 2, "I16"}, {DType::kI8, 1, "I8"},
    {DType::kU8, 1, "U8"},   {DType::kBool, 1, "BOOL"},
};
const DTypeInfo& Info(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable: every enumerator is listed
}
}  // namespace

std::size_t dtype_size(DType dtype) { return Info(dtype).size; }

const char* safetensors_dtype_name(DType dtype) { return Info(dtype).safetensors_name; }

std::optional<DType> dtype_from_safetensors_name(const std::string& name) {
  for (const auto& info : kDTypes) {
    if (name == info.safetensors_name) return info.dtype;
  }
  return std::nullopt;
}

std::optional<int64_t> shape_numel(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && numel > std::numeric_limits<int64_t>::max() / d) return std::nullopt;
    numel *= d;
  }
  return numel;
}

std::optional<int64_t> shape_nbytes(const std::vector<int64_t>& shape, std::size_t element_size) {
  auto numel = shape_numel(shape);
  const auto size = static_cast<int64_t>(element_size);
  if (!numel || (size != 0 && *numel > std::numeric_limits<int64_t>::max() / size)) return std::nullopt;
  return *numel * size;
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

}  // namespace namm
