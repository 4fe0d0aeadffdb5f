// One NAMM memory update of one layer, 8 KV heads (32 query heads), at n_keys = 4k, 16k and 32k:
//  - Observe: streaming 512 new queries' attention (4 chunks of 128 rows) into the per-token spectrogram state;
//  - Select: normalization + recency + BAM scorer + binary selection over all n_keys tokens.
// Reported per update and per token-head (time / (8 n_keys)), with the peak resident memory above the inputs.
#include <ATen/ops/arange.h>
#include <ATen/ops/rand.h>
#include <benchmark/benchmark.h>

#include <chrono>

#include "namm/policies/namm_policy.h"
#include "peak_memory.h"

namespace namm {
namespace {

constexpr int64_t kKvHeads = 8, kQueryHeads = 32, kNew = 512, kChunk = 128;

NammModel BenchModel() {
  NammModel model;
  model.params = initial_params(model.architecture);
  for (std::size_t i = 0; i < model.params.size(); ++i) {
    model.params[i] = 0.05f * static_cast<float>((static_cast<int64_t>(i * 7919) % 21) - 10) / 10.0f;
  }
  model.norm_state = NormState::kFrozen;
  model.norm_stats.count = 1;
  model.norm_stats.mean.fill(0.5);
  model.norm_stats.var.fill(0.1);
  return model;
}

// A cache holding n_keys - 512 old tokens with random spectrogram state, ready for one update.
std::unique_ptr<LayerKVCache> OldCache(const MemoryPolicy& policy, int64_t n_keys) {
  auto cache = std::make_unique<LayerKVCache>(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat),
                                              policy.token_state());
  const int64_t n_old = n_keys - kNew;
  (void)cache->Append(at::Tensor(), at::Tensor(), at::arange(n_old, at::TensorOptions().dtype(at::kLong)));
  cache->state("namm.ema").copy_(at::rand({kKvHeads, n_old, 17}));
  return cache;
}

// seconds: measured wall time of all iterations of the timed region.
void Report(benchmark::State& state, int64_t n_keys, double seconds, int64_t peak) {
  const double token_heads = static_cast<double>(kKvHeads * n_keys);
  const double per_update = seconds / static_cast<double>(state.iterations());
  state.counters["ns_per_token_head"] = per_update * 1e9 / token_heads;
  state.counters["peak_MiB"] = static_cast<double>(peak) / (1 << 20);
  state.counters["peak_B_per_token_head"] = static_cast<double>(peak) / token_heads;
}

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

void BM_NammObserve(benchmark::State& state) {
  const int64_t n_keys = state.range(0);
  auto policy = NammPolicy::Create(BenchModel());
  // One chunk of attention over all n_keys keys; each step uses its first (n_old + 128 c) columns.
  const at::Tensor attention = at::rand({kQueryHeads, kChunk, n_keys}).div_(static_cast<double>(n_keys));
  bench::PeakMemory memory;
  int64_t peak = 0;
  double seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto cache = OldCache(**policy, n_keys);
    memory.Start();
    state.ResumeTiming();
    const auto start = Clock::now();
    for (int64_t c = 0; c < kNew / kChunk; ++c) {
      const int64_t first = n_keys - kNew + c * kChunk;
      (void)cache->Append(at::Tensor(), at::Tensor(),
                          at::arange(first, first + kChunk, at::TensorOptions().dtype(at::kLong)));
      benchmark::DoNotOptimize(observe_newest(**policy, 0, attention.narrow(2, 0, cache->size()), *cache));
    }
    seconds += Since(start);
    state.PauseTiming();
    peak = std::max(peak, memory.PeakAboveStartBytes());
    state.ResumeTiming();
  }
  Report(state, n_keys, seconds, peak);
}

void BM_NammSelect(benchmark::State& state) {
  const int64_t n_keys = state.range(0);
  auto policy = NammPolicy::Create(BenchModel());
  auto cache = OldCache(**policy, n_keys);
  (void)cache->Append(at::Tensor(), at::Tensor(),
                      at::arange(n_keys - kNew, n_keys, at::TensorOptions().dtype(at::kLong)));
  bench::PeakMemory memory;
  int64_t peak = 0;
  int64_t kept = 0;
  double seconds = 0;
  for (auto _ : state) {
    memory.Start();
    const auto start = Clock::now();
    auto keep = (*policy)->Select(0, *cache);
    seconds += Since(start);
    kept = keep->size(1);
    state.PauseTiming();
    peak = std::max(peak, memory.PeakAboveStartBytes());
    state.ResumeTiming();
  }
  Report(state, n_keys, seconds, peak);
  state.counters["kept"] = static_cast<double>(kept);
}

BENCHMARK(BM_NammObserve)->Arg(4096)->Arg(16384)->Arg(32768)->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(BM_NammSelect)->Arg(4096)->Arg(16384)->Arg(32768)->Unit(benchmark::kMillisecond)->Iterations(2);

}  // namespace
}  // namespace namm

BENCHMARK_MAIN();
