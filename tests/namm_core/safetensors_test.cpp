#include "namm/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>

#include "namm/file_util.h"
#include "test_util.h"

namespace namm {
namespace {

// Writes a raw safetensors file from a header text and data bytes.
std::string WriteRaw(const std::string& name, const std::string& header, const std::string& data,
                     int64_t declared_length = -1) {
  const std::string path = testing::TempPath(name);
  uint64_t len = declared_length >= 0 ? static_cast<uint64_t>(declared_length) : header.size();
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>((len >> (8 * i)) & 0xff);
  EXPECT_TRUE(write_file_atomically(path, {bytes, header, data}).ok());
  return path;
}

void ExpectCorrupt(const std::string& path, const std::string& fragment) {
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok()) << path;
  EXPECT_EQ(file.status().code(), Status::Code::kCorruption) << file.status().ToString();
  EXPECT_NE(file.status().message().find(fragment), std::string::npos) << file.status().message();
  EXPECT_NE(file.status().message().find(path), std::string::npos) << "the message names the file";
}

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
  const std::string path = testing::TempPath("round.safetensors");
  const float a[3] = {1.5f, -2.0f, 3.25f};
  const int64_t b[2] = {7, -9};
  const double empty = 0;
  ASSERT_TRUE(write_safetensors(path, {{"a", DType::kF32, {3}, a}, {"b", DType::kI64, {2, 1}, b},
                                       {"e", DType::kF64, {0}, &empty}},
                                {{"k", "v"}, {"x", "{\"json\": true}"}})
                  .ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->metadata().at("x"), "{\"json\": true}");
  const SafetensorInfo* info = file->find("b");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->dtype, DType::kI64);
  EXPECT_EQ(info->shape, (std::vector<int64_t>{2, 1}));
  int64_t back[2];
  std::memcpy(back, file->data(*info), 16);
  EXPECT_EQ(back[1], -9);
  float fa[3];
  std::memcpy(fa, file->data(*file->find("a")), 12);
  EXPECT_EQ(fa[2], 3.25f);
  EXPECT_EQ(file->find("e")->bytes, 0u);
  EXPECT_EQ(file->find("nope"), nullptr);
}

// A metadata value that is not UTF-8 (export's database path, from a file system in another encoding) is
// written with U+FFFD for its bad bytes (the write failed with the JSON library's exception before).
TEST(Safetensors, MetadataThatIsNotUtf8IsWrittenWithReplacementCharacters) {
  const std::string path = testing::TempPath("latin1.safetensors");
  const float a = 1;
  ASSERT_TRUE(write_safetensors(path, {{"a", DType::kF32, {1}, &a}}, {{"database", "r\xff.db"}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->metadata().at("database"), "r\xef\xbf\xbd.db");
}

TEST(Safetensors, HeaderIsPaddedToEightBytes) {
  const std::string path = testing::TempPath("pad.safetensors");
  const float a = 1;
  ASSERT_TRUE(write_safetensors(path, {{"abc", DType::kF32, {1}, &a}}, {}).ok());
  auto bytes = read_file(path);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ((bytes->size() - 4) % 8, 0u);
}

TEST(Safetensors, RejectsCorruptFiles) {
  const std::string data8(8, '\x01');
  {
    const std::string path = testing::TempPath("tiny.safetensors");
    ASSERT_TRUE(write_file_atomically(path, {"abc"}).ok());
    ExpectCorrupt(path, "shorter than the 8-byte header length");
  }
  ExpectCorrupt(WriteRaw("long", "{}", "", 1000), "truncated: header length 1000");
  ExpectCorrupt(WriteRaw("huge", "{}", "", int64_t{1} << 40), "exceeds");
  ExpectCorrupt(WriteRaw("json", "{\"a\": ", data8), "not valid JSON");
  ExpectCorrupt(WriteRaw("array", "[1, 2]", ""), "not a JSON object");
  ExpectCorrupt(WriteRaw("dtype", R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", data8),
                "unknown dtype 'F33'");
  ExpectCorrupt(WriteRaw("shape", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
                "non-integer or negative");
  ExpectCorrupt(WriteRaw("size", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8), "needs 12");
  ExpectCorrupt(WriteRaw("reversed", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", data8),
                "reversed");
  ExpectCorrupt(WriteRaw("beyond", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234"),
                "truncated: tensor 'a' ends at data byte 8");
  ExpectCorrupt(WriteRaw("overlap",
                         R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                         data8 + "1234"),
                "overlap");
  ExpectCorrupt(WriteRaw("gap",
                         R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                         data8 + "1234"),
                "gap of 4 unused bytes before tensor 'b'");
  ExpectCorrupt(WriteRaw("trailing", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data8),
                "4 trailing bytes");
  ExpectCorrupt(WriteRaw("overflow", R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", ""),
                "too large");
  ExpectCorrupt(WriteRaw("meta", R"({"__metadata__":{"k":1}})", ""), "metadata value for 'k' is not a string");
  ExpectCorrupt(WriteRaw("offsets", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "1234"),
                "data_offsets");
}

// A header nesting more than 64 levels is refused before a tree is built: an error message dumped this shape
// recursively, once per level (100000 of them overflowed the stack).
TEST(Safetensors, RefusesDeeplyNestedHeaders) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  ExpectCorrupt(WriteRaw("deep", R"({"a":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,8]}})",
                         std::string(8, '\x01')),
                "header: JSON nests arrays and objects more than 64 levels deep");
}

TEST(Safetensors, MissingFileIsNotFound) {
  auto file = SafetensorsFile::Open(testing::TempPath("does-not-exist.safetensors"));
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), Status::Code::kNotFound);
}

TEST(Safetensors, WriterRefusesDuplicateAndReservedNames) {
  const float a = 1;
  EXPECT_FALSE(write_safetensors(testing::TempPath("dup"), {{"a", DType::kF32, {1}, &a}, {"a", DType::kF32, {1}, &a}},
                                 {})
                   .ok());
  EXPECT_FALSE(write_safetensors(testing::TempPath("res"), {{"__metadata__", DType::kF32, {1}, &a}}, {}).ok());
}

}  // namespace
}  // namespace namm
