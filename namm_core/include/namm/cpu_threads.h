// The CPU threads a process computes with, from one budget: BLAS's and the pool our kernels and the batched
// engine share. A local worker's budget is its share of the machine, so that two workers on two cores never run
// more than two threads between them. libtorch's own operations run on the calling thread whatever the budget:
// on the CPU what is left to them are steps of microseconds, and each of its parallel regions woke an OpenMP
// thread that then spun (libgomp's default wait policy) on a core the pool computes on: ~10% of an 8B-shaped
// generation's samples at a budget of 2 (docs/performance.md). Half precision on the CPU, which libtorch's
// operations compute, thus runs on one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace namm {

// Sets the budget (>= 1) for BLAS and the pool (threads - 1 of its own beside the calling thread), and libtorch's
// intra-op threads to one. Before any call the pool has one thread per core and libtorch and BLAS their defaults.
void set_cpu_threads(int threads);
// The pool's threads, the caller's included.
int cpu_threads();

// Runs fn(i) for every i in [0, count), each item once, on the budget's threads: the coarse grain (the
// sequences of a batch) that has work for every thread. Items are handed out one at a time as threads free up,
// so items of unequal cost balance. Returns when all are done; the first exception is rethrown then (every
// item is still run or failed). The caller's inference mode holds for every item, whichever thread runs it;
// kernels called inside an item run on that item's thread.
void parallel_items(int64_t count, const std::function<void(int64_t item)>& fn);

// Items [0, work.size()) in min(max(groups, 1), items) groups of about equal total work (any unit, >= 0): the
// largest first, each to the group with the least so far. Each group's items in increasing order, none empty.
std::vector<std::vector<std::size_t>> balanced_groups(const std::vector<int64_t>& work, std::size_t groups);

}  // namespace namm
