#include "cuda_kernels/tensor_kernels.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <mutex>

#include "aten.h"
#include "cuda_kernels/cuda_kernels.h"
#include "namm/feature_constants.h"

namespace namm::cuda {

namespace {

InputType TypeOf(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return InputType::kBFloat16;
  if (t.scalar_type() == at::kHalf) return InputType::kFloat16;
  TORCH_CHECK(t.scalar_type() == at::kFloat,
              "the NAMM's CUDA kernels read float32, bfloat16 or float16, not ", t.scalar_type());
  return InputType::kFloat32;
}

void CheckOut(const at::Tensor& out, const at::Tensor& input, const char* what) {
  TORCH_CHECK(out.dim() == 3 && out.device() == input.device() && out.scalar_type() == at::kFloat &&
                  out.stride(2) == 1,
              what, ": out ", out.sizes(), " must be float32 with contiguous rows on ", input.device());
}

// Runs `launch(stream)` on the tensor's device and its current stream; a failed launch is a c10::Error.
template <typename Launch>
void OnDeviceOf(const at::Tensor& t, const char* what, Launch launch) {
  const c10::cuda::CUDAGuard guard(t.device());
  const cudaError_t error = launch(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
  TORCH_CHECK(error == cudaSuccess, what, ": ", cudaGetErrorString(error));
}

// A CUDA tensor of a type the kernels read, with contiguous rows (the callers checked the device, takes()).
bool Readable(const at::Tensor& t) {
  const at::ScalarType type = t.scalar_type();
  return t.is_cuda() && t.dim() >= 1 && t.stride(-1) == 1 &&
         (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf);
}

}  // namespace

bool runs_on(const at::Device& device) {
  if (!device.is_cuda()) return false;
  static std::mutex mutex;
  static std::map<int, bool> known;  // device index -> whether the build has code for its architecture
  const std::lock_guard<std::mutex> lock(mutex);
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  const auto it = known.find(index);
  if (it != known.end()) return it->second;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  const bool runs = kernels_run_on_current_device() == cudaSuccess;
  if (!runs)
    (void)cudaGetLastError();  // not a sticky error: cleared, so that later launches do not report it
  return known.emplace(index, runs).first->second;
}

bool takes(const at::Tensor& t) { return Readable(t) && runs_on(t.device()); }

void gqa_mean_into(const at::Tensor& attention, bool round_to_bf16, const at::Tensor& out) {
  TORCH_CHECK(Readable(attention) && attention.dim() == 3, "gqa_mean_into (CUDA): attention ",
              attention.sizes());
  CheckOut(out, attention, "gqa_mean_into (CUDA)");
  const int64_t kv_heads = out.size(0);
  TORCH_CHECK(attention.size(0) % kv_heads == 0 && attention.size(1) == out.size(1) &&
                  attention.size(2) == out.size(2),
              "gqa_mean_into (CUDA): attention ", attention.sizes(), " does not fit ", out.sizes());
  const GqaMean mean{
      attention.data_ptr(),         TypeOf(attention), attention.stride(0), attention.stride(1),
      out.data_ptr<float>(),        out.stride(0),     out.stride(1),       kv_heads,
      attention.size(0) / kv_heads, out.size(1),       out.size(2),         round_to_bf16};
  OnDeviceOf(out, "gqa_mean_into (CUDA)", [&](cudaStream_t stream) { return launch_gqa_mean(mean, stream); });
}

void scores_gqa_mean_into(const at::Tensor& products, double scale, const at::Tensor& lse,
                          const at::Tensor& key_positions, int64_t first_query, int64_t window,
                          bool round_to_bf16, const at::Tensor& out) {
  TORCH_CHECK(Readable(products) && products.dim() == 3, "scores_gqa_mean_into (CUDA): products ",
              products.sizes());
  CheckOut(out, products, "scores_gqa_mean_into (CUDA)");
  const int64_t kv_heads = out.size(0), heads = products.size(0), rows = out.size(1), n = out.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && products.size(1) == rows && products.size(2) == n,
              "scores_gqa_mean_into (CUDA): products ", products.sizes(), " do not fit ", out.sizes());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == heads && lse.size(1) == rows && lse.stride(1) == 1 &&
                  lse.scalar_type() == at::kFloat && lse.device() == products.device(),
              "scores_gqa_mean_into (CUDA): lse ", lse.sizes(), " must be [", heads, ", ", rows, "] float32");
  const at::Tensor positions = key_positions.to(products.device(), at::kLong);
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == kv_heads && positions.size(1) == n &&
                  positions.stride(1) == 1,
              "scores_gqa_mean_into (CUDA): key positions ", key_positions.sizes());
  const ScoresGqaMean mean{products.data_ptr(),
                           TypeOf(products),
                           static_cast<float>(scale),
                           products.stride(0),
                           products.stride(1),
                           lse.data_ptr<float>(),
                           lse.stride(0),
                           positions.data_ptr<int64_t>(),
                           positions.stride(0),
                           first_query,
                           window,
                           out.data_ptr<float>(),
                           out.stride(0),
                           out.stride(1),
                           kv_heads,
                           heads / kv_heads,
                           rows,
                           n,
                           round_to_bf16};
  OnDeviceOf(out, "scores_gqa_mean_into (CUDA)",
             [&](cudaStream_t stream) { return launch_scores_gqa_mean(mean, stream); });
}

