#include "namm/stft_features.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "aten.h"
#include "cpu_kernels/task_pool.h"
#include "cpu_kernels/tensor_kernels.h"
#ifdef NAMM_CUDA_KERNELS
#include "cuda_kernels/tensor_kernels.h"
#endif
#include "per_device.h"
#include "stft_basis.h"

namespace namm {

namespace {

// DFT basis with the periodic Hann window folded in: [32, 34] = [w(n)cos(2 pi f n/32) | -w(n)sin(2 pi f n/32)].
at::Tensor WindowedDftBasis(const at::TensorOptions& options) {
  at::Tensor basis = at::empty({kStftWindow, 2 * kStftBins}, at::TensorOptions().dtype(at::kDouble).device(at::kCPU));
  auto b = basis.accessor<double, 2>();
  for (int64_t n = 0; n < kStftWindow; ++n) {
    const double w = 0.5 - 0.5 * std::cos(2.0 * M_PI * static_cast<double>(n) / kStftWindow);
    for (int64_t f = 0; f < kStftBins; ++f) {
      // Reduce f*n mod 32 first so that the angle is exact and sin/cos of multiples of pi/2 come out exact.
      const double angle = 2.0 * M_PI * static_cast<double>((f * n) % kStftWindow) / kStftWindow;
      b[n][f] = w * std::cos(angle);
      b[n][kStftBins + f] = -w * std::sin(angle);
    }
  }
  return basis.to(options.dtype(at::kFloat));
}

at::Tensor RoundToBf16(const at::Tensor& x) { return x.to(at::kBFloat16).to(at::kFloat); }

// The windowed DFT basis on `device`, its rows rotated by 16 when `rotated`.
at::Tensor WindowedDftBasisOn(at::Device device, bool rotated) {
  static internal::PerDevice basis([] { return WindowedDftBasis(at::TensorOptions()); });
  static internal::PerDevice rotated_basis([] { return WindowedDftBasis(at::TensorOptions()).roll(kStftHop, 0); });
  return (rotated ? rotated_basis : basis).On(device);
}

// Windowed DFT [..., 34] (17 real parts, then 17 imaginary parts) of the frames held in `samples` [..., 32] in
// ring order: with the previous hop in the upper half (columns 16-31) the frame starts at column 16, so the
// basis rows are rotated by 16.
at::Tensor RingFrameSpectrum(const at::Tensor& samples, bool previous_hop_in_upper_half) {
  const at::Tensor basis = WindowedDftBasisOn(samples.device(), previous_hop_in_upper_half);
  return samples.matmul(basis.scalar_type() == samples.scalar_type() ? basis : basis.to(samples.scalar_type()));
}

at::Tensor Magnitudes(const at::Tensor& spectrum) {
  const at::Tensor re = spectrum.narrow(-1, 0, kStftBins);
  const at::Tensor im = spectrum.narrow(-1, kStftBins, kStftBins);
  return (re * re + im * im).sqrt_();
}

// One EMA step (spec §3.4, a = 0.99^16 per hop) with the frame held in `samples` [kv, n, 32] (ring order, see
// RingFrameSpectrum): ema <- a ema + (1 - a) |X|.
void FoldFrame(const at::Tensor& samples, bool previous_hop_in_upper_half, const at::Tensor& ema) {
  static const double a = std::pow(kEmaCoefficientPerQuery, static_cast<double>(kStftHop));
  ema.mul_(a).add_(Magnitudes(RingFrameSpectrum(samples, previous_hop_in_upper_half)), 1.0 - a);
}

// Round-to-nearest-even to bfloat16, as torch converts (inputs are finite probabilities).
inline float RoundToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

// Writes the GQA-reduced attention of queries [r0, r0 + rows) (all within one hop) into samples[:, :, column
// ...]. CPU, float32, one pass over the input.
void ScatterHopCpu(const at::Tensor& attention, bool bf16, int64_t r0, int64_t rows, int64_t column,
                   const at::Tensor& samples) {
  const int64_t kv_heads = samples.size(0), n = samples.size(1), group = attention.size(0) / kv_heads;
  const int64_t s0 = attention.stride(0), s1 = attention.stride(1);
  const float* a = attention.data_ptr<float>();
  float* out = samples.data_ptr<float>();
  const int64_t head_stride = samples.stride(0), key_stride = samples.stride(1);
  constexpr int64_t kKeyBlock = 1024;
  const int64_t blocks_per_head = (n + kKeyBlock - 1) / kKeyBlock;
  cpu::parallel_work(kv_heads * blocks_per_head, kv_heads * rows * group * n, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(static_cast<std::size_t>(kStftHop * kKeyBlock));  // [row, key] of one block
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks_per_head, j0 = (task % blocks_per_head) * kKeyBlock;
      const int64_t len = std::min(kKeyBlock, n - j0);
      for (int64_t r = 0; r < rows; ++r) {
        float* acc = sum.data() + r * kKeyBlock;
        std::fill(acc, acc + len, 0.0f);
        for (int64_t g = 0; g < group; ++g) {
          const float* row = a + (h * group + g) * s0 + (r0 + r) * s1 + j0;
          if (bf16) {
            for (int64_t j = 0; j < len; ++j) acc[j] += RoundToBf16(row[j]);
          } else {
            for (int64_t j = 0; j < len; ++j) acc[j] += row[j];
          }
        }
      }
      // Key by key, the hop's rows are adjacent in samples: one contiguous write per key instead of one strided
      // pass over the block per row.
      const float inv_group = 1.0f / static_cast<float>(group);
      const bool exact_reciprocal = (group & (group - 1)) == 0;
      for (int64_t j = 0; j < len; ++j) {
        float* dst = out + h * head_stride + (j0 + j) * key_stride + column;
        for (int64_t r = 0; r < rows; ++r) {
          const float total = sum[static_cast<std::size_t>(r * kKeyBlock + j)];
          // Divide (not multiply by the reciprocal) unless exact, to match torch's mean bit for bit.
          const float mean = exact_reciprocal ? total * inv_group : total / static_cast<float>(group);
          dst[r] = bf16 ? RoundToBf16(mean) : mean;
        }
      }
    }
  });
}

}  // namespace

