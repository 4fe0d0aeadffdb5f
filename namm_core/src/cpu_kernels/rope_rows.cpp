// Compiled with -ffp-contract=off (namm_core/CMakeLists.txt): a fused multiply-add would round the sum of the
// two products differently from libtorch's separate operations.
#include "cpu_kernels/cpu_kernels.h"

namespace namm::cpu {

void rope_rows(const RopeRows& op, int64_t begin, int64_t end) {
  const int64_t half = op.head_dim / 2;
  for (int64_t r = begin; r < end; ++r) {
    const float* c = op.cos + r * op.table_row_stride;
    const float* s = op.sin + r * op.table_row_stride;
    for (int64_t j = 0; j < op.heads; ++j) {
      float* x = op.x + r * op.x_row_stride + j * op.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        const float first = x1 * c[i], first_rotated = -x2 * s[i];
        const float second = x2 * c[i + half], second_rotated = x1 * s[i + half];
        x[i] = first + first_rotated;
        x[i + half] = second + second_rotated;
      }
    }
  }
}

}  // namespace namm::cpu
