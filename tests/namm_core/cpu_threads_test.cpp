// The CPU thread budget (namm/cpu_threads.h): the kernels' pool never runs threads beyond it, libtorch's never
// forks, and parallel_items runs every item once, whatever fails, with the caller's inference mode.
#include "namm/cpu_threads.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu_kernels/task_pool.h"

namespace namm {
namespace {

// Restores one thread per core (the process default) after a test changed the budget.
struct Budget {
  explicit Budget(int threads) { set_cpu_threads(threads); }
  ~Budget() { set_cpu_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))); }
};

std::set<std::thread::id> ThreadsOf(int64_t count, int64_t spin) {
  std::mutex mutex;
  std::set<std::thread::id> seen;
  parallel_items(count, [&](int64_t) {
    volatile int64_t sink = 0;
    for (int64_t i = 0; i < spin; ++i) sink = sink + i;  // long enough for another thread to take a turn
    std::lock_guard<std::mutex> lock(mutex);
    seen.insert(std::this_thread::get_id());
  });
  return seen;
}

TEST(CpuThreads, ABudgetOfOneRunsEverythingOnTheCallingThread) {
  const Budget budget(1);
  EXPECT_EQ(cpu_threads(), 1);
  EXPECT_EQ(ThreadsOf(64, 100000), std::set<std::thread::id>{std::this_thread::get_id()});
  std::set<std::thread::id> kernel_threads;
  cpu::parallel_tasks(16, [&](int64_t, int64_t) { kernel_threads.insert(std::this_thread::get_id()); });
  EXPECT_EQ(kernel_threads, std::set<std::thread::id>{std::this_thread::get_id()});
}

TEST(CpuThreads, ABudgetOfThreeUsesAtMostThreeThreadsAndEachItemOnce) {
  const Budget budget(3);
  EXPECT_EQ(cpu_threads(), 3);
  std::vector<std::atomic<int>> runs(500);
  std::mutex mutex;
  std::set<std::thread::id> seen;
  parallel_items(500, [&](int64_t i) {
    ++runs[static_cast<std::size_t>(i)];
    std::lock_guard<std::mutex> lock(mutex);
    seen.insert(std::this_thread::get_id());
  });
  for (const auto& r : runs) ASSERT_EQ(r.load(), 1);
  EXPECT_LE(seen.size(), 3u);
  EXPECT_GE(ThreadsOf(6, 20000000).size(), 2u);  // slow items: the pool's threads take some
  // libtorch's operations stay on the calling thread: an OpenMP team would spin on the pool's cores.
  EXPECT_EQ(at::get_num_threads(), 1);
}

TEST(CpuThreads, AFailingItemFailsTheCallAfterEveryOtherItemRan) {
  const Budget budget(2);
  std::vector<std::atomic<int>> runs(40);
  EXPECT_THROW(parallel_items(40,
                              [&](int64_t i) {
                                ++runs[static_cast<std::size_t>(i)];
                                if (i == 3 || i == 30) throw std::runtime_error("item failed");
                              }),
               std::runtime_error);
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
}

TEST(CpuThreads, ItemsRunInTheCallersInferenceMode) {
  const Budget budget(2);
  for (const bool inference : {true, false}) {
    const c10::InferenceMode mode(inference);
    std::atomic<int> matching{0};
    parallel_items(8, [&](int64_t) { matching += c10::InferenceMode::is_enabled() == inference ? 1 : 0; });
    EXPECT_EQ(matching.load(), 8) << "inference mode " << inference;
  }
}

// Largest first, each to the least loaded group: equal loads where they can be, every item once, in order.
TEST(CpuThreads, BalancedGroupsGiveEachGroupAboutTheSameWork) {
  using Groups = std::vector<std::vector<std::size_t>>;
  EXPECT_EQ(balanced_groups({5, 1, 1, 1, 1, 1}, 2), (Groups{{0}, {1, 2, 3, 4, 5}}));
  EXPECT_EQ(balanced_groups({3, 3, 2, 2, 2}, 2), (Groups{{0, 2, 4}, {1, 3}}));  // 7 and 5: LPT, not the best 6/6
  EXPECT_EQ(balanced_groups({1, 32, 1, 32, 1, 1, 1, 1}, 2), (Groups{{0, 1, 4, 6}, {2, 3, 5, 7}}));
  EXPECT_EQ(balanced_groups({4, 9}, 3), (Groups{{1}, {0}}));  // no empty group
  EXPECT_EQ(balanced_groups({0, 0, 0}, 2), (Groups{{0, 2}, {1}}));
  EXPECT_TRUE(balanced_groups({}, 2).empty());
  EXPECT_EQ(balanced_groups({1, 2}, 0), (Groups{{0, 1}}));  // at least one group
}

}  // namespace
}  // namespace namm