void softmax_rows_into(const at::Tensor& scores, int64_t lse_from, const at::Tensor& lse,
                       const at::Tensor& probs) {
  TORCH_CHECK(Readable(scores) && scores.dim() == 3, "softmax_rows_into (CUDA): scores ", scores.sizes());
  const int64_t heads = scores.size(0), rows = scores.size(1), n = scores.size(2);
  TORCH_CHECK(probs.device() == scores.device() && probs.scalar_type() == at::kFloat &&
                  probs.is_contiguous() && probs.sizes() == scores.sizes(),
              "softmax_rows_into (CUDA): probs ", probs.sizes(), " must be contiguous float32 like ",
              scores.sizes());
  TORCH_CHECK(!lse.defined() || (lse.device() == scores.device() && lse.scalar_type() == at::kFloat &&
                                 lse.dim() == 2 && lse.size(0) == heads && lse_from >= 0 &&
                                 lse.size(1) == rows - lse_from && lse.stride(1) == 1),
              "softmax_rows_into (CUDA): lse must be [", heads, ", ", rows - lse_from, "] float32");
  const SoftmaxRows softmax{scores.data_ptr(),
                            TypeOf(scores),
                            scores.stride(0),
                            scores.stride(1),
                            probs.data_ptr<float>(),
                            lse.defined() ? lse.data_ptr<float>() : nullptr,
                            lse.defined() ? lse.stride(0) : 0,
                            lse_from,
                            heads,
                            rows,
                            n};
  OnDeviceOf(scores, "softmax_rows_into (CUDA)",
             [&](cudaStream_t stream) { return launch_softmax_rows(softmax, stream); });
}

void fold_frames(const at::Tensor& samples, const at::Tensor& ema, const at::Tensor& basis, double a) {
  TORCH_CHECK(
      samples.is_cuda() && samples.scalar_type() == at::kFloat && samples.dim() == 3 &&
          samples.stride(2) == 1 && ema.device() == samples.device() && ema.scalar_type() == at::kFloat &&
          ema.dim() == 3 && ema.size(2) == kStftBins && ema.stride(2) == 1 &&
          basis.device() == samples.device() && basis.scalar_type() == at::kFloat && basis.is_contiguous() &&
          basis.numel() == kStftWindow * 2 * kStftBins,
      "fold_frames (CUDA): samples ", samples.sizes(), ", ema ", ema.sizes(), ", basis ", basis.sizes());
  const FrameFold fold{samples.data_ptr<float>(),
                       samples.stride(0),
                       samples.stride(1),
                       ema.data_ptr<float>(),
                       ema.stride(0),
                       ema.stride(1),
                       ema.size(0),
                       ema.size(1),
                       samples.size(1) / kStftHop - 1,
                       basis.data_ptr<float>(),
                       static_cast<float>(a),
                       static_cast<float>(1.0 - a)};
  OnDeviceOf(ema, "fold_frames (CUDA)",
             [&](cudaStream_t stream) { return launch_fold_frames(fold, stream); });
}

}  // namespace namm::cuda
