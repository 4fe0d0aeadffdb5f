#include "namm/torch_archive.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string_view>

#include "namm/file_util.h"

namespace namm {

// ---- values ----

int64_t TorchTensor::numel() const { return shape_numel(shape).value_or(0); }

namespace {

// IEEE half precision: 1 sign, 5 exponent (bias 15), 10 fraction bits.
double F16ToDouble(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, fraction = h & 0x3ff;
  const double sign = (h & 0x8000) != 0 ? -1.0 : 1.0;
  if (exponent == 0x1f) return fraction != 0 ? std::numeric_limits<double>::quiet_NaN() : sign * HUGE_VAL;
  if (exponent == 0) return sign * std::ldexp(fraction, -24);  // subnormal
  return sign * std::ldexp(fraction + 1024, exponent - 25);
}

// bfloat16: the top half of a float32.
double Bf16ToDouble(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

std::vector<double> TorchTensor::ToDoubles() const {
  const auto n = static_cast<std::size_t>(numel());
  std::vector<double> out(n);
  const auto read = [&](auto zero) {
    using T = decltype(zero);
    for (std::size_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, bytes().data() + i * sizeof(T), sizeof(T));
      out[i] = static_cast<double>(v);
    }
  };
  switch (dtype) {
    case DType::kF64: read(double{}); break;
    case DType::kF32: read(float{}); break;
    case DType::kI64: read(int64_t{}); break;
    case DType::kI32: read(int32_t{}); break;
    case DType::kI16: read(int16_t{}); break;
    case DType::kI8: read(int8_t{}); break;
    case DType::kU8: case DType::kBool: read(uint8_t{}); break;
    case DType::kF16: case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes().data() + i * 2, 2);
        out[i] = dtype == DType::kBF16 ? Bf16ToDouble(h) : F16ToDouble(h);
      }
      break;
  }
  return out;
}

TorchTensor TorchTensor::FromFloats(const std::vector<double>& values, std::vector<int64_t> shape) {
  std::string bytes(values.size() * sizeof(float), '\0');
  for (std::size_t i = 0; i < values.size(); ++i) {
    const auto f = static_cast<float>(values[i]);
    std::memcpy(bytes.data() + i * sizeof(float), &f, sizeof(float));
  }
  return TorchTensor(DType::kF32, std::move(shape), std::move(bytes));
}

TorchValue TorchValue::Int(int64_t v) {
  TorchValue x;
  x.kind = Kind::kInt;
  x.integer = v;
  return x;
}
TorchValue TorchValue::Float(double v) {
  TorchValue x;
  x.kind = Kind::kFloat;
  x.real = v;
  return x;
}
TorchValue TorchValue::String(std::string v) {
  TorchValue x;
  x.kind = Kind::kString;
  x.text = std::move(v);
  return x;
}
TorchValue TorchValue::Tensor(TorchTensor t) {
  TorchValue x;
  x.kind = Kind::kTensor;
  x.tensor = std::move(t);
  return x;
}
TorchValue TorchValue::Dict() {
  TorchValue x;
  x.kind = Kind::kDict;
  return x;
}

TorchValue& TorchValue::Set(const std::string& key, TorchValue value) {
  dict.emplace_back(String(key), std::move(value));
  return *this;
}

const TorchValue* TorchValue::Find(const std::string& key) const {
  if (kind != Kind::kDict) return nullptr;
  // The last of a key set twice, as Python's unpickler keeps it (torch.save never does; a hand-made pickle may).
  for (auto it = dict.rbegin(); it != dict.rend(); ++it) {
    if (it->first.kind == Kind::kString && it->first.text == key) return &it->second;
  }
  return nullptr;
}

const char* TorchValue::kind_name() const {
  switch (kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kTensor: return "tensor";
  }
  return "?";
}

namespace {

// torch's storage classes and the dtypes they hold.
constexpr std::pair<const char*, DType> kStorages[] = {
    {"FloatStorage", DType::kF32},  {"DoubleStorage", DType::kF64}, {"HalfStorage", DType::kF16},
    {"BFloat16Storage", DType::kBF16}, {"LongStorage", DType::kI64},  {"IntStorage", DType::kI32},
    {"ShortStorage", DType::kI16},  {"CharStorage", DType::kI8},    {"ByteStorage", DType::kU8},
    {"BoolStorage", DType::kBool},  {"UntypedStorage", DType::kU8}};

// ---- zip (stored entries only, as torch.save writes them) ----

uint32_t Read32(std::string_view b, std::size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[at + static_cast<std::size_t>(i)]);
  return v;
}
uint16_t Read16(std::string_view b, std::size_t at) {
  return static_cast<uint16_t>(static_cast<uint8_t>(b[at]) | (static_cast<uint8_t>(b[at + 1]) << 8));
}
void Put16(std::string& out, uint32_t v) {
  out.push_back(static_cast<char>(v & 0xff));
  out.push_back(static_cast<char>((v >> 8) & 0xff));
}
void Put32(std::string& out, uint32_t v) {
  Put16(out, v & 0xffff);
  Put16(out, v >> 16);
}

