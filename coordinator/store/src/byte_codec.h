// Little-endian binary records with a magic, a version and a trailing CRC-32 (zlib's), for the blobs the store
// keeps (optimizer state, eigensystems, normalization statistics). Private to the coordinator.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <string>
#include <string_view>
#include <vector>

#include "namm/status.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the record format is little-endian and is written with memcpy: port ByteWriter/ByteReader first"
#endif

namespace namm::coordinator {

// zlib's CRC-32 of `bytes`; pass the CRC of what came before to continue it.
uint32_t crc32_of(std::string_view bytes, uint32_t before = 0);
// The CRC-32 a record carries (of everything before it); 0 for a record too short to carry one. (The CRC of a
// whole record, CRC included, is the same constant for every record, so it is no checksum.)
uint32_t record_checksum(std::string_view record);

class ByteWriter {
 public:
  // `magic`: 8 characters naming the record kind.
  ByteWriter(const char (&magic)[9], uint32_t version);

  template <typename T>
  void Put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    bytes_.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  void PutDoubles(const double* values, std::size_t count);
  // A length-prefixed vector.
  void PutVector(const std::vector<double>& values);
  // Appends the CRC of everything written and returns the record.
  std::string Finish();

 private:
  std::string bytes_;
};

class ByteReader {
 public:
  // Checks the size, the magic, the CRC and that the version is one this build reads; `what` names the record
  // in messages ("checkpoint 12").
  static Result<ByteReader> Open(std::string_view record, const char (&magic)[9], uint32_t max_version,
                                 std::string what);

  uint32_t version() const { return version_; }
  template <typename T>
  Status Get(T* value) {
    static_assert(std::is_arithmetic_v<T>);
    NAMM_RETURN_IF_ERROR(Need(sizeof(T)));
    std::memcpy(value, body_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Status::Ok();
  }
  Status GetDoubles(double* values, std::size_t count);
  // A length-prefixed vector of at most `max_count` values.
  Status GetVector(std::vector<double>* values, std::size_t max_count);
  // Fails unless every byte was read.
  Status ExpectEnd() const;
  Status Corrupt(const std::string& why) const;

 private:
  Status Need(std::size_t bytes) const;
  std::string_view body_;
  std::size_t at_ = 0;
  uint32_t version_ = 0;
  std::string what_;
};

}  // namespace namm::coordinator
