// Helpers shared by the scorer implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "namm/scorer.h"

namespace namm::internal {

// The view of `params` holding layout block `name` (shaped as the block), or an undefined tensor if the
// configuration has no such block (a disabled bias).
at::Tensor param_block(const ScorerConfig& config, const at::Tensor& params, const std::string& name);

// x W (+ b when b is defined), with W stored (in, out).
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  at::Tensor y = x.matmul(weight);
  return bias.defined() ? y.add_(bias) : y;
}

// Whether a scorer's parameter block (or none) can be read as float32 host memory.
bool host_block(const at::Tensor& block);

// y[i] = x [m][k] w + b for an output layer of one column (w [k, 1], host memory): each row's k products in
// lanes and a fixed tree (cpu_kernels.h: Linear), quicker than LinearInOut's one lane in sixteen.
void dot_rows_on_host(const float* x, int64_t x_stride, int64_t m, const at::Tensor& weight, const at::Tensor& bias,
                      float* y);

// Score() on the CPU: `scorer`'s ScoreOnHost for each KV head of features [kv_heads, n, 25], the heads in
// parallel: [kv_heads, n] float32.
at::Tensor score_heads_on_host(const Scorer& scorer, const at::Tensor& features);

}  // namespace namm::internal