uint32_t Crc32(std::string_view data) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (std::size_t at = 0; at < data.size();) {
    const auto piece = static_cast<uInt>(std::min<std::size_t>(data.size() - at, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data.data() + at), piece);
    at += piece;
  }
  return static_cast<uint32_t>(crc);
}

// The entries of a zip archive by name: views into its bytes, checked against their CRCs when read.
class ZipReader {
 public:
  static Result<ZipReader> Open(std::string_view bytes, const std::string& path) {
    ZipReader zip(bytes, path);
    NAMM_RETURN_IF_ERROR(zip.ReadDirectory());
    return zip;
  }
  const std::string& first_name() const { return first_name_; }
  Result<std::string_view> Get(const std::string& name) const {
    const auto it = entries_.find(name);
    if (it == entries_.end()) return Corruption("has no entry '" + name + "'");
    const std::string_view data = bytes_.substr(it->second.offset, it->second.size);
    if (Crc32(data) != it->second.crc) return Corruption("entry '" + name + "' fails its CRC check");
    return data;
  }

 private:
  struct Entry {
    std::size_t offset = 0, size = 0;
    uint32_t crc = 0;
  };
  ZipReader(std::string_view bytes, const std::string& path) : bytes_(bytes), path_(path) {}
  Status Corruption(const std::string& what) const {
    return Status::Corruption(path_ + " is not a torch.save archive namm can read: it " + what);
  }
  Status ReadDirectory() {
    // The end-of-central-directory record: 22 bytes, then a comment of up to 65535.
    if (bytes_.size() < 22 || bytes_.substr(0, 4) != std::string_view("PK\x03\x04", 4)) {
      return Corruption("does not start as a zip archive does (torch.save's format since torch 1.6)");
    }
    std::size_t eocd = std::string_view::npos;
    for (std::size_t at = bytes_.size() - 22;; --at) {
      if (Read32(bytes_, at) == 0x06054b50) {
        eocd = at;
        break;
      }
      if (at == 0 || bytes_.size() - at > 22 + 65535) break;
    }
    if (eocd == std::string_view::npos) return Corruption("has no end of central directory");
    const uint16_t count = Read16(bytes_, eocd + 10);
    const uint32_t directory_size = Read32(bytes_, eocd + 12), directory_offset = Read32(bytes_, eocd + 16);
    if (count == 0xffff || directory_offset == 0xffffffffu) return Corruption("is a zip64 archive (over 4 GiB)");
    if (static_cast<uint64_t>(directory_offset) + directory_size > eocd) return Corruption("has a truncated directory");
    std::size_t at = directory_offset;
    for (uint16_t i = 0; i < count; ++i) {
      if (at + 46 > eocd || Read32(bytes_, at) != 0x02014b50) return Corruption("has a malformed directory entry");
      const uint16_t method = Read16(bytes_, at + 10);
      const uint32_t crc = Read32(bytes_, at + 16), compressed = Read32(bytes_, at + 20), size = Read32(bytes_, at + 24);
      const uint16_t name_length = Read16(bytes_, at + 28), extra = Read16(bytes_, at + 30),
                     comment = Read16(bytes_, at + 32);
      const uint32_t local = Read32(bytes_, at + 42);
      if (at + 46 + name_length > eocd) return Corruption("has a malformed directory entry");
      const std::string name(bytes_.substr(at + 46, name_length));
      if (method != 0 || compressed != size) {
        return Corruption("holds a compressed entry '" + name + "' (torch.save stores; was the file re-zipped?)");
      }
      if (compressed == 0xffffffffu || local == 0xffffffffu) return Corruption("is a zip64 archive (over 4 GiB)");
      if (static_cast<uint64_t>(local) + 30 > bytes_.size() || Read32(bytes_, local) != 0x04034b50) {
        return Corruption("has a malformed local header for '" + name + "'");
      }
      const std::size_t data = local + 30 + Read16(bytes_, local + 26) + Read16(bytes_, local + 28);
      if (data + size > bytes_.size()) return Corruption("has a truncated entry '" + name + "'");
      if (i == 0) first_name_ = name;
      entries_[name] = Entry{data, size, crc};
      at += 46 + name_length + extra + comment;
    }
    if (count == 0) return Corruption("is an empty zip archive");
    return Status::Ok();
  }

  std::string_view bytes_;
  std::string path_;
  std::string first_name_;
  std::map<std::string, Entry> entries_;
};

