#include "namm/namm_file.h"

#include <cstring>

#include "namm/safetensors.h"

namespace namm {

namespace {

constexpr const char* kFormatKey = "namm.format";
constexpr const char* kArchitectureKey = "namm.architecture";
constexpr const char* kNormStateKey = "namm.norm_state";

// Copies a tensor's bytes out after checking its dtype and shape.
template <typename T>
Status ReadTensor(const SafetensorsFile& file, const std::string& name, DType dtype,
                  const std::vector<int64_t>& shape, T* out) {
  const SafetensorInfo* info = file.find(name);
  if (info == nullptr) return Status::Corruption(file.path() + ": missing tensor '" + name + "'");
  if (info->dtype != dtype || info->shape != shape) {
    return Status::Corruption(file.path() + ": tensor '" + name + "' is " + safetensors_dtype_name(info->dtype) +
                              " " + shape_to_string(info->shape) + ", expected " + safetensors_dtype_name(dtype) +
                              " " + shape_to_string(shape));
  }
  std::memcpy(out, file.data(*info), info->bytes);
  return Status::Ok();
}

}  // namespace

Status write_namm_file(const std::string& path, const NammModel& model) {
  Status valid = model.Validate();
  if (!valid.ok()) return valid.WithContext("refusing to write " + path);
  std::map<std::string, std::string> metadata = model.metadata;
  metadata[kFormatKey] = std::to_string(kNammFileFormat);
  metadata[kArchitectureKey] = model.architecture.ToJson();
  metadata[kNormStateKey] = norm_state_name(model.norm_state);
  const int64_t count = model.norm_stats.count;
  const int64_t n = static_cast<int64_t>(model.params.size());
  return write_safetensors(path,
                           {{"params", DType::kF32, {n}, model.params.data()},
                            {"norm.mean", DType::kF64, {kStftBins}, model.norm_stats.mean.data()},
                            {"norm.var", DType::kF64, {kStftBins}, model.norm_stats.var.data()},
                            {"norm.count", DType::kI64, {1}, &count}},
                           metadata);
}

Result<NammModel> read_namm_file(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
  auto corrupt = [&](const std::string& what) { return Status::Corruption(path + ": " + what); };
  NammModel model;
  model.metadata = file.metadata();
  auto take = [&](const char* key) -> Result<std::string> {
    auto it = model.metadata.find(key);
    if (it == model.metadata.end()) {
      return corrupt(std::string("not a NAMM file: metadata key '") + key + "' is missing");
    }
    std::string value = it->second;
    model.metadata.erase(it);
    return value;
  };
  NAMM_ASSIGN_OR_RETURN(std::string format, take(kFormatKey));
  if (format != std::to_string(kNammFileFormat)) {
    return corrupt("NAMM file format '" + format + "' is not supported by this build (supports " +
                   std::to_string(kNammFileFormat) + "; a newer namm wrote it?)");
  }
  NAMM_ASSIGN_OR_RETURN(std::string arch_json, take(kArchitectureKey));
  auto arch = NammArchitecture::FromJson(arch_json);
  if (!arch.ok()) return arch.status().WithContext(path);
  model.architecture = *arch;
  NAMM_ASSIGN_OR_RETURN(std::string state, take(kNormStateKey));
  if (state == "collecting") {
    model.norm_state = NormState::kCollecting;
  } else if (state == "frozen") {
    model.norm_state = NormState::kFrozen;
  } else {
    return corrupt("unknown normalization state '" + state + "' (known: collecting, frozen)");
  }

  const int64_t n = model.architecture.param_count();
  model.params.resize(static_cast<std::size_t>(n));
  NAMM_RETURN_IF_ERROR(ReadTensor(file, "params", DType::kF32, {n}, model.params.data()));
  NAMM_RETURN_IF_ERROR(ReadTensor(file, "norm.mean", DType::kF64, {kStftBins}, model.norm_stats.mean.data()));
  NAMM_RETURN_IF_ERROR(ReadTensor(file, "norm.var", DType::kF64, {kStftBins}, model.norm_stats.var.data()));
  NAMM_RETURN_IF_ERROR(ReadTensor(file, "norm.count", DType::kI64, {1}, &model.norm_stats.count));
  if (file.tensors().size() != 4) return corrupt("unexpected tensors besides params and norm.*");
  Status valid = model.Validate();
  if (!valid.ok()) return Status::Corruption(path + ": " + valid.message());
  return model;
}

}  // namespace namm
