#include "namm/recency_embedding.h"

#include <cmath>

#include "aten.h"

namespace namm {

at::Tensor recency_embedding(const at::Tensor& positions) {
  TORCH_CHECK(positions.dim() == 2 && positions.size(1) >= 1, "positions must be [kv_heads, n >= 1], got ",
              positions.sizes());
  constexpr int64_t half = kRecencyDims / 2;
  // Built once (a function of constants), not element by element at every update.
  static const at::Tensor frequencies = [] {
    at::Tensor f = at::empty({half}, at::TensorOptions().dtype(at::kDouble).device(at::kCPU));
    double* values = f.data_ptr<double>();
    for (int64_t i = 0; i < half; ++i) {
      values[i] = std::pow(kRecencyMaxFrequency, -static_cast<double>(i) / static_cast<double>(half));
    }
    return f;
  }();
  at::Tensor recency = (positions.narrow(1, positions.size(1) - 1, 1) - positions).to(at::kDouble);
  at::Tensor phase = recency.unsqueeze(-1) * frequencies.to(positions.device());
  return at::cat({phase.sin(), phase.cos()}, -1).to(at::kFloat);
}

}  // namespace namm