// Appends stored entries, each one's data aligned to 64 bytes (as torch's writer does, so that storages can be
// mapped), then the directory.
class ZipWriter {
 public:
  void Add(const std::string& name, std::string_view data) {
    const std::size_t local = out_.size();
    const uint32_t crc = Crc32(data);
    // Padding in an extra field ("FB", torch's id) so that the data starts at a multiple of 64.
    const std::size_t header_end = local + 30 + name.size() + 4;
    const std::size_t padding = (64 - header_end % 64) % 64;
    LocalHeader(crc, static_cast<uint32_t>(data.size()), name, static_cast<uint16_t>(4 + padding));
    Put16(out_, 0x4246);
    Put16(out_, static_cast<uint32_t>(padding));
    out_.append(padding, 'Z');
    out_.append(data);
    directory_.push_back({name, crc, static_cast<uint32_t>(data.size()), static_cast<uint32_t>(local)});
  }
  Result<std::string> Finish() {
    if (out_.size() > std::numeric_limits<uint32_t>::max() || directory_.size() >= 0xffff) {
      return Status::InvalidArgument("a torch archive over 4 GiB needs zip64, which namm does not write");
    }
    const auto directory_offset = static_cast<uint32_t>(out_.size());
    for (const auto& e : directory_) {
      Put32(out_, 0x02014b50);
      Put16(out_, 20);  // made by
      Put16(out_, 20);  // needed
      Put16(out_, 0);   // flags
      Put16(out_, 0);   // stored
      Put16(out_, 0);   // time
      Put16(out_, 0x21);  // 1980-01-01
      Put32(out_, e.crc);
      Put32(out_, e.size);
      Put32(out_, e.size);
      Put16(out_, static_cast<uint32_t>(e.name.size()));
      Put16(out_, 0);  // extra
      Put16(out_, 0);  // comment
      Put16(out_, 0);  // disk
      Put16(out_, 0);  // internal attributes
      Put32(out_, 0);  // external attributes
      Put32(out_, e.local);
      out_.append(e.name);
    }
    const auto directory_size = static_cast<uint32_t>(out_.size() - directory_offset);
    Put32(out_, 0x06054b50);
    Put16(out_, 0);
    Put16(out_, 0);
    Put16(out_, static_cast<uint32_t>(directory_.size()));
    Put16(out_, static_cast<uint32_t>(directory_.size()));
    Put32(out_, directory_size);
    Put32(out_, directory_offset);
    Put16(out_, 0);
    return std::move(out_);
  }

 private:
  struct Entry {
    std::string name;
    uint32_t crc, size, local;
  };
  void LocalHeader(uint32_t crc, uint32_t size, const std::string& name, uint16_t extra) {
    Put32(out_, 0x04034b50);
    Put16(out_, 20);
    Put16(out_, 0);
    Put16(out_, 0);
    Put16(out_, 0);
    Put16(out_, 0x21);
    Put32(out_, crc);
    Put32(out_, size);
    Put32(out_, size);
    Put16(out_, static_cast<uint32_t>(name.size()));
    Put16(out_, extra);
    out_.append(name);
  }
  std::string out_;
  std::vector<Entry> directory_;
};

// ---- pickle ----

// What the unpickler's stack holds: a value, or one of the objects that only exist while unpickling.
struct Item {
  enum class Kind { kValue, kMark, kGlobal, kStorage };
  Kind kind = Kind::kValue;
  TorchValue value;
  // What the value costs: its values (nodes) and the bytes of its strings and tensors, all levels down, and how
  // deeply its containers nest. Copying it (APPEND of a memoized list, say) costs all of it again.
  int64_t nodes = 1, bytes = 0, depth = 1;
  std::string global;  // "module.name"
  DType storage_dtype = DType::kU8;
  std::string storage_key;
  int64_t storage_numel = 0;
};
using ItemRef = std::shared_ptr<Item>;

// The unpickler's limits, proportional to the archive (a pickle's values cost what the file is worth: a memo
// that appends a list to itself 40 times in 286 bytes would otherwise hold 2^40 values): the values and the bytes
// of strings and tensors it may make, copies included, and how deep containers may nest (the values are copied
// and freed recursively; checkpoints nest a few levels).
struct UnpickleLimits {
  int64_t nodes = 0, bytes = 0, depth = 0;
  static UnpickleLimits For(std::size_t archive_bytes) {
    const auto size = static_cast<int64_t>(archive_bytes);
    // Within ~4x the file in memory: the file itself, tensors and strings of twice its bytes (two different views
    // of one storage are two tensors), and values of sizeof(TorchValue) for twice the file's size.
    return {std::max<int64_t>(int64_t{1} << 16, 2 * size / static_cast<int64_t>(sizeof(TorchValue))),
            2 * size + (int64_t{1} << 20), 256};
  }
};

class Unpickler {
 public:
  Unpickler(std::string_view pickle, const ZipReader& zip, std::string prefix, const std::string& path,
            UnpickleLimits limits)
      : in_(pickle), zip_(zip), prefix_(std::move(prefix)), path_(path), limits_(limits) {}

  Result<TorchValue> Run() {
    while (true) {
      if (at_ >= in_.size()) return Bad("ends without STOP");
      const auto op = static_cast<uint8_t>(in_[at_++]);
      if (op == '.') {
        if (stack_.size() != 1 || stack_.back()->kind != Item::Kind::kValue) return Bad("stops with a malformed stack");
        TorchValue result = std::move(stack_.back()->value);  // unpickling ends: no copy
        // Freed level by level (a deep value's destructor would recurse), before the result is returned.
        memo_.clear();
        tuple_items_.clear();
        stack_.clear();
        return result;
      }
      NAMM_RETURN_IF_ERROR(Step(op));
    }
  }