const at::Tensor& windowed_dft_basis_cpu() {
  static const at::Tensor basis = WindowedDftBasis(at::TensorOptions()).contiguous();
  return basis;
}

at::Tensor gqa_mean(const at::Tensor& attention, int64_t kv_heads, AttentionPrecision precision) {
  TORCH_CHECK(attention.dim() == 3, "attention must be [q_heads, n_q, n_keys], got ", attention.sizes());
  const int64_t q_heads = attention.size(0);
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "q_heads (", q_heads, ") is not a multiple of kv_heads (",
              kv_heads, ")");
  const int64_t group = q_heads / kv_heads;
  at::Tensor a = attention.to(at::kFloat);
  if (precision == AttentionPrecision::kBf16) a = RoundToBf16(a);
  // Sum in float32 then divide: for bfloat16 inputs this is the float accumulation torch uses for bf16 means.
  at::Tensor mean = a.view({kv_heads, group, a.size(1), a.size(2)}).sum(1).div_(static_cast<double>(group));
  if (precision == AttentionPrecision::kBf16) mean = RoundToBf16(mean);
  return mean;
}

at::Tensor stft_frame_magnitudes(const at::Tensor& samples) {
  TORCH_CHECK(samples.size(-1) == kStftWindow, "frames must have ", kStftWindow, " samples");
  return Magnitudes(RingFrameSpectrum(samples, /*previous_hop_in_upper_half=*/false));
}

void consume_attention(const at::Tensor& attention, AttentionPrecision precision, int64_t first_query,
                       const SpectrogramState& state) {
  TORCH_CHECK(attention.dim() == 3, "attention must be [q_heads, n_q, n_keys]");
  const int64_t kv_heads = state.samples.size(0);
  TORCH_CHECK(attention.size(0) % kv_heads == 0 && attention.size(2) == state.samples.size(1),
              "attention ", attention.sizes(), " does not match the cached tokens ", state.samples.sizes());
  TORCH_CHECK(first_query >= 0, "first_query must be non-negative");
  TORCH_CHECK(state.samples.stride(2) == 1 && state.samples.scalar_type() == at::kFloat,
              "spectrogram samples must be float32 with contiguous rows");
  const bool fused =
      attention.device().is_cpu() && attention.scalar_type() == at::kFloat && attention.stride(2) == 1;
  // Elsewhere: reduce with tensor operations, then copy hop by hop.
  const at::Tensor received = fused ? at::Tensor() : gqa_mean(attention, kv_heads, precision).transpose(1, 2);
  const int64_t n_q = attention.size(1);
  for (int64_t i = 0; i < n_q;) {
    const int64_t query = first_query + i, offset = query % kStftHop;
    const bool upper_half = (query / kStftHop) % 2 == 1;  // where this hop's samples go
    const int64_t column = (upper_half ? kStftHop : 0) + offset;
    const int64_t len = std::min(kStftHop - offset, n_q - i);
    if (fused) {
      ScatterHopCpu(attention, precision == AttentionPrecision::kBf16, i, len, column, state.samples);
    } else {
      state.samples.narrow(2, column, len).copy_(received.narrow(2, i, len));
    }
    i += len;
    // A complete hop completes the frame [previous hop, this hop]; the next hop overwrites the older half (every
    // query writes every cached token, and tokens that arrive later start from zeros).
    if (offset + len == kStftHop) {
      FoldFrame(state.samples, !upper_half, state.ema);
    }
  }
}

