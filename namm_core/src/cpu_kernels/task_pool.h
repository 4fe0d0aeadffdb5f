// A parallel loop for the CPU kernels whose idle threads block instead of spinning.
//
// Why not at::parallel_for: libtorch's OpenMP threads spin after each parallel region, and OpenBLAS's threads
// spin after each product; on a machine with as many cores as BLAS threads the two pools take turns stealing
// each other's cores (measured on 2 cores: stories260K's full-cache generation 0.25 s with one intra-op
// thread, 0.75 s with two).
//
// The pool has as many threads as the process's CPU thread budget (namm/cpu_threads.h) less the caller's own:
// none at a budget of one, so that two local workers on two cores never run four threads that hand
// microseconds of work back and forth (issue 34 measured 2.5x more evaluations/s at batch 1 without them).
#pragma once

#include <cstdint>
#include <functional>

namespace namm::cpu {

// Calls fn(begin, end) on contiguous shares of [0, count), one share per thread of the budget, the calling
// thread taking the first, and returns when all are done. If shares throw (an allocation that fails, say),
// every share still finishes or fails before the call returns (fn is never left running), and the first
// exception is rethrown to the caller; the pool's threads never let one escape. A call made while the pool is
// busy (another thread's call, or a call from inside fn) runs the whole range on the calling thread.
void parallel_tasks(int64_t count, const std::function<void(int64_t begin, int64_t end)>& fn);

// Work (multiply-adds, or as many simple steps) below which a loop stays on the calling thread: a round trip
// through the pool (waking a thread, waiting for it) costs ~50 us on the 2-core development VM
// (namm_core_bench --benchmark_filter=TaskPoolRoundTrip), about what two threads save on 2^20 multiply-adds.
// At 2^17 it was woken for every prefill chunk's small products and every decode step's attention: at one
// namm-api client, stories260K made 1,200-1,800 tokens/s, and 2,300-3,200 with this bound.
constexpr int64_t kParallelWork = int64_t{1} << 20;

// parallel_tasks(count, fn) when `work` is at least kParallelWork, else fn(0, count) on the calling thread; the
// results are the same either way.
void parallel_work(int64_t count, int64_t work, const std::function<void(int64_t begin, int64_t end)>& fn);

// The threads parallel_tasks runs on, the caller's included (>= 1). Changing it waits for a call in progress
// and must not be done from inside fn.
void set_task_threads(int threads);
int task_threads();

}  // namespace namm::cpu
