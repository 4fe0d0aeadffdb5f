#include "namm/batch_invariant.h"

#include <utility>

#include "aten.h"
#include "cpu_kernels/tensor_kernels.h"

namespace namm {

bool row_invariant(const at::Tensor& x) { return x.device().is_cpu() && x.scalar_type() == at::kFloat; }

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& out) {
  if (row_invariant(x) && x.stride(1) == 1 && w.stride(1) == 1) return cpu::linear(x, w, b, cpu::kernels(), out);
  if (x.size(0) != 1 || !x.device().is_cpu()) return at::linear(x, w, b);
  // One row on the CPU in half precision: at::linear (and at::matmul on a 1-D input) runs a one-row GEMM whose
  // packing copies the whole weight matrix on every call; at::mv is the GEMV.
  at::Tensor y = at::mv(w, x.select(0, 0));
  if (b.defined()) y.add_(b);
  return y.unsqueeze(0);
}

InvariantLinear::InvariantLinear(at::Tensor w, at::Tensor b) : w_(std::move(w)), b_(std::move(b)) {
  if (row_invariant(w_) && w_.dim() == 2 && w_.size(1) <= kInOutMaxFeatures && (!b_.defined() || row_invariant(b_))) {
    in_out_ = std::make_shared<const cpu::InOutWeight>(cpu::make_in_out_weight(w_, b_, /*out_in=*/true));
  }
}

at::Tensor InvariantLinear::operator()(const at::Tensor& x, const at::Tensor& out) const {
  if (!in_out_ || !row_invariant(x) || x.dim() != 2 || x.stride(1) != 1) return invariant_linear(x, w_, b_, out);
  TORCH_CHECK(x.size(1) == in_out_->in, "linear: x has ", x.size(1), " features, the weight ", in_out_->in);
  const at::Tensor y = out.defined() ? out : at::empty({x.size(0), in_out_->out}, x.options());
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == in_out_->out && row_invariant(y) &&
                  y.stride(1) == 1,
              "linear: the output must be [", x.size(0), ", ", in_out_->out, "] float32 host rows, got ", y.sizes());
  cpu::linear_in_out(x.data_ptr<float>(), x.stride(0), x.size(0), *in_out_, y.data_ptr<float>(), y.stride(0),
                     cpu::kernels());
  return y;
}

at::Tensor invariant_silu_mul(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  if (row_invariant(gate) && gate.is_contiguous() && up.is_contiguous()) {
    return cpu::silu_mul(gate, up, cpu::kernels(), out);
  }
  return at::silu(gate) * up;
}

at::Tensor invariant_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  if (row_invariant(x) && x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous()) {
    return cpu::rms_norm(x, weight, eps, cpu::kernels(), out);
  }
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor normalized = x32 * at::rsqrt(x32.square().mean(-1, /*keepdim=*/true) + eps);
  return weight * normalized.to(x.scalar_type());
}

void invariant_rope_(const at::Tensor& x, int64_t heads, int64_t first, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(row_invariant(x) && x.dim() == 2 && x.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.sizes() == cos.sizes() && cos.dim() == 2 &&
                  x.size(1) == heads * cos.size(1) && first >= 0 && first + cos.size(0) <= x.size(0),
              "invariant_rope_: x [rows, heads * head_dim] float32 and cos, sin [count, head_dim] float32");
  const cpu::RopeRows op{x.data_ptr<float>() + first * x.stride(0), x.stride(0), heads, cos.size(1),
                         cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1)};
  cpu::rope_rows(op, 0, cos.size(0));
}

std::vector<AttentionResult> invariant_attention(const std::vector<AttentionRequest>& sequences, int64_t heads,
                                                 double scale) {
  return cpu::batched_attention(sequences, heads, scale, cpu::kernels());
}

}  // namespace namm