void gqa_mean_into(const at::Tensor& attention, AttentionPrecision precision, const at::Tensor& out) {
  TORCH_CHECK(attention.dim() == 3 && out.dim() == 3 && out.size(1) == attention.size(1) &&
                  out.size(2) == attention.size(2) && out.size(0) > 0 && attention.size(0) % out.size(0) == 0 &&
                  out.stride(2) == 1 && out.scalar_type() == at::kFloat,
              "gqa_mean_into: attention ", attention.sizes(), " does not fit [kv_heads, rows, n] ", out.sizes());
  if (attention.device().is_cpu() && attention.scalar_type() == at::kFloat && attention.stride(2) == 1) {
    cpu::gqa_mean_into(attention, precision == AttentionPrecision::kBf16, out, cpu::kernels());
#ifdef NAMM_CUDA_KERNELS
  } else if (cuda::takes(attention) && out.device() == attention.device()) {
    cuda::gqa_mean_into(attention, precision == AttentionPrecision::kBf16, out);
#endif
  } else {
    out.copy_(gqa_mean(attention, out.size(0), precision));
  }
}

bool observe_kernels_run_on(at::Device device) {
#ifdef NAMM_CUDA_KERNELS
  return cuda::runs_on(device);
#else
  (void)device;
  return false;
#endif
}

void fold_frames(const at::Tensor& samples, const at::Tensor& ema) {
  const int64_t frames = samples.size(1) / kStftHop - 1;
  TORCH_CHECK(samples.dim() == 3 && ema.dim() == 3 && samples.size(0) == ema.size(0) && samples.size(2) == ema.size(1) &&
                  ema.size(2) == kStftBins && frames >= 1 && samples.size(1) == kStftHop * (frames + 1) &&
                  samples.stride(2) == 1 && ema.stride(2) == 1,
              "samples must be [", ema.size(0), ", 16 (H + 1), ", ema.size(1), "] for an EMA ", ema.sizes(), ", got ",
              samples.sizes());
  const double a = std::pow(kEmaCoefficientPerQuery, static_cast<double>(kStftHop));
  if (samples.device().is_cpu() && samples.scalar_type() == at::kFloat && ema.scalar_type() == at::kFloat) {
    cpu::fold_frames(samples, ema, windowed_dft_basis_cpu(), a, cpu::kernels());
    return;
  }
#ifdef NAMM_CUDA_KERNELS
  if (cuda::takes(samples) && samples.scalar_type() == at::kFloat && ema.scalar_type() == at::kFloat &&
      ema.device() == samples.device()) {
    cuda::fold_frames(samples, ema, WindowedDftBasisOn(samples.device(), /*rotated=*/false), a);
    return;
  }
#endif
  // Elsewhere (a GPU without our kernels): every frame's spectrum in one product and the EMA steps as one weighted sum,
  // ema <- a^F ema + sum_j (1 - a) a^(F-1-j) |X_j|, a few launches instead of ~10 per frame (the same value as
  // F steps, rounded differently).
  const at::Tensor magnitudes =
      Magnitudes(RingFrameSpectrum(samples.unfold(1, kStftWindow, kStftHop), /*previous_hop_in_upper_half=*/false));
  const at::Tensor weights = at::arange(frames - 1, -1, -1, ema.options()).mul_(std::log(a)).exp_().mul_(1.0 - a);
  ema.mul_(std::pow(a, static_cast<double>(frames))).add_((magnitudes * weights.view({1, frames, 1, 1})).sum(1));
}

}  // namespace namm
