#include "namm/worker/rope.h"

#include <cmath>

#include "aten.h"

namespace namm::worker {

at::Tensor rope_inverse_frequencies(const LlamaConfig& config) {
  const int64_t d = config.head_dim;
  const RopeScaling& s = config.rope_scaling;
  double base = config.rope_theta;
  if (s.kind == RopeScaling::Kind::kNtk) {
    base *= std::pow(s.alpha * s.factor - (s.alpha - 1.0), static_cast<double>(d) / static_cast<double>(d - 2));
  }
  const at::Tensor exponents = at::arange(0, d, 2, at::TensorOptions().dtype(at::kLong).device(at::kCPU)).to(at::kFloat) /
                               static_cast<double>(d);
  at::Tensor inv_freq = 1.0 / at::pow(base, exponents);
  if (s.kind == RopeScaling::Kind::kLinear) inv_freq = inv_freq / s.factor;
  if (s.kind == RopeScaling::Kind::kLlama3) {
    const double old_context = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_context / s.low_freq_factor;
    const double high_freq_wavelen = old_context / s.high_freq_factor;
    const at::Tensor wavelen = 2.0 * M_PI / inv_freq;
    at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
    const at::Tensor smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    const at::Tensor blended = (1.0 - smooth) * scaled / s.factor + smooth * scaled;
    const at::Tensor medium = wavelen.ge(high_freq_wavelen).logical_and(wavelen.le(low_freq_wavelen));
    inv_freq = at::where(medium, blended, scaled);
  }
  return inv_freq;
}

RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions) {
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);  // [t, d/2]
  const at::Tensor angles = at::cat({freqs, freqs}, 1);
  return {angles.cos(), angles.sin()};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& tables) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
  return x * tables.cos.to(x.scalar_type()) + rotated * tables.sin.to(x.scalar_type());
}

}  // namespace namm::worker
