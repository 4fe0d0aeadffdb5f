// The threads of every BLAS call in this process (OpenBLAS on Debian; a no-op with another BLAS).
#pragma once

namespace namm {

// 1, or 0 for the library's default (one per core). With one, results do not depend on the host's cores
// (OpenBLAS 0.3.21's threaded dgemm and dsyevd round differently with 1 and 2 threads: measured), and calls from
// several threads at once run side by side, where threaded calls serialize on OpenBLAS's level-3 lock and spin
// (a CMA-ES decomposition took 108 s instead of 9 beside the trainer's background updates; the worker's small
// attention products spent more time in the idle threads' sched_yield than in the products). Other counts are
// passed through.
void set_blas_threads(int threads);

}  // namespace namm