 private:
  Status Bad(const std::string& what) const {
    return Status::Corruption(path_ + ": the checkpoint's pickle " + what + " (at byte " + std::to_string(at_) + ")");
  }
  Result<std::string_view> Take(std::size_t n) {
    if (n > in_.size() - at_) return Bad("is truncated");
    const std::string_view piece = in_.substr(at_, n);
    at_ += n;
    return piece;
  }
  Result<uint64_t> TakeUnsigned(int bytes) {
    NAMM_ASSIGN_OR_RETURN(std::string_view b, Take(static_cast<std::size_t>(bytes)));
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[static_cast<std::size_t>(i)]);
    return v;
  }
  Result<std::string> TakeLine() {
    const std::size_t end = in_.find('\n', at_);
    if (end == std::string_view::npos) return Bad("has an unterminated name");
    std::string line(in_.substr(at_, end - at_));
    at_ = end + 1;
    return line;
  }
  Status PushValue(TorchValue v, bool charge_tensor = true) {
    auto item = std::make_shared<Item>();
    // A tensor's bytes are new here (unless shared with an identical view); its copies later share them (only
    // strings are copied).
    if (charge_tensor) NAMM_RETURN_IF_ERROR(Charge(0, static_cast<int64_t>(v.tensor.bytes().size())));
    item->bytes = static_cast<int64_t>(v.text.size());
    NAMM_RETURN_IF_ERROR(Charge(1, item->bytes));
    item->value = std::move(v);
    stack_.push_back(std::move(item));
    return Status::Ok();
  }
  Result<ItemRef> Pop() {
    if (stack_.empty() || stack_.back()->kind == Item::Kind::kMark) return Bad("pops an empty stack");
    ItemRef top = std::move(stack_.back());
    stack_.pop_back();
    return top;
  }
  // The items above the topmost mark, which is removed.
  Result<std::vector<ItemRef>> PopToMark() {
    std::vector<ItemRef> items;
    while (!stack_.empty() && stack_.back()->kind != Item::Kind::kMark) {
      items.push_back(std::move(stack_.back()));
      stack_.pop_back();
    }
    if (stack_.empty()) return Bad("has no mark");
    stack_.pop_back();
    std::reverse(items.begin(), items.end());
    return items;
  }
  Result<Item*> Top(TorchValue::Kind kind, const char* op) {
    if (stack_.empty() || stack_.back()->kind != Item::Kind::kValue || stack_.back()->value.kind != kind) {
      return Bad(std::string(op) + " without its container");
    }
    return stack_.back().get();
  }
  Status AddToDict(Item& dict, std::vector<ItemRef>& items) {
    if (items.size() % 2 != 0) return Bad("sets a key without a value");
    for (std::size_t i = 0; i < items.size(); i += 2) {
      NAMM_ASSIGN_OR_RETURN(TorchValue key, Materialize(*items[i], &dict));
      NAMM_ASSIGN_OR_RETURN(TorchValue value, Materialize(*items[i + 1], &dict));
      dict.value.dict.emplace_back(std::move(key), std::move(value));
    }
    return Status::Ok();
  }
  // A copy of `item`'s value for a container, charged against the limits; `container` takes its cost.
  Result<TorchValue> Materialize(const Item& item, Item* container) {
    if (item.kind != Item::Kind::kValue) {
      return Bad(item.kind == Item::Kind::kGlobal ? "holds the class " + item.global + " as a value"
                                                  : std::string("holds a storage outside a tensor"));
    }
    NAMM_RETURN_IF_ERROR(Charge(item.nodes, item.bytes));
    if (container != nullptr) {
      container->nodes += item.nodes;
      container->bytes += item.bytes;
      container->depth = std::max(container->depth, item.depth + 1);
      if (container->depth > limits_.depth) {
        return Bad("nests containers deeper than " + std::to_string(limits_.depth) + " levels");
      }
    }
    return item.value;
  }
  // Values and bytes about to be made.
  Status Charge(int64_t nodes, int64_t bytes) {
    made_nodes_ += nodes;
    made_bytes_ += bytes;
    if (made_nodes_ > limits_.nodes) {
      return Bad("makes more than " + std::to_string(limits_.nodes) + " values (its limit for an archive of this size)");
    }
    if (made_bytes_ > limits_.bytes) {
      return Bad("makes more than " + std::to_string(limits_.bytes) +
                 " bytes of strings and tensors (its limit for an archive of this size)");
    }
    return Status::Ok();
  }
  Result<int64_t> IntOf(const Item& item, const char* what) const {
    if (item.kind != Item::Kind::kValue || item.value.kind != TorchValue::Kind::kInt) {
      return Bad(std::string("gives a tensor a non-integer ") + what);
    }
    return item.value.integer;
  }

  Status Step(uint8_t op) {
    switch (op) {
      case 0x80: return TakeUnsigned(1).status();  // PROTO
      case 0x95: return TakeUnsigned(8).status();  // FRAME
      case '(': {
        auto mark = std::make_shared<Item>();
        mark->kind = Item::Kind::kMark;
        stack_.push_back(std::move(mark));
        return Status::Ok();
      }
      case 'N': return PushValue(TorchValue());
      case 0x88: case 0x89: {
        TorchValue v;
        v.kind = TorchValue::Kind::kBool;
        v.boolean = op == 0x88;
        return PushValue(std::move(v));
      }
      case 'J': {
        NAMM_ASSIGN_OR_RETURN(uint64_t v, TakeUnsigned(4));
        return PushValue(TorchValue::Int(static_cast<int32_t>(static_cast<uint32_t>(v))));
      }
      case 'K': case 'M': {
        NAMM_ASSIGN_OR_RETURN(uint64_t v, TakeUnsigned(op == 'K' ? 1 : 2));
        return PushValue(TorchValue::Int(static_cast<int64_t>(v)));
      }
      case 0x8a: {  // LONG1: little-endian two's complement
        NAMM_ASSIGN_OR_RETURN(uint64_t n, TakeUnsigned(1));
        if (n > 8) return Bad("holds an integer wider than 64 bits");
        NAMM_ASSIGN_OR_RETURN(uint64_t v, TakeUnsigned(static_cast<int>(n)));
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
        return PushValue(TorchValue::Int(static_cast<int64_t>(v)));
      }
      case 'G': {  // big-endian double
        NAMM_ASSIGN_OR_RETURN(std::string_view b, Take(8));
        uint64_t bits = 0;
        for (char c : b) bits = (bits << 8) | static_cast<uint8_t>(c);
        double v;
        std::memcpy(&v, &bits, sizeof v);
        return PushValue(TorchValue::Float(v));
      }
      case 'X': case 0x8c: case 0x8d: case 'B': case 'C': {  // strings (bytes read as strings)
        const int width = op == 0x8c || op == 'C' ? 1 : op == 0x8d ? 8 : 4;
        NAMM_ASSIGN_OR_RETURN(uint64_t n, TakeUnsigned(width));
        NAMM_ASSIGN_OR_RETURN(std::string_view s, Take(n));
        return PushValue(TorchValue::String(std::string(s)));
      }
      case '}': return PushValue(TorchValue::Dict());
      case ']': {
        TorchValue v;
        v.kind = TorchValue::Kind::kList;
        return PushValue(std::move(v));
      }
      case ')': {
        auto tuple = std::make_shared<Item>();
        tuple->value.kind = TorchValue::Kind::kTuple;
        tuple_items_[tuple.get()] = {};
        stack_.push_back(std::move(tuple));
        return Status::Ok();
      }
      case 't': case 'l': case 0x85: case 0x86: case 0x87: {  // TUPLE, LIST, TUPLE1..3
        std::vector<ItemRef> items;
        if (op == 't' || op == 'l') {
          NAMM_ASSIGN_OR_RETURN(items, PopToMark());
        } else {
          for (int i = 0; i < op - 0x84; ++i) {
            NAMM_ASSIGN_OR_RETURN(ItemRef item, Pop());
            items.insert(items.begin(), std::move(item));
          }
        }
        // A tuple of a storage reference (BINPERSID's argument) may hold a class: kept as items.
        auto tuple = std::make_shared<Item>();
        tuple->value.kind = op == 'l' ? TorchValue::Kind::kList : TorchValue::Kind::kTuple;
        NAMM_RETURN_IF_ERROR(Charge(1, 0));
        for (const ItemRef& item : items) {
          if (item->kind != Item::Kind::kValue) continue;
          NAMM_ASSIGN_OR_RETURN(TorchValue v, Materialize(*item, tuple.get()));
          tuple->value.items.push_back(std::move(v));
        }
        tuple_items_[tuple.get()] = std::move(items);
        stack_.push_back(std::move(tuple));
        return Status::Ok();
      }
      case 'd': {
        NAMM_ASSIGN_OR_RETURN(std::vector<ItemRef> items, PopToMark());
        NAMM_RETURN_IF_ERROR(PushValue(TorchValue::Dict()));
        return AddToDict(*stack_.back(), items);
      }
      case 'a': {
        NAMM_ASSIGN_OR_RETURN(ItemRef item, Pop());
        NAMM_ASSIGN_OR_RETURN(Item * list, Top(TorchValue::Kind::kList, "APPEND"));
        NAMM_ASSIGN_OR_RETURN(TorchValue v, Materialize(*item, list));
        list->value.items.push_back(std::move(v));
        return Status::Ok();
      }
      case 'e': {
        NAMM_ASSIGN_OR_RETURN(std::vector<ItemRef> items, PopToMark());
        NAMM_ASSIGN_OR_RETURN(Item * list, Top(TorchValue::Kind::kList, "APPENDS"));
        for (const ItemRef& item : items) {
          NAMM_ASSIGN_OR_RETURN(TorchValue v, Materialize(*item, list));
          list->value.items.push_back(std::move(v));
        }
        return Status::Ok();
      }
      case 's': {
        NAMM_ASSIGN_OR_RETURN(ItemRef value, Pop());
        NAMM_ASSIGN_OR_RETURN(ItemRef key, Pop());
        NAMM_ASSIGN_OR_RETURN(Item * dict, Top(TorchValue::Kind::kDict, "SETITEM"));
        std::vector<ItemRef> items{key, value};
        return AddToDict(*dict, items);
      }
      case 'u': {
        NAMM_ASSIGN_OR_RETURN(std::vector<ItemRef> items, PopToMark());
        NAMM_ASSIGN_OR_RETURN(Item * dict, Top(TorchValue::Kind::kDict, "SETITEMS"));
        return AddToDict(*dict, items);
      }
      case 'q': case 'r': case 0x94: {  // BINPUT, LONG_BINPUT, MEMOIZE
        if (stack_.empty()) return Bad("memoizes an empty stack");
        uint64_t index = memo_.size();
        if (op != 0x94) {
          NAMM_ASSIGN_OR_RETURN(index, TakeUnsigned(op == 'q' ? 1 : 4));
        }
        memo_[index] = stack_.back();
        return Status::Ok();
      }
      case 'h': case 'j': {  // BINGET, LONG_BINGET
        NAMM_ASSIGN_OR_RETURN(uint64_t index, TakeUnsigned(op == 'h' ? 1 : 4));
        const auto it = memo_.find(index);
        if (it == memo_.end()) return Bad("refers to memo " + std::to_string(index) + ", never stored");
        stack_.push_back(it->second);
        return Status::Ok();
      }
      case 'c': {  // GLOBAL module\nname\n
        NAMM_ASSIGN_OR_RETURN(std::string module, TakeLine());
        NAMM_ASSIGN_OR_RETURN(std::string name, TakeLine());
        return PushGlobal(module + "." + name);
      }
      case 0x93: {  // STACK_GLOBAL
        NAMM_ASSIGN_OR_RETURN(ItemRef name, Pop());
        NAMM_ASSIGN_OR_RETURN(ItemRef module, Pop());
        if (module->value.kind != TorchValue::Kind::kString || name->value.kind != TorchValue::Kind::kString) {
          return Bad("names a class with a non-string");
        }
        return PushGlobal(module->value.text + "." + name->value.text);
      }
      case 'Q': return PersistentLoad();
      case 'R': return Reduce();
      case 'b': {  // BUILD: an object's state; a state dict's _metadata, dropped
        NAMM_ASSIGN_OR_RETURN(ItemRef state, Pop());
        if (stack_.empty()) return Bad("builds nothing");
        return Status::Ok();
      }
      default: {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", op);
        return Bad(std::string("uses opcode ") + hex + ", outside what checkpoints need");
      }
    }
  }

  Status PushGlobal(const std::string& name) {
    static const char* const kKnown[] = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
                                         "torch._utils._rebuild_parameter_with_state", "collections.OrderedDict"};
    bool known = std::any_of(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return name == k; });
    for (const auto& [storage, dtype] : kStorages) known = known || name == std::string("torch.") + storage;
    if (!known) return Bad("needs the class " + name + ", which a NAMM checkpoint never holds");
    auto item = std::make_shared<Item>();
    item->kind = Item::Kind::kGlobal;
    item->global = name;
    stack_.push_back(std::move(item));
    return Status::Ok();
  }

  // ('storage', <storage class>, key, location, numel)
  Status PersistentLoad() {
    NAMM_ASSIGN_OR_RETURN(ItemRef id, Pop());
    const auto found = tuple_items_.find(id.get());
    if (found == tuple_items_.end() || found->second.size() != 5 || found->second[0]->value.text != "storage" ||
        found->second[1]->kind != Item::Kind::kGlobal) {
      return Bad("has a persistent id that is not a storage");
    }
    const std::vector<ItemRef>& parts = found->second;
    auto storage = std::make_shared<Item>();
    storage->kind = Item::Kind::kStorage;
    for (const auto& [name, dtype] : kStorages) {
      if (parts[1]->global == std::string("torch.") + name) storage->storage_dtype = dtype;
    }
    if (parts[2]->value.kind != TorchValue::Kind::kString) return Bad("names a storage with a non-string key");
    storage->storage_key = parts[2]->value.text;
    NAMM_ASSIGN_OR_RETURN(storage->storage_numel, IntOf(*parts[4], "storage size"));
    stack_.push_back(std::move(storage));
    return Status::Ok();
  }

  Status Reduce() {
    NAMM_ASSIGN_OR_RETURN(ItemRef arguments, Pop());
    NAMM_ASSIGN_OR_RETURN(ItemRef callable, Pop());
    const auto found = tuple_items_.find(arguments.get());
    if (callable->kind != Item::Kind::kGlobal || found == tuple_items_.end()) return Bad("calls something unknown");
    const std::vector<ItemRef>& args = found->second;
    const std::string& name = callable->global;
    if (name == "collections.OrderedDict") return PushValue(TorchValue::Dict());
    if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
      if (args.empty() || args[0]->value.kind != TorchValue::Kind::kTensor) return Bad("has a parameter without data");
      stack_.push_back(args[0]);
      return Status::Ok();
    }
    if (name != "torch._utils._rebuild_tensor_v2") return Bad("calls " + name);
    return RebuildTensor(args);
  }

  // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
  Status RebuildTensor(const std::vector<ItemRef>& args) {
    if (args.size() < 4 || args[0]->kind != Item::Kind::kStorage) return Bad("rebuilds a tensor without its storage");
    const Item& storage = *args[0];
    NAMM_ASSIGN_OR_RETURN(int64_t offset, IntOf(*args[1], "storage offset"));
    std::vector<int64_t> size, stride;
    for (auto [item, out] : {std::pair{args[2].get(), &size}, std::pair{args[3].get(), &stride}}) {
      if (item->value.kind != TorchValue::Kind::kTuple) return Bad("gives a tensor a non-tuple shape");
      for (const TorchValue& v : item->value.items) {
        if (v.kind != TorchValue::Kind::kInt || v.integer < 0) return Bad("gives a tensor a bad shape or stride");
        out->push_back(v.integer);
      }
    }
    if (size.size() != stride.size()) return Bad("gives a tensor a shape and strides of different ranks");
    const std::size_t element = dtype_size(storage.storage_dtype);
    NAMM_ASSIGN_OR_RETURN(std::string_view data, zip_.Get(prefix_ + "data/" + storage.storage_key));
    if (storage.storage_numel < 0 || static_cast<uint64_t>(storage.storage_numel) != data.size() / element ||
        data.size() % element != 0) {
      return Bad("has storage " + storage.storage_key + " of " + std::to_string(data.size()) + " bytes, not " +
                 std::to_string(storage.storage_numel) + " elements");
    }
    // A checkpoint's tensors are never expanded views: no more elements than their storage holds.
    const std::optional<int64_t> numel = shape_numel(size);
    if (!numel || *numel > storage.storage_numel) return Bad("gives a tensor more elements than its storage holds");
    // The furthest element the view reaches must lie inside the storage.
    int64_t last = offset;
    for (std::size_t d = 0; d < size.size(); ++d) {
      int64_t reach = 0;
      if (size[d] > 0 && (__builtin_mul_overflow(size[d] - 1, stride[d], &reach) ||
                          __builtin_add_overflow(last, reach, &last))) {
        return Bad("gives a tensor strides past any storage");
      }
    }
    if (*numel > 0 && (offset < 0 || last >= storage.storage_numel)) return Bad("views past its storage's end");
    // The same view of the same storage again (a tensor pickled twice under two names) shares its bytes.
    std::string view_key = storage.storage_key + "/" + std::to_string(static_cast<int>(storage.storage_dtype)) + "/" +
                           std::to_string(offset);
    for (std::size_t d = 0; d < size.size(); ++d) view_key += "/" + std::to_string(size[d]) + ":" + std::to_string(stride[d]);
    if (const auto seen = views_.find(view_key); seen != views_.end()) {
      TorchTensor shared;
      shared.dtype = storage.storage_dtype;
      shared.shape = size;
      shared.data = seen->second;
      return PushValue(TorchValue::Tensor(std::move(shared)), /*charge_tensor=*/false);
    }
    std::string bytes(static_cast<std::size_t>(*numel) * element, '\0');
    std::vector<int64_t> index(size.size(), 0);
    for (int64_t i = 0; i < *numel; ++i) {
      int64_t at = offset;
      for (std::size_t d = 0; d < size.size(); ++d) at += index[d] * stride[d];
      std::memcpy(bytes.data() + static_cast<std::size_t>(i) * element,
                  data.data() + static_cast<std::size_t>(at) * element, element);
      for (std::size_t d = size.size(); d-- > 0;) {
        if (++index[d] < size[d]) break;
        index[d] = 0;
      }
    }
    TorchTensor tensor(storage.storage_dtype, size, std::move(bytes));
    views_.emplace(std::move(view_key), tensor.data);
    return PushValue(TorchValue::Tensor(std::move(tensor)));
  }

  std::string_view in_;
  std::size_t at_ = 0;
  const ZipReader& zip_;
  std::string prefix_;
  const std::string& path_;
  std::vector<ItemRef> stack_;
  std::map<uint64_t, ItemRef> memo_;
  std::map<const Item*, std::vector<ItemRef>> tuple_items_;  // every tuple's items as pushed (classes included)
  UnpickleLimits limits_;
  int64_t made_nodes_ = 0, made_bytes_ = 0;
  std::map<std::string, std::shared_ptr<const std::string>> views_;  // tensors' bytes by storage and view
};

