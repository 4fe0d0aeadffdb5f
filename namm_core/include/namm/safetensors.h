// Reader and writer for the .safetensors format: an 8-byte little-endian header length N, N bytes of JSON
// header, then the raw little-endian tensor data. The header maps each tensor name to {dtype, shape,
// data_offsets: [begin, end)} (offsets relative to the start of the data section) and may hold a "__metadata__"
// object of string -> string.
//
// The reader memory-maps the file (model weights can be many GiB) and validates the whole header before
// returning: known dtypes, non-negative shapes, offsets whose length matches dtype x shape, offsets inside the
// data section, no overlaps, no gaps and no trailing bytes (the same rules as the reference implementation).
// Anything else is refused with a Corruption status naming the file and the problem.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "namm/dtype.h"
#include "namm/status.h"

namespace namm {

struct SafetensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // from the start of the data section
  uint64_t bytes = 0;
};

// An opened, validated safetensors file. Move-only; the mapping lives as long as the object.
// Safe to read from several threads at once.
class SafetensorsFile {
 public:
  static Result<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Tensors in data-offset order.
  const std::vector<SafetensorInfo>& tensors() const { return tensors_; }
  // nullptr if absent.
  const SafetensorInfo* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor's raw bytes (little-endian, possibly unaligned), valid while this object lives.
  const uint8_t* data(const SafetensorInfo& info) const { return data_section_ + info.offset; }

 private:
  SafetensorsFile() = default;
  void Release();

  std::string path_;
  void* mapping_ = nullptr;
  std::size_t mapping_size_ = 0;
  const uint8_t* data_section_ = nullptr;
  std::vector<SafetensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: `data` points at numel(shape) * dtype_size(dtype) little-endian bytes.
struct SafetensorWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes a safetensors file atomically (see write_file_atomically). Tensors are laid out in the given order;
// names must be unique and must not be "__metadata__".
Status write_safetensors(const std::string& path, const std::vector<SafetensorWrite>& tensors,
                         const std::map<std::string, std::string>& metadata);

}  // namespace namm
