#include "namm/npy.h"

#include <ATen/ops/empty.h>

#include <cctype>
#include <cstring>
#include <optional>
#include <vector>

#include "namm/dtype.h"
#include "namm/file_util.h"

namespace namm {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicLen = 6;

struct NpyType {
  const char* descr;  // without the byte-order character
  at::ScalarType scalar_type;
};
constexpr NpyType kTypes[] = {
    {"f8", at::kDouble}, {"f4", at::kFloat}, {"f2", at::kHalf},  {"i8", at::kLong}, {"i4", at::kInt},
    {"i2", at::kShort},  {"i1", at::kChar},  {"u1", at::kByte}, {"b1", at::kBool},
};

std::optional<at::ScalarType> ScalarTypeFromDescr(const std::string& code) {
  for (const auto& t : kTypes) {
    if (code == t.descr) return t.scalar_type;
  }
  return std::nullopt;
}

std::optional<std::string> DescrFromScalarType(at::ScalarType type) {
  for (const auto& t : kTypes) {
    if (t.scalar_type == type) {
      std::string code = t.descr;
      char order = (code == "i1" || code == "u1" || code == "b1") ? '|' : '<';
      return std::string(1, order) + code;
    }
  }
  return std::nullopt;
}

// A minimal parser for the Python dict literal in an .npy header, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class HeaderParser {
 public:
  explicit HeaderParser(const std::string& text) : text_(text) {}

  Status Parse(std::string* descr, bool* fortran_order, std::vector<int64_t>* shape) {
    bool have_descr = false, have_order = false, have_shape = false;
    Skip();
    if (!Eat('{')) return Error("expected '{'");
    while (true) {
      Skip();
      if (Eat('}')) break;
      std::string key;
      if (!String(&key)) return Error("expected a quoted key");
      Skip();
      if (!Eat(':')) return Error("expected ':' after key '" + key + "'");
      Skip();
      if (key == "descr") {
        if (!String(descr)) return Error("'descr' must be a string");
        have_descr = true;
      } else if (key == "fortran_order") {
        if (Word("True")) {
          *fortran_order = true;
        } else if (Word("False")) {
          *fortran_order = false;
        } else {
          return Error("'fortran_order' must be True or False");
        }
        have_order = true;
      } else if (key == "shape") {
        if (!Tuple(shape)) return Error("'shape' must be a tuple of non-negative integers");
        have_shape = true;
      } else {
        return Error("unexpected key '" + key + "'");
      }
      Skip();
      if (Eat(',')) continue;
      Skip();
      if (Eat('}')) break;
      return Error("expected ',' or '}'");
    }
    if (!have_descr || !have_order || !have_shape) return Error("missing 'descr', 'fortran_order' or 'shape'");
    return Status::Ok();
  }

 private:
  Status Error(const std::string& what) const {
    return Status::Corruption("malformed .npy header at character " + std::to_string(pos_) + ": " + what);
  }
  void Skip() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool Eat(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool Word(const char* word) {
    std::size_t n = std::strlen(word);
    if (text_.compare(pos_, n, word) == 0) {
      pos_ += n;
      return true;
    }
    return false;
  }
  bool String(std::string* out) {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) return false;
    char quote = text_[pos_++];
    auto end = text_.find(quote, pos_);
    if (end == std::string::npos) return false;
    *out = text_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return true;
  }
  bool Tuple(std::vector<int64_t>* out) {
    if (!Eat('(')) return false;
    while (true) {
      Skip();
      if (Eat(')')) return true;
      if (pos_ >= text_.size() || !std::isdigit(static_cast<unsigned char>(text_[pos_]))) return false;
      int64_t value = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        if (value > (INT64_MAX - 9) / 10) return false;
        value = value * 10 + (text_[pos_++] - '0');
      }
      while (pos_ < text_.size() && (text_[pos_] == 'L')) ++pos_;  // Python 2 longs
      out->push_back(value);
      Skip();
      if (Eat(',')) continue;
      Skip();
      if (Eat(')')) return true;
      return false;
    }
  }

  const std::string& text_;
  std::size_t pos_ = 0;
};

}  // namespace

