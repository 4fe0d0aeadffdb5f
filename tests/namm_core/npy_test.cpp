#include "namm/npy.h"

#include <ATen/ops/arange.h>
#include <gtest/gtest.h>

#include "namm/file_util.h"
#include "test_util.h"

namespace namm {
namespace {

TEST(Npy, RoundTripsShapesAndDtypes) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kByte}) {
    at::Tensor t = at::arange(24, at::TensorOptions().dtype(dtype)).view({2, 3, 4});
    const std::string path = testing::TempPath(std::string("rt_") + at::toString(dtype) + ".npy");
    ASSERT_TRUE(write_npy(path, t).ok());
    auto back = read_npy(path);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->scalar_type(), dtype);
    EXPECT_TRUE(back->equal(t));
  }
  // 1-D and 0-D.
  for (at::Tensor t : {at::arange(5, at::TensorOptions().dtype(at::kFloat)),
                       at::arange(1, at::TensorOptions().dtype(at::kFloat)).view({})}) {
    const std::string path = testing::TempPath("rank.npy");
    ASSERT_TRUE(write_npy(path, t).ok());
    auto back = read_npy(path);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->sizes(), t.sizes());
  }
}

TEST(Npy, HeaderIsWhatNumpyWrites) {
  const std::string path = testing::TempPath("hdr.npy");
  ASSERT_TRUE(write_npy(path, at::arange(6, at::TensorOptions().dtype(at::kFloat)).view({2, 3})).ok());
  auto bytes = read_file(path);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(bytes->substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  EXPECT_NE(bytes->find("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"), std::string::npos);
  EXPECT_EQ((bytes->size() - 24) % 64, 0u);  // data starts 64-byte aligned
}

std::string WriteNpy(const std::string& name, const std::string& header, const std::string& data) {
  std::string preamble("\x93NUMPY\x01\x00", 8);
  preamble += static_cast<char>(header.size() & 0xff);
  preamble += static_cast<char>(header.size() >> 8);
  const std::string path = testing::TempPath(name);
  EXPECT_TRUE(write_file_atomically(path, {preamble, header, data}).ok());
  return path;
}

void ExpectError(const std::string& path, const std::string& fragment) {
  auto t = read_npy(path);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find(fragment), std::string::npos) << t.status().message();
}

TEST(Npy, RejectsWhatItCannotReadCorrectly) {
  ExpectError(WriteNpy("fortran.npy", "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }\n",
                       std::string(16, '\0')),
              "Fortran-ordered");
  ExpectError(WriteNpy("big.npy", "{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }\n", std::string(4, '\0')),
              "big-endian");
  ExpectError(WriteNpy("obj.npy", "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }\n", std::string(8, '\0')),
              "unsupported dtype");
  ExpectError(WriteNpy("trunc.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }\n", std::string(8, '\0')),
              "truncated");
  ExpectError(WriteNpy("huge.npy", "{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,), }\n", ""),
              "too large");
  ExpectError(WriteNpy("bool.npy", "{'descr': '|b1', 'fortran_order': False, 'shape': (2,), }\n", std::string("\x01\x07", 2)),
              "not 0 or 1");
  ExpectError(WriteNpy("junk.npy", "{'descr': '<f4', 'shape': (1,), }\n", std::string(4, '\0')), "missing");
  const std::string path = testing::TempPath("notnpy.npy");
  ASSERT_TRUE(write_file_atomically(path, {"hello world"}).ok());
  ExpectError(path, "not an .npy file");
  ExpectError(testing::TempPath("absent.npy"), "no such file");
}

}  // namespace
}  // namespace namm
