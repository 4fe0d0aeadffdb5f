// Helpers shared by namm_core's tests.
#pragma once

#include "../temp_path.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "namm/namm_file.h"
#include "reference_namm.h"

namespace namm::testing {

// A NAMM of the default architecture whose parameters are N(0, 0.15) draws of std::mt19937(seed) (it evicts
// some tokens of a story), written to TempPath(name); its path.
inline std::string WriteRandomNammFile(const std::string& name, uint32_t seed) {
  NammModel namm;
  namm.params = initial_params(namm.architecture);
  std::mt19937 random(seed);
  std::normal_distribution<float> normal(0.0f, 0.15f);
  for (float& p : namm.params) p = normal(random);
  const std::string file = TempPath(name);
  EXPECT_TRUE(write_namm_file(file, namm).ok()) << file;
  return file;
}

inline Array ToArray(const at::Tensor& t) {
  at::Tensor d = t.to(at::kCPU, at::kDouble).contiguous();
  Array a(d.sizes().vec());
  std::copy(d.data_ptr<double>(), d.data_ptr<double>() + d.numel(), a.data.begin());
  return a;
}

inline at::Tensor ToTensor(const Array& a, at::ScalarType dtype = at::kFloat) {
  at::Tensor d = at::empty(a.shape, at::TensorOptions().dtype(at::kDouble));
  std::copy(a.data.begin(), a.data.end(), d.data_ptr<double>());
  return d.to(dtype);
}

inline at::Tensor RandomNormal(std::vector<int64_t> shape, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, scale);
  Array a(std::move(shape));
  for (auto& v : a.data) v = normal(gen);
  return ToTensor(a);
}

// Causal attention probabilities [q_heads, n_new, n_old + n_new] of n_new new queries: new query i sees all
// n_old retained keys and the new keys 0..i; logits are Gaussian with the given spread.
inline at::Tensor RandomCausalAttention(int64_t q_heads, int64_t n_new, int64_t n_old, uint64_t seed,
                                        double spread = 2.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, spread);
  const int64_t n_all = n_old + n_new;
  Array a({q_heads, n_new, n_all});
  for (int64_t h = 0; h < q_heads; ++h)
    for (int64_t i = 0; i < n_new; ++i) {
      const int64_t visible = n_old + i + 1;
      double z = 0;
      for (int64_t j = 0; j < visible; ++j) z += (a.at({h, i, j}) = std::exp(normal(gen)));
      for (int64_t j = 0; j < visible; ++j) a.at({h, i, j}) /= z;
    }
  return ToTensor(a);
}

// max |a - b| / (atol + rtol |b|) <= 1, with the worst element in the failure message.
inline ::testing::AssertionResult AllClose(const at::Tensor& actual, const Array& expected, double atol,
                                           double rtol) {
  Array a = ToArray(actual);
  if (a.shape != expected.shape) return ::testing::AssertionFailure() << "shape mismatch";
  for (std::size_t i = 0; i < a.data.size(); ++i) {
    const double err = std::fabs(a.data[i] - expected.data[i]);
    if (!(err <= atol + rtol * std::fabs(expected.data[i]))) {
      return ::testing::AssertionFailure() << "element " << i << ": got " << a.data[i] << ", expected "
                                           << expected.data[i] << " (|diff| " << err << ")";
    }
  }
  return ::testing::AssertionSuccess();
}


}  // namespace namm::testing
