#include "namm/budget_input.h"

#include <algorithm>
#include <cmath>

namespace namm {

float budget_pressure(const SelectionConfig& selection, int64_t n) {
  if (selection.kind == SelectionKind::kBinary || selection.budget <= 0 || n <= selection.budget) return 0.0f;
  return static_cast<float>(std::log2(static_cast<double>(n) / static_cast<double>(selection.budget)));
}

std::vector<float> budget_shift(float pressure, const std::vector<float>& embedding) {
  std::vector<float> shift(embedding.size());
  std::transform(embedding.begin(), embedding.end(), shift.begin(), [pressure](float e) { return pressure * e; });
  return shift;
}

void add_budget_shift(const std::vector<float>& shift, float* features, int64_t n, int64_t stride) {
  const auto width = static_cast<int64_t>(shift.size());
  if (width == 0) return;  // no budget input, or no budget: the common case on the hot path
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < width; ++c) features[j * stride + c] += shift[static_cast<std::size_t>(c)];
  }
}

}  // namespace namm
