// A parallel loop for the CPU kernels whose idle threads block instead of spinning.
//
// Why not at::parallel_for: libtorch's OpenMP threads spin after each parallel region, and OpenBLAS's threads
// spin after each product; on a machine with as many cores as BLAS threads the two pools take turns stealing
// each other's cores (measured on 2 cores: stories260K's full-cache generation 0.25 s with one intra-op
// thread, 0.75 s with two). The worker leaves libtorch at one thread here, which would leave the kernels on
// one.
#pragma once

#include <cstdint>
#include <functional>

namespace namm::cpu {

// Calls fn(begin, end) on contiguous shares of [0, count), one share per core, the calling thread taking the
// first, and returns when all are done. If shares throw (an allocation that fails, say), every share still
// finishes or fails before the call returns (fn is never left running), and the first exception is rethrown to
// the caller; the pool's threads never let one escape. A call made while the pool is busy (another thread's
// call, or a call from inside fn) runs the whole range on the calling thread.
void parallel_tasks(int64_t count, const std::function<void(int64_t begin, int64_t end)>& fn);

}  // namespace namm::cpu
