#include "namm/batch_invariant.h"

#include "aten.h"
#include "cpu_kernels/tensor_kernels.h"

namespace namm {

bool row_invariant(const at::Tensor& x) { return x.device().is_cpu() && x.scalar_type() == at::kFloat; }

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (row_invariant(x) && x.stride(1) == 1 && w.stride(1) == 1) return cpu::linear(x, w, b, cpu::kernels());
  if (x.size(0) != 1 || !x.device().is_cpu()) return at::linear(x, w, b);
  // One row on the CPU in half precision: at::linear (and at::matmul on a 1-D input) runs a one-row GEMM whose
  // packing copies the whole weight matrix on every call; at::mv is the GEMV.
  at::Tensor y = at::mv(w, x.select(0, 0));
  if (b.defined()) y.add_(b);
  return y.unsqueeze(0);
}

at::Tensor invariant_silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  if (row_invariant(gate) && gate.is_contiguous() && up.is_contiguous()) {
    return cpu::silu_mul(gate, up, cpu::kernels());
  }
  return at::silu(gate) * up;
}

at::Tensor invariant_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (row_invariant(x) && x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous()) {
    return cpu::rms_norm(x, weight, eps, cpu::kernels());
  }
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor normalized = x32 * at::rsqrt(x32.square().mean(-1, /*keepdim=*/true) + eps);
  return weight * normalized.to(x.scalar_type());
}

std::vector<AttentionResult> invariant_attention(const std::vector<AttentionRequest>& sequences, int64_t heads,
                                                 double scale) {
  return cpu::batched_attention(sequences, heads, scale, cpu::kernels());
}

}  // namespace namm
