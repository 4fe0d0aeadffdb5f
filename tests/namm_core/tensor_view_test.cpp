#include "namm/tensor_view.h"

#include <ATen/ops/arange.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace namm {
namespace {

void ExpectSameView(const at::Tensor& made, const at::Tensor& narrowed) {
  EXPECT_EQ(made.sizes(), narrowed.sizes());
  EXPECT_EQ(made.strides(), narrowed.strides());
  EXPECT_EQ(made.storage_offset(), narrowed.storage_offset());
  EXPECT_EQ(made.data_ptr(), narrowed.data_ptr());
  EXPECT_EQ(made.is_contiguous(), narrowed.is_contiguous());
  EXPECT_EQ(made.dtype(), narrowed.dtype());
  EXPECT_TRUE(made.equal(narrowed));
}

TEST(NarrowView, IsTheNarrowOfAnInferenceTensorAndWritesThroughToIt) {
  const c10::InferenceMode inference;
  const at::Tensor t = at::arange(2 * 5 * 4, at::TensorOptions().dtype(at::kFloat)).view({2, 5, 4});
  // Of the tensor, of a transposed view of it (the engine's head-major views), every dimension.
  for (const at::Tensor& base : {t, t.transpose(0, 1)}) {
    for (int64_t dim = 0; dim < base.dim(); ++dim) {
      for (int64_t start = 0; start < base.size(dim); ++start) {
        for (int64_t length = 0; start + length <= base.size(dim); ++length) {
          const at::Tensor made = narrow_view(base, dim, start, length);
          ExpectSameView(made, base.narrow(dim, start, length));
          EXPECT_TRUE(made.is_inference());
        }
      }
    }
  }
  narrow_view(t, 1, 2, 2).fill_(-1.0f);
  EXPECT_EQ(t.eq(-1.0f).sum().item<int64_t>(), 2 * 2 * 4);
  EXPECT_EQ(t[1][3][0].item<float>(), -1.0f);
  EXPECT_EQ(t[1][4][0].item<float>(), 1 * 20 + 4 * 4);
  // A view of the view, and a view that outlives the tensor it was made from (it shares the storage).
  at::Tensor inner;
  {
    const at::Tensor outer = narrow_view(t, 2, 1, 3);
    inner = narrow_view(outer, 0, 1, 1);
    ExpectSameView(inner, t.narrow(2, 1, 3).narrow(0, 1, 1));
  }
  EXPECT_EQ(inner[0][0][0].item<float>(), 21.0f);
}

TEST(NarrowView, OfATensorMadeOutsideInferenceModeIsItsNarrow) {
  const at::Tensor t = at::arange(12, at::TensorOptions().dtype(at::kFloat)).view({3, 4});
  ASSERT_FALSE(t.is_inference());
  const at::Tensor made = narrow_view(t, 1, 1, 2);
  ExpectSameView(made, t.narrow(1, 1, 2));
  EXPECT_FALSE(made.is_inference());
}

TEST(NarrowView, RowsOutsideTheTensorAreAnError) {
  const c10::InferenceMode inference;
  const at::Tensor t = at::arange(12, at::TensorOptions().dtype(at::kFloat)).view({3, 4});
  EXPECT_THROW(narrow_view(t, 0, 2, 2), c10::Error);
  EXPECT_THROW(narrow_view(t, 1, -1, 1), c10::Error);
  EXPECT_THROW(narrow_view(t, 2, 0, 1), c10::Error);
  EXPECT_THROW(narrow_view(at::Tensor(), 0, 0, 0), c10::Error);
}

}  // namespace
}  // namespace namm
