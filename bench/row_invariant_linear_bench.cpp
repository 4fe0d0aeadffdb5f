// The batched engine's row-invariant product (cpu::linear) against libtorch's at::linear (OpenBLAS) at the
// shapes the engine runs: stories260K (dim 64, hidden 172) and an 8B-shaped layer (4096 x 4096), from one
// decoded row to 16 sequences' 128-token chunks. Args: rows m, inputs k, outputs n.
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <benchmark/benchmark.h>

#include "cpu_kernels/tensor_kernels.h"

namespace namm {
namespace {

struct Operands {
  at::Tensor x, w, b;
};

Operands Make(const benchmark::State& state) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  return {at::randn({state.range(0), state.range(1)}, options), at::randn({state.range(2), state.range(1)}, options),
          at::randn({state.range(2)}, options)};
}

void Report(benchmark::State& state) {
  const double flops = 2.0 * static_cast<double>(state.range(0) * state.range(1) * state.range(2));
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_TorchLinear(benchmark::State& state) {
  const Operands o = Make(state);
  for (auto _ : state) benchmark::DoNotOptimize(at::linear(o.x, o.w, o.b));
  Report(state);
}

void BM_RowInvariantLinear(benchmark::State& state) {
  const Operands o = Make(state);
  for (auto _ : state) benchmark::DoNotOptimize(cpu::linear(o.x, o.w, o.b, cpu::kernels()));
  Report(state);
}

void Shapes(benchmark::internal::Benchmark* b) {
  for (int64_t m : {1, 32, 128, 2048}) b->Args({m, 64, 172});
  b->Args({32, 172, 64});
  b->Args({32, 64, 512});
  for (int64_t m : {1, 8, 128, 1024}) b->Args({m, 4096, 4096});
}

BENCHMARK(BM_TorchLinear)->Apply(Shapes)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RowInvariantLinear)->Apply(Shapes)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace namm
