#include "namm/worker/rope.h"

#include <algorithm>
#include <cmath>

#include "aten.h"

namespace namm::worker {

at::Tensor rope_inverse_frequencies(const LlamaConfig& config, at::Device device, int64_t sequence_length) {
  const int64_t d = config.head_dim;
  const double dims = static_cast<double>(d);
  const RopeScaling& s = config.rope_scaling;
  double base = config.rope_theta;
  if (s.kind == RopeScaling::Kind::kNtk) base *= std::pow(s.alpha * s.factor - (s.alpha - 1.0), dims / (dims - 2));
  if (s.kind == RopeScaling::Kind::kDynamic && sequence_length > config.max_position_embeddings) {
    const double stretch = static_cast<double>(sequence_length) / static_cast<double>(config.max_position_embeddings);
    base *= std::pow(s.factor * stretch - (s.factor - 1.0), dims / (dims - 2));
  }
  const at::Tensor exponents =
      at::arange(0, d, 2, at::TensorOptions().dtype(at::kLong).device(device)).to(at::kFloat) / dims;
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
  if (s.kind == RopeScaling::Kind::kYarn) {
    const double trained = static_cast<double>(s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings
                                                                                       : config.max_position_embeddings);
    // The dimension whose frequency turns `rotations` times over the trained length.
    auto dimension_turning = [&](double rotations) {
      return dims * std::log(trained / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
    };
    double low = dimension_turning(s.beta_fast), high = dimension_turning(s.beta_slow);
    if (s.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, dims - 1);
    if (low == high) high += 0.001;  // a ramp of zero width would divide by zero
    // ramp: 0 on the fast (high-frequency) dimensions, which keep their frequency; 1 on the slow ones, which
    // are interpolated.
    const at::Tensor ramp =
        ((at::arange(d / 2, at::TensorOptions().dtype(at::kFloat).device(device)) - low) / (high - low)).clamp(0, 1);
    inv_freq = inv_freq / s.factor * ramp + inv_freq * (1.0 - ramp);
  }
  return inv_freq;
}

bool rope_depends_on_length(const LlamaConfig& config) {
  return config.rope_scaling.kind == RopeScaling::Kind::kDynamic;
}

RopeTables rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions, double scale) {
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);  // [t, d/2]
  const at::Tensor angles = at::cat({freqs, freqs}, 1);
  if (scale == 1.0) return {angles.cos(), angles.sin()};
  return {angles.cos().mul_(scale), angles.sin().mul_(scale)};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& tables) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
  return x * tables.cos.to(x.scalar_type()) + rotated * tables.sin.to(x.scalar_type());
}

}  // namespace namm::worker
