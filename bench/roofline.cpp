#include "roofline.h"

#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "namm/batch_invariant.h"

namespace namm::bench {

namespace {

// Best seconds of `calls` runs of fn after one to warm up.
template <typename Fn>
double BestSeconds(int calls, Fn fn) {
  fn();
  double best = 1e30;
  for (int i = 0; i < calls; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

}  // namespace

MatmulPeak MeasureMatmulPeak(at::Device device, at::ScalarType dtype) {
  if (!device.is_cpu()) {
    constexpr int64_t size = 4096;
    const auto options = at::TensorOptions().dtype(dtype).device(device);
    const at::Tensor a = at::randn({size, size}, options), b = at::randn({size, size}, options);
    // Each call ends with a read of one element: the device's work is done when it is timed.
    const double seconds = BestSeconds(5, [&] { (void)at::mm(a, b).view({-1}).narrow(0, 0, 1).to(at::kCPU); });
    return {2.0 * size * size * size / seconds / 1e9, "cuBLAS"};
  }
  constexpr int64_t m = 256, k = 1024, n = 1024;
  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  const at::Tensor x = at::randn({m, k}, options), w = at::randn({n, k}, options), wt = w.t().contiguous();
  const double flops = 2.0 * m * k * n;
  const double blas = flops / BestSeconds(5, [&] { (void)at::mm(x, wt); }) / 1e9;
  const double ours = flops / BestSeconds(5, [&] { (void)invariant_linear(x, w); }) / 1e9;
  // BLAS's and libtorch's idle threads spin for a while after a product (measured: ~0.2 s of sched_yield on
  // two cores): they would take a core from whatever the bench times first.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  return blas >= ours ? MatmulPeak{blas, "BLAS sgemm"} : MatmulPeak{ours, "our linear kernel"};
}

double GenerationFlops(const worker::LlamaConfig& c, const worker::GenerationResult& r, int64_t logit_rows,
                       int64_t namm_hidden) {
  const double layers = static_cast<double>(c.n_layers), dim = static_cast<double>(c.dim);
  const double heads = static_cast<double>(c.n_heads), kv_heads = static_cast<double>(c.n_kv_heads);
  const double hd = static_cast<double>(c.head_dim);
  const double queries = static_cast<double>(r.prompt_tokens + r.decode_steps);
  const double dense_per_token = 2.0 * dim * (2 * heads * hd + 2 * kv_heads * hd) + 2.0 * 3 * dim * static_cast<double>(c.hidden_dim);
  double flops = layers * queries * dense_per_token;
  flops += 2.0 * dim * static_cast<double>(c.vocab_size) * static_cast<double>(logit_rows);
  flops += layers * queries * r.mean_kv_tokens * 4.0 * heads * hd;  // scores and the weighted values
  if (namm_hidden <= 0) return flops;
  // Observation: the GQA mean of every attention row, and each token's windowed DFT at each hop end.
  flops += layers * queries * r.mean_kv_tokens * heads;
  flops += layers * kv_heads * (queries / 16.0) * r.mean_kv_tokens * 2.0 * 32 * 34;
  // Memory updates: the BAM over the n tokens cached before each (the last update's survivors plus the tokens
  // since), per layer and KV head.
  const double h = static_cast<double>(namm_hidden), f = 25;
  std::vector<double> kept(static_cast<std::size_t>(c.n_layers), 0.0);
  double last_length = 0;
  for (const worker::MemoryUpdateRecord& update : r.updates) {
    if (update.end_of_prefill) continue;  // a policy's own compression, not the NAMM's
    const double arrived = static_cast<double>(update.sequence_length) - last_length;
    for (std::size_t l = 0; l < kept.size() && l < update.cache_sizes.size(); ++l) {
      const double n = kept[l] + arrived;
      flops += kv_heads * (2 * n * f * 3 * h + 2 * (n * n / 2) * h * 2 + 2 * n * h * 2 * f + 2 * n * f);
      kept[l] = static_cast<double>(update.cache_sizes[l]);
    }
    last_length = static_cast<double>(update.sequence_length);
  }
  return flops;
}

std::string RooflineCells(double flops, double seconds, const MatmulPeak& peak) {
  const double rate = flops / seconds / 1e9;
  char cells[64];
  std::snprintf(cells, sizeof cells, "%.3g GFLOP/s | %.0f%%", rate, 100.0 * rate / peak.gflops);
  return cells;
}

}  // namespace namm::bench
