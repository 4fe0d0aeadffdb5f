// Views made without the operator dispatcher, for the engine's per-sequence, per-layer views.
//
// A libtorch narrow is three dispatched calls (narrow, slice, as_strided) with their checks: about a microsecond,
// and the engine and a NAMM's observation make several per sequence, layer and step, ~2% of a training worker's
// time on stories260K. The view made here is the same view (sizes, strides, storage offset, shared storage),
// built directly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace namm {

// t.narrow(dim, start, length): built directly for an inference tensor (made under c10::InferenceMode, as the
// engine's are: no autograd state to carry), by t.narrow otherwise. dim must be in [0, t.dim()); throws when
// [start, start + length) is not within t.size(dim).
at::Tensor narrow_view(const at::Tensor& t, int64_t dim, int64_t start, int64_t length);

}  // namespace namm