// Pickle protocol 2, as Python's pickler writes torch.save's data.pkl (without the memo).
class Pickler {
 public:
  Result<std::string> Run(const TorchValue& value) {
    out_ = "\x80\x02";
    NAMM_RETURN_IF_ERROR(Write(value));
    out_ += '.';
    return std::move(out_);
  }
  const std::vector<std::pair<std::string, const TorchTensor*>>& storages() const { return storages_; }

 private:
  void Int(int64_t v) {
    if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
      out_ += 'J';
      Put32(out_, static_cast<uint32_t>(static_cast<int32_t>(v)));
      return;
    }
    out_ += '\x8a';
    out_ += '\x08';
    for (int i = 0; i < 8; ++i) out_ += static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
  }
  void Str(const std::string& s) {
    out_ += 'X';
    Put32(out_, static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void Tuple(const std::vector<int64_t>& values) {
    out_ += '(';
    for (int64_t v : values) Int(v);
    out_ += 't';
  }
  Status Write(const TorchValue& v) {
    switch (v.kind) {
      case TorchValue::Kind::kNone: out_ += 'N'; break;
      case TorchValue::Kind::kBool: out_ += v.boolean ? '\x88' : '\x89'; break;
      case TorchValue::Kind::kInt: Int(v.integer); break;
      case TorchValue::Kind::kFloat: {
        uint64_t bits;
        std::memcpy(&bits, &v.real, sizeof bits);
        out_ += 'G';
        for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xff);
        break;
      }
      case TorchValue::Kind::kString: Str(v.text); break;
      case TorchValue::Kind::kList: case TorchValue::Kind::kTuple:
        out_ += v.kind == TorchValue::Kind::kList ? "]" : "";
        out_ += '(';
        for (const TorchValue& item : v.items) NAMM_RETURN_IF_ERROR(Write(item));
        out_ += v.kind == TorchValue::Kind::kList ? 'e' : 't';
        break;
      case TorchValue::Kind::kDict:
        out_ += "}(";
        for (const auto& [key, value] : v.dict) {
          NAMM_RETURN_IF_ERROR(Write(key));
          NAMM_RETURN_IF_ERROR(Write(value));
        }
        out_ += 'u';
        break;
      case TorchValue::Kind::kTensor: return WriteTensor(v.tensor);
    }
    return Status::Ok();
  }
  Status WriteTensor(const TorchTensor& t) {
    const char* storage = nullptr;
    for (const auto& [name, dtype] : kStorages) {
      if (dtype == t.dtype && storage == nullptr) storage = name;
    }
    const std::optional<int64_t> numel = shape_numel(t.shape);
    if (!numel || static_cast<uint64_t>(*numel) * dtype_size(t.dtype) != t.bytes().size()) {
      return Status::InvalidArgument("a tensor of shape " + shape_to_string(t.shape) + " holds " +
                                     std::to_string(t.bytes().size()) + " bytes");
    }
    const std::string key = std::to_string(storages_.size());
    storages_.emplace_back(key, &t);
    out_ += "ctorch._utils\n_rebuild_tensor_v2\n(";
    out_ += "(";
    Str("storage");
    out_ += std::string("ctorch\n") + storage + "\n";
    Str(key);
    Str("cpu");
    Int(*numel);
    out_ += "tQ";
    Int(0);
    Tuple(t.shape);
    std::vector<int64_t> stride(t.shape.size(), 1);
    for (std::size_t d = t.shape.size(); d-- > 1;) stride[d - 1] = stride[d] * t.shape[d];
    Tuple(stride);
    out_ += '\x89';                             // requires_grad
    out_ += "ccollections\nOrderedDict\n)R";    // backward hooks
    out_ += "tR";
    return Status::Ok();
  }

  std::string out_;
  std::vector<std::pair<std::string, const TorchTensor*>> storages_;
};

}  // namespace

