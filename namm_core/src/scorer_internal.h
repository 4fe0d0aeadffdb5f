// Helpers shared by the scorer implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

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

}  // namespace namm::internal
