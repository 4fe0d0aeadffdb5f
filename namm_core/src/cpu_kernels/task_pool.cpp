#include "cpu_kernels/task_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace namm::cpu {
namespace {

class TaskPool {
 public:
  explicit TaskPool(int threads) { Start(threads); }
  ~TaskPool() { Stop(); }

  // Waits for a call in progress (busy_), then replaces the threads.
  void Resize(int threads) {
    std::lock_guard<std::mutex> busy(busy_);
    Stop();
    Start(threads);
  }
  int threads() const { return size_.load(); }

  void Run(int64_t count, const std::function<void(int64_t, int64_t)>& fn) {
    // A call from inside a share (this thread holds busy_ already, or is a pool thread) runs inline: try_lock on
    // a mutex the thread holds is undefined.
    if (inside_) {
      if (count > 0) fn(0, count);
      return;
    }
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    // threads_ is read under busy_, which Resize holds while it changes them.
    const int64_t shares = busy.owns_lock() ? std::min<int64_t>(count, static_cast<int64_t>(threads_.size()) + 1) : 1;
    if (shares <= 1) {
      if (count > 0) fn(0, count);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      count_ = count;
      shares_ = shares;
      pending_ = shares - 1;
      ++generation_;
    }
    wake_.notify_all();
    RunShare(0);
    std::unique_lock<std::mutex> lock(mutex_);
    // Every share is waited for, thrown or not: fn lives in the caller's frame.
    done_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
  }

 private:
  // `threads` in all, the caller's included: threads - 1 of the pool's own. Called with busy_ held (or from the
  // constructor).
  void Start(int threads) {
    uint64_t now = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = false;
      now = generation_;
    }
    // A new thread starts from the current generation, so an earlier call's never looks new to it.
    for (int i = 1; i < std::max(1, threads); ++i) threads_.emplace_back([this, i, now] { Serve(i, now); });
    size_ = std::max(1, threads);
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  // Runs one share; what it throws is kept (the first of the call's) for the caller.
  void RunShare(int64_t share) {
    const int64_t begin = count_ * share / shares_, end = count_ * (share + 1) / shares_;
    if (begin >= end) return;
    inside_ = true;
    try {
      (*fn_)(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failure_) failure_ = std::current_exception();
    }
    inside_ = false;
  }
  static thread_local bool inside_;  // this thread runs a share

  void Serve(int64_t share, uint64_t seen) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (share >= shares_) continue;
      lock.unlock();
      RunShare(share);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex busy_;   // held by the call in progress, and by Resize
  std::mutex mutex_;  // guards what follows
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t count_ = 0, shares_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;  // the first exception of the call in progress
  std::vector<std::thread> threads_;
  std::atomic<int> size_{1};  // threads_.size() + 1, readable from anywhere
};

thread_local bool TaskPool::inside_ = false;

// Process-wide, like libtorch's and OpenBLAS's pools; one thread per core until the budget is set.
TaskPool& Pool() {
  static TaskPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

}  // namespace

void parallel_tasks(int64_t count, const std::function<void(int64_t begin, int64_t end)>& fn) { Pool().Run(count, fn); }

void parallel_work(int64_t count, int64_t work, const std::function<void(int64_t begin, int64_t end)>& fn) {
  if (work < kParallelWork) {
    if (count > 0) fn(0, count);
  } else {
    parallel_tasks(count, fn);
  }
}

void set_task_threads(int threads) { Pool().Resize(threads); }

int task_threads() { return Pool().threads(); }

}  // namespace namm::cpu
