#include "namm/recency_embedding.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <vector>

#include "aten.h"
#include "per_device.h"

namespace namm {

namespace {

constexpr int64_t kHalf = kRecencyDims / 2;

// f_i = 50000^(-i/4), in float64.
double Frequency(int64_t i) {
  return std::pow(kRecencyMaxFrequency, -static_cast<double>(i) / static_cast<double>(kHalf));
}

// emb(r) for r = 0, 1, ...: a function of the distance alone, so it is tabulated once and grown as longer
// caches need it, instead of 8 sines and cosines per token at every update. Readers keep the table they got.
class RecencyTable {
 public:
  std::shared_ptr<const std::vector<float>> Covering(int64_t distance) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto entries = static_cast<int64_t>(table_->size()) / kRecencyDims;
    if (distance < entries) return table_;
    const int64_t grown = std::max<int64_t>(distance + 1, 2 * entries);
    auto bigger = std::make_shared<std::vector<float>>(*table_);
    bigger->resize(static_cast<std::size_t>(grown * kRecencyDims));
    for (int64_t r = entries; r < grown; ++r) {
      float* row = bigger->data() + r * kRecencyDims;
      for (int64_t i = 0; i < kHalf; ++i) {
        const double phase = static_cast<double>(r) * Frequency(i);
        row[i] = static_cast<float>(std::sin(phase));
        row[kHalf + i] = static_cast<float>(std::cos(phase));
      }
    }
    table_ = std::move(bigger);
    return table_;
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<const std::vector<float>> table_ = std::make_shared<std::vector<float>>();
};

RecencyTable& Table() {
  static RecencyTable table;
  return table;
}

}  // namespace

void recency_embedding_on_host(const int64_t* positions, int64_t n, float* out, int64_t out_stride) {
  if (n == 0) return;
  const int64_t newest = positions[n - 1];
  int64_t farthest = 0;
  for (int64_t j = 0; j < n; ++j) farthest = std::max(farthest, newest - positions[j]);
  const std::shared_ptr<const std::vector<float>> table = Table().Covering(farthest);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = newest - positions[j];
    TORCH_CHECK(r >= 0, "recency embedding: positions must be chronological per head");
    const float* row = table->data() + r * kRecencyDims;
    std::copy(row, row + kRecencyDims, out + j * out_stride);
  }
}

at::Tensor recency_embedding(const at::Tensor& positions) {
  TORCH_CHECK(positions.dim() == 2 && positions.size(1) >= 1, "positions must be [kv_heads, n >= 1], got ",
              positions.sizes());
  const int64_t heads = positions.size(0), n = positions.size(1);
  if (positions.device().is_cpu()) {
    const at::Tensor p = positions.to(at::kLong).contiguous();
    at::Tensor out = at::empty({heads, n, kRecencyDims}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
    for (int64_t h = 0; h < heads; ++h) {
      recency_embedding_on_host(p.data_ptr<int64_t>() + h * n, n, out.data_ptr<float>() + h * n * kRecencyDims,
                                kRecencyDims);
    }
    return out;
  }
  // On a device, element by element from the frequencies kept there (the host's table grows as caches do).
  static internal::PerDevice frequencies([] {
    at::Tensor f = at::empty({kHalf}, at::TensorOptions().dtype(at::kDouble).device(at::kCPU));
    for (int64_t i = 0; i < kHalf; ++i) f.data_ptr<double>()[i] = Frequency(i);
    return f;
  });
  at::Tensor recency = (positions.narrow(1, n - 1, 1) - positions).to(at::kDouble);
  at::Tensor phase = recency.unsqueeze(-1) * frequencies.On(positions.device());
  return at::cat({phase.sin(), phase.cos()}, -1).to(at::kFloat);
}

}  // namespace namm