Result<TorchValue> parse_torch_archive(const std::string& bytes, const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(ZipReader zip, ZipReader::Open(bytes, path));
  // Every entry lies under one folder, the archive's name ("archive" from torch.save, else the file's stem).
  const std::size_t slash = zip.first_name().find('/');
  if (slash == std::string::npos) return Status::Corruption(path + ": its entries lie in no archive folder");
  const std::string prefix = zip.first_name().substr(0, slash + 1);
  // torch.load swaps bytes for a big-endian writer's archive; we read storages as little-endian only, so such an
  // archive is refused rather than read as other numbers (an archive without the entry predates it: little).
  if (const Result<std::string_view> order = zip.Get(prefix + "byteorder"); order.ok() && *order != "little") {
    return Status::InvalidArgument(path + ": its storages are in byte order '" +
                                   std::string(order->substr(0, 16)) +
                                   "' (archive/byteorder); namm reads little-endian archives only: torch.load it "
                                   "and torch.save it again on a little-endian machine");
  }
  NAMM_ASSIGN_OR_RETURN(std::string_view pickle, zip.Get(prefix + "data.pkl"));
  return Unpickler(pickle, zip, prefix, path, UnpickleLimits::For(bytes.size())).Run();
}

Result<TorchValue> read_torch_archive(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(std::string bytes, read_file(path));
  return parse_torch_archive(bytes, path);
}

Status write_torch_archive(const std::string& path, const TorchValue& value) {
  Pickler pickler;
  NAMM_ASSIGN_OR_RETURN(std::string pickle, pickler.Run(value));
  ZipWriter zip;
  zip.Add("archive/data.pkl", pickle);
  zip.Add("archive/byteorder", "little");
  for (const auto& [key, tensor] : pickler.storages()) zip.Add("archive/data/" + key, tensor->bytes());
  zip.Add("archive/version", "3\n");
  NAMM_ASSIGN_OR_RETURN(std::string bytes, zip.Finish());
  return write_file_atomically(path, {bytes});
}

}  // namespace namm
