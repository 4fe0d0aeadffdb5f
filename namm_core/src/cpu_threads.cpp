#include "namm/cpu_threads.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <utility>

#include "cpu_kernels/task_pool.h"
#include "namm/blas_threads.h"

namespace namm {

void set_cpu_threads(int threads) {
  threads = std::max(1, threads);
  at::set_num_threads(1);
  set_blas_threads(threads);
  cpu::set_task_threads(threads);
}

int cpu_threads() { return cpu::task_threads(); }

void parallel_items(int64_t count, const std::function<void(int64_t item)>& fn) {
  std::exception_ptr failure;
  std::mutex mutex;
  // An item's failure is kept (the first) and the others still run.
  const auto run = [&](int64_t i) {
    try {
      fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  if (count == 1 || cpu::task_threads() == 1) {
    for (int64_t i = 0; i < count; ++i) run(i);
  } else if (count > 1) {
    // One share per thread, each taking the next item until none is left.
    const bool inference = c10::InferenceMode::is_enabled();
    std::atomic<int64_t> next{0};
    cpu::parallel_tasks(std::min<int64_t>(count, cpu::task_threads()), [&](int64_t, int64_t) {
      const c10::InferenceMode mode(inference);
      for (int64_t i = next++; i < count; i = next++) run(i);
    });
  }
  if (failure) std::rethrow_exception(failure);
}

std::vector<std::vector<std::size_t>> balanced_groups(const std::vector<int64_t>& work, std::size_t groups) {
  std::vector<std::size_t> order(work.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return work[a] > work[b]; });
  std::vector<std::vector<std::size_t>> result(std::min(std::max<std::size_t>(groups, 1), work.size()));
  std::vector<int64_t> load(result.size(), 0);
  for (std::size_t i : order) {
    // The group with the least work, of those the fewest items (items without work open a group each too).
    std::size_t least = 0;
    for (std::size_t g = 1; g < result.size(); ++g) {
      if (std::make_pair(load[g], result[g].size()) < std::make_pair(load[least], result[least].size())) least = g;
    }
    result[least].push_back(i);
    load[least] += work[i];
  }
  for (std::vector<std::size_t>& group : result) std::sort(group.begin(), group.end());
  return result;
}

}  // namespace namm