Result<at::Tensor> read_npy(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(std::string bytes, read_file(path));
  auto corrupt = [&](const std::string& what) { return Status::Corruption(path + ": " + what); };
  if (bytes.size() < kMagicLen + 4 || bytes.compare(0, kMagicLen, kMagic, kMagicLen) != 0) {
    return corrupt("not an .npy file (missing the \\x93NUMPY magic)");
  }
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.data());
  const int major = u[6];
  std::size_t header_len = 0, header_start = 0;
  if (major == 1) {
    header_len = u[8] | (static_cast<std::size_t>(u[9]) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return corrupt("truncated header");
    header_len = u[8] | (static_cast<std::size_t>(u[9]) << 8) | (static_cast<std::size_t>(u[10]) << 16) |
                 (static_cast<std::size_t>(u[11]) << 24);
    header_start = 12;
  } else {
    return corrupt("unsupported .npy format version " + std::to_string(major));
  }
  if (header_start + header_len > bytes.size()) return corrupt("truncated header");
  std::string header = bytes.substr(header_start, header_len);

  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
  Status parsed = HeaderParser(header).Parse(&descr, &fortran_order, &shape);
  if (!parsed.ok()) return parsed.WithContext(path);
  if (fortran_order) return Status::InvalidArgument(path + ": Fortran-ordered arrays are not supported; save in C order");
  if (descr.size() < 2) return corrupt("unsupported dtype '" + descr + "'");
  if (descr[0] == '>') return Status::InvalidArgument(path + ": big-endian dtype '" + descr + "' is not supported");
  if (descr[0] != '<' && descr[0] != '|' && descr[0] != '=') {
    return Status::InvalidArgument(path + ": unsupported dtype '" + descr + "'");
  }
  auto scalar_type = ScalarTypeFromDescr(descr.substr(1));
  if (!scalar_type) {
    return Status::InvalidArgument(path + ": unsupported dtype '" + descr +
                                   "' (supported: f8 f4 f2 i8 i4 i2 i1 u1 b1)");
  }
  auto nbytes = shape_nbytes(shape, at::elementSize(*scalar_type));
  if (!nbytes) return corrupt("shape " + shape_to_string(shape) + " is too large");
  const std::size_t data_start = header_start + header_len;
  const auto expected = static_cast<std::size_t>(*nbytes);
  if (bytes.size() - data_start < expected) {
    return corrupt("truncated: shape " + shape_to_string(shape) + " needs " + std::to_string(expected) +
                   " data bytes, file has " + std::to_string(bytes.size() - data_start));
  }
  if (bytes.size() - data_start > expected) {
    return corrupt(std::to_string(bytes.size() - data_start - expected) + " unexpected bytes after the array data");
  }
  if (*scalar_type == at::kBool) {
    for (std::size_t i = 0; i < expected; ++i) {
      if (static_cast<unsigned char>(bytes[data_start + i]) > 1) return corrupt("bool element " + std::to_string(i) + " is not 0 or 1");
    }
  }
  at::Tensor tensor = at::empty(shape, at::TensorOptions().dtype(*scalar_type).device(at::kCPU));
  if (expected > 0) std::memcpy(tensor.data_ptr(), bytes.data() + data_start, expected);
  return tensor;
}

Status write_npy(const std::string& path, const at::Tensor& tensor) {
  auto descr = DescrFromScalarType(tensor.scalar_type());
  if (!descr) {
    return Status::InvalidArgument(std::string("cannot write dtype ") + at::toString(tensor.scalar_type()) +
                                   " to .npy");
  }
  at::Tensor cpu = tensor.to(at::kCPU).contiguous();
  std::string shape = "(";
  for (int64_t i = 0; i < cpu.dim(); ++i) shape += (i ? ", " : "") + std::to_string(cpu.size(i));
  shape += cpu.dim() == 1 ? ",)" : ")";  // Python spells a 1-tuple "(n,)"
  std::string header = "{'descr': '" + *descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  // Pad so that magic + version + length + header is a multiple of 64 bytes, ending in '\n'.
  std::size_t prefix = kMagicLen + 2 + 2;
  bool v2 = false;
  std::size_t total = prefix + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  if (header.size() > 65535) {
    v2 = true;
    prefix = kMagicLen + 2 + 4;
    header.erase(header.find_last_not_of(" \n") + 1);
    total = prefix + header.size() + 1;
    header.append((64 - total % 64) % 64, ' ');
    header += '\n';
  }
  std::string preamble(kMagic, kMagicLen);
  preamble += static_cast<char>(v2 ? 2 : 1);
  preamble += '\0';
  std::size_t len = header.size();
  for (int i = 0; i < (v2 ? 4 : 2); ++i) preamble += static_cast<char>((len >> (8 * i)) & 0xff);
  std::string_view data(static_cast<const char*>(cpu.data_ptr()), cpu.numel() * cpu.element_size());
  return write_file_atomically(path, {preamble, header, data});
}

}  // namespace namm
