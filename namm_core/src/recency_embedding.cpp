#include "namm/recency_embedding.h"

#include <cmath>

#include "aten.h"

namespace namm {

at::Tensor recency_embedding(const at::Tensor& positions) {
  TORCH_CHECK(positions.dim() == 2 && positions.size(1) >= 1, "positions must be [kv_heads, n >= 1], got ",
              positions.sizes());
  constexpr int64_t half = kRecencyDims / 2;
  at::Tensor frequencies = at::empty({half}, at::TensorOptions().dtype(at::kDouble).device(at::kCPU));
  for (int64_t i = 0; i < half; ++i) {
    frequencies[i].fill_(std::pow(kRecencyMaxFrequency, -static_cast<double>(i) / static_cast<double>(half)));
  }
  at::Tensor recency = (positions.narrow(1, positions.size(1) - 1, 1) - positions).to(at::kDouble);
  at::Tensor phase = recency.unsqueeze(-1) * frequencies.to(positions.device());
  return at::cat({phase.sin(), phase.cos()}, -1).to(at::kFloat);
}

}  // namespace namm
