#include "byte_codec.h"

#include <zlib.h>

#include <algorithm>

namespace namm::coordinator {

namespace {
constexpr std::size_t kMagicBytes = 8;
constexpr std::size_t kHeaderBytes = kMagicBytes + sizeof(uint32_t);
constexpr std::size_t kCrcBytes = sizeof(uint32_t);
}  // namespace

uint32_t crc32_of(std::string_view bytes, uint32_t before) {
  uLong crc = before;
  // zlib takes uInt lengths: feed large blobs in pieces.
  constexpr std::size_t kPiece = 1u << 30;
  for (std::size_t at = 0; at < bytes.size(); at += kPiece) {
    const std::size_t n = std::min(kPiece, bytes.size() - at);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + at), static_cast<uInt>(n));
  }
  return static_cast<uint32_t>(crc);
}

uint32_t record_checksum(std::string_view record) {
  uint32_t crc = 0;
  if (record.size() >= kCrcBytes) std::memcpy(&crc, record.data() + record.size() - kCrcBytes, kCrcBytes);
  return crc;
}

ByteWriter::ByteWriter(const char (&magic)[9], uint32_t version) {
  bytes_.append(magic, kMagicBytes);
  Put(version);
}

void ByteWriter::PutDoubles(const double* values, std::size_t count) {
  bytes_.append(reinterpret_cast<const char*>(values), count * sizeof(double));
}

void ByteWriter::PutVector(const std::vector<double>& values) {
  Put(static_cast<uint64_t>(values.size()));
  PutDoubles(values.data(), values.size());
}

std::string ByteWriter::Finish() {
  Put(crc32_of(bytes_));
  return std::move(bytes_);
}

Result<ByteReader> ByteReader::Open(std::string_view record, const char (&magic)[9], uint32_t max_version,
                                    std::string what) {
  ByteReader r;
  r.what_ = std::move(what);
  if (record.size() < kHeaderBytes + kCrcBytes) {
    return r.Corrupt("it is " + std::to_string(record.size()) + " bytes, shorter than any record");
  }
  if (record.substr(0, kMagicBytes) != std::string_view(magic, kMagicBytes)) {
    return r.Corrupt("it is not a " + std::string(magic, kMagicBytes) + " record");
  }
  uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, record.data() + record.size() - kCrcBytes, kCrcBytes);
  const std::string_view covered = record.substr(0, record.size() - kCrcBytes);
  if (crc32_of(covered) != stored_crc) return r.Corrupt("its CRC-32 does not match its contents");
  std::memcpy(&r.version_, record.data() + kMagicBytes, sizeof r.version_);
  if (r.version_ == 0 || r.version_ > max_version) {
    return r.Corrupt("record version " + std::to_string(r.version_) + " is not one this build reads (1.." +
                     std::to_string(max_version) + ")");
  }
  r.body_ = covered.substr(kHeaderBytes);
  return r;
}

Status ByteReader::GetDoubles(double* values, std::size_t count) {
  if (count > body_.size() / sizeof(double)) return Need(body_.size() + 1);
  NAMM_RETURN_IF_ERROR(Need(count * sizeof(double)));
  if (count > 0) std::memcpy(values, body_.data() + at_, count * sizeof(double));  // an empty vector's data() may be null
  at_ += count * sizeof(double);
  return Status::Ok();
}

Status ByteReader::GetVector(std::vector<double>* values, std::size_t max_count) {
  uint64_t count = 0;
  NAMM_RETURN_IF_ERROR(Get(&count));
  if (count > max_count) {
    return Corrupt("a vector of " + std::to_string(count) + " values where at most " + std::to_string(max_count) +
                   " fit");
  }
  values->resize(static_cast<std::size_t>(count));
  return GetDoubles(values->data(), values->size());
}

Status ByteReader::ExpectEnd() const {
  if (at_ != body_.size()) return Corrupt(std::to_string(body_.size() - at_) + " unexpected trailing bytes");
  return Status::Ok();
}

Status ByteReader::Need(std::size_t bytes) const {
  if (bytes > body_.size() - at_) return Corrupt("it ends early");
  return Status::Ok();
}

Status ByteReader::Corrupt(const std::string& why) const {
  return Status::Corruption(what_ + " is corrupt: " + why);
}

}  // namespace namm::coordinator
