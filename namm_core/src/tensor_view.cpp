#include "namm/tensor_view.h"

#include <c10/core/TensorImpl.h>

#include <vector>

namespace namm {

at::Tensor narrow_view(const at::Tensor& t, int64_t dim, int64_t start, int64_t length) {
  TORCH_CHECK(t.defined() && dim >= 0 && dim < t.dim(), "narrow_view: dimension ", dim, " of a ", t.dim(),
              "-D tensor");
  TORCH_CHECK(start >= 0 && length >= 0 && start + length <= t.size(dim), "narrow_view: rows ", start, "..",
              start + length, " of ", t.size(dim));
  if (!t.is_inference() || t.layout() != at::kStrided) return t.narrow(dim, start, length);
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[static_cast<std::size_t>(dim)] = length;
  // What as_strided makes of an inference tensor: a view of the same storage with the same dispatch keys.
  auto view = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(),
                                                       t.dtype());
  view.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, t.strides(), t.storage_offset() + start * t.stride(dim));
  return view;
}

}  // namespace namm
