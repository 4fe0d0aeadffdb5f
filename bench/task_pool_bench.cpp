// What waking the kernels' thread pool costs (namm_core/src/cpu_kernels/task_pool.h): one parallel_tasks call
// over two threads whose shares do nothing, against the same call that stays on the calling thread. The
// difference sets kParallelWork, the work below which a kernel does not wake the pool.
#include <benchmark/benchmark.h>

#include <atomic>

#include "cpu_kernels/task_pool.h"

namespace {

void BM_TaskPoolRoundTrip(benchmark::State& state) {
  namm::cpu::set_task_threads(static_cast<int>(state.range(0)));
  std::atomic<int64_t> shares{0};
  for (auto _ : state) {
    namm::cpu::parallel_tasks(2, [&](int64_t, int64_t) { shares.fetch_add(1, std::memory_order_relaxed); });
  }
  benchmark::DoNotOptimize(shares.load());
  namm::cpu::set_task_threads(1);
}
BENCHMARK(BM_TaskPoolRoundTrip)->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
