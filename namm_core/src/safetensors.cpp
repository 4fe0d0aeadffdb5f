#include "namm/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "namm/file_util.h"
#include "namm/json_util.h"

namespace namm {

namespace {

// Same limit as the reference implementation: a larger header is almost certainly not a safetensors file.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string Le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

Status ParseTensorEntry(const std::string& name, const nlohmann::json& entry, SafetensorInfo* info) {
  auto bad = [&](const std::string& what) { return Status::Corruption("tensor '" + name + "': " + what); };
  if (!entry.is_object()) return bad("header entry is not an object");
  info->name = name;
  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) return bad("missing string field 'dtype'");
  auto dtype = dtype_from_safetensors_name(dtype_it->get<std::string>());
  if (!dtype) return bad("unknown dtype '" + dtype_it->get<std::string>() + "'");
  info->dtype = *dtype;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) return bad("missing array field 'shape'");
  for (const auto& d : *shape_it) {
    if (!d.is_number_unsigned()) return bad("shape has a non-integer or negative entry: " + json_summary(d));
    info->shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  auto nbytes = shape_nbytes(info->shape, dtype_size(info->dtype));
  if (!nbytes) return bad("shape " + shape_to_string(info->shape) + " is too large");

  auto off_it = entry.find("data_offsets");
  if (off_it == entry.end() || !off_it->is_array() || off_it->size() != 2 || !(*off_it)[0].is_number_unsigned() ||
      !(*off_it)[1].is_number_unsigned()) {
    return bad("'data_offsets' must be [begin, end] with non-negative integers");
  }
  uint64_t begin = (*off_it)[0].get<uint64_t>();
  uint64_t end = (*off_it)[1].get<uint64_t>();
  if (end < begin) return bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") are reversed");
  const auto expected = static_cast<uint64_t>(*nbytes);
  if (end - begin != expected) {
    return bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") hold " +
               std::to_string(end - begin) + " bytes but " + safetensors_dtype_name(info->dtype) + " " +
               shape_to_string(info->shape) + " needs " + std::to_string(expected));
  }
  info->offset = begin;
  info->bytes = end - begin;
  return Status::Ok();
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  auto corrupt = [&](const std::string& what) { return Status::Corruption(path + ": " + what); };

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no such file");
    return Status::IOError(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Status::IOError(path + ": cannot stat: " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + ": not a regular file");
  }
  const auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    return corrupt("truncated: " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  }
  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (mapping == MAP_FAILED) return Status::IOError(path + ": mmap failed: " + std::strerror(errno));
  file.mapping_ = mapping;
  file.mapping_size_ = file_size;
  const auto* bytes = static_cast<const uint8_t*>(mapping);

  const uint64_t header_len = ReadLe64(bytes);
  if (header_len > kMaxHeaderBytes) {
    return corrupt("header length " + std::to_string(header_len) + " exceeds the " +
                   std::to_string(kMaxHeaderBytes) + "-byte limit (not a safetensors file?)");
  }
  if (header_len > file_size - 8) {
    return corrupt("truncated: header length " + std::to_string(header_len) + " but only " +
                   std::to_string(file_size - 8) + " bytes follow");
  }
  const uint64_t data_size = file_size - 8 - header_len;
  file.data_section_ = bytes + 8 + header_len;

  NAMM_ASSIGN_OR_RETURN(
      const nlohmann::json header,
      parse_json_bounded(std::string_view(reinterpret_cast<const char*>(bytes + 8), header_len),
                         path + ": header"));
  if (!header.is_object()) return corrupt("header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == kMetadataKey) {
      if (!it->is_object()) return corrupt("'__metadata__' is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return corrupt("metadata value for '" + m.key() + "' is not a string");
        file.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorInfo info;
    Status s = ParseTensorEntry(it.key(), *it, &info);
    if (!s.ok()) return s.WithContext(path);
    file.tensors_.push_back(std::move(info));
  }

  // The data section must be covered exactly: sorted by offset, each tensor starts where the previous ended.
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const SafetensorInfo& a, const SafetensorInfo& b) {
              return a.offset != b.offset ? a.offset < b.offset : a.bytes < b.bytes;
            });
  uint64_t cursor = 0;
  const SafetensorInfo* previous = nullptr;
  for (const auto& info : file.tensors_) {
    if (info.offset < cursor) {
      return corrupt("tensors '" + previous->name + "' and '" + info.name + "' overlap in the data section");
    }
    if (info.offset > cursor) {
      return corrupt("gap of " + std::to_string(info.offset - cursor) + " unused bytes before tensor '" +
                     info.name + "'");
    }
    if (info.offset + info.bytes > data_size) {
      return corrupt("truncated: tensor '" + info.name + "' ends at data byte " +
                     std::to_string(info.offset + info.bytes) + " but the data section has " +
                     std::to_string(data_size) + " bytes");
    }
    cursor = info.offset + info.bytes;
    previous = &info;
  }
  if (cursor != data_size) {
    return corrupt(std::to_string(data_size - cursor) + " trailing bytes after the last tensor");
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Release();
    path_ = std::move(other.path_);
    mapping_ = other.mapping_;
    mapping_size_ = other.mapping_size_;
    data_section_ = other.data_section_;
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
    other.mapping_ = nullptr;
    other.mapping_size_ = 0;
    other.data_section_ = nullptr;
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Release(); }

void SafetensorsFile::Release() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
  mapping_ = nullptr;
  mapping_size_ = 0;
}

const SafetensorInfo* SafetensorsFile::find(const std::string& name) const {
  for (const auto& info : tensors_) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

Status write_safetensors(const std::string& path, const std::vector<SafetensorWrite>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::set<std::string> names;
  std::vector<std::string_view> pieces;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name == kMetadataKey) return Status::InvalidArgument("tensor name '__metadata__' is reserved");
    if (!names.insert(t.name).second) return Status::InvalidArgument("duplicate tensor name '" + t.name + "'");
    auto nbytes = shape_nbytes(t.shape, dtype_size(t.dtype));
    if (!nbytes) return Status::InvalidArgument("tensor '" + t.name + "': invalid shape " + shape_to_string(t.shape));
    const auto bytes = static_cast<uint64_t>(*nbytes);
    if (bytes > 0 && t.data == nullptr) return Status::InvalidArgument("tensor '" + t.name + "': no data");
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  // JSON is UTF-8: a metadata value that is not (a database path in another encoding) gets U+FFFD for its bad
  // bytes rather than failing the write with the JSON library's exception.
  std::string header_text = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  std::string length = Le64(header_text.size());
  pieces.push_back(length);
  pieces.push_back(header_text);
  for (const auto& t : tensors) {
    pieces.emplace_back(static_cast<const char*>(t.data), *shape_nbytes(t.shape, dtype_size(t.dtype)));
  }
  return write_file_atomically(path, pieces);
}

}  // namespace namm
