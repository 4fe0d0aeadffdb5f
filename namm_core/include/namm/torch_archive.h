// The files Python's torch.save writes (`ckpt.pt`), read and written without a tensor library: a zip archive
// (stored, not compressed) of `<name>/data.pkl`, a pickle whose tensors name their storages, `<name>/data/<key>`,
// one file of raw little-endian bytes per storage, and `<name>/version`.
//
// Only what checkpoints hold is understood: None, bools, ints, floats, strings, lists, tuples, dicts
// (collections.OrderedDict too, read as a dict; a state dict's `_metadata` attribute is dropped) and tensors
// (torch._utils._rebuild_tensor_v2 / _rebuild_parameter over a typed or untyped storage, any strides within the
// storage). Anything else (another class, a compressed entry, a zip64 archive) is refused with a Corruption status
// naming the file and what was found. No code is ever run: classes are matched by name, never imported. A file
// costs what it is worth: the values, string and tensor bytes an archive may make (memoized values copied
// included) and how deep its containers nest are bounded in proportion to its size, about 4x the file in
// memory at most; beyond a bound the file is refused with an error naming the limit and the pickle's offset.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "namm/dtype.h"
#include "namm/status.h"

namespace namm {

// A tensor: its elements contiguous in row-major order, little-endian.
struct TorchTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  // The elements, shared by copies: a pickle that refers to one tensor many times holds its bytes once.
  std::shared_ptr<const std::string> data = std::make_shared<const std::string>();

  TorchTensor() = default;
  TorchTensor(DType d, std::vector<int64_t> s, std::string bytes)
      : dtype(d), shape(std::move(s)), data(std::make_shared<const std::string>(std::move(bytes))) {}
  const std::string& bytes() const { return *data; }

  int64_t numel() const;
  // The elements as doubles, any dtype (half precision converted exactly).
  std::vector<double> ToDoubles() const;
  static TorchTensor FromFloats(const std::vector<double>& values, std::vector<int64_t> shape);  // float32
};

// A pickled Python value of the kinds above.
struct TorchValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kList, kTuple, kDict, kTensor };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;
  std::vector<TorchValue> items;                        // list, tuple
  std::vector<std::pair<TorchValue, TorchValue>> dict;  // in insertion order
  TorchTensor tensor;

  static TorchValue Int(int64_t v);
  static TorchValue Float(double v);
  static TorchValue String(std::string v);
  static TorchValue Tensor(TorchTensor t);
  static TorchValue Dict();
  // Appends key -> value to a dict.
  TorchValue& Set(const std::string& key, TorchValue value);
  // The value of a string key in a dict (the last, if a pickle set it twice, as Python reads it), or nullptr.
  const TorchValue* Find(const std::string& key) const;
  // "dict", "tensor", ...: for messages.
  const char* kind_name() const;
};

// Reads a torch.save file. Corruption (naming `path`) for anything outside the subset above.
Result<TorchValue> read_torch_archive(const std::string& path);
// Parses the bytes of such a file (`path` only names it in messages).
Result<TorchValue> parse_torch_archive(const std::string& bytes, const std::string& path);

// Writes `value` as torch.save (pickle protocol 2, archive name "archive") would, atomically (a temporary file
// renamed over `path`). Python's torch.load reads it back as dicts, lists, tuples and tensors.
Status write_torch_archive(const std::string& path, const TorchValue& value);

}  // namespace namm
