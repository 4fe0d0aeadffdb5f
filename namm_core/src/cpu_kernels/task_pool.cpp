#include "cpu_kernels/task_pool.h"

#include <algorithm>
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
  TaskPool() {
    const int64_t threads = std::max<int64_t>(1, std::thread::hardware_concurrency()) - 1;
    for (int64_t i = 0; i < threads; ++i) threads_.emplace_back([this, i] { Serve(i + 1); });
  }
  ~TaskPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void Run(int64_t count, const std::function<void(int64_t, int64_t)>& fn) {
    // A call from inside a share (this thread holds busy_ already, or is a pool thread) runs inline: try_lock on
    // a mutex the thread holds is undefined.
    if (inside_) {
      if (count > 0) fn(0, count);
      return;
    }
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    const int64_t shares = std::min<int64_t>(count, static_cast<int64_t>(threads_.size()) + 1);
    if (!busy.owns_lock() || shares <= 1) {
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

  void Serve(int64_t share) {
    uint64_t seen = 0;
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

  std::mutex busy_;   // held by the call in progress
  std::mutex mutex_;  // guards what follows
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t count_ = 0, shares_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;  // the first exception of the call in progress
  std::vector<std::thread> threads_;
};

thread_local bool TaskPool::inside_ = false;

}  // namespace

void parallel_tasks(int64_t count, const std::function<void(int64_t begin, int64_t end)>& fn) {
  static TaskPool pool;  // process-wide, like libtorch's and OpenBLAS's thread pools
  pool.Run(count, fn);
}

}  // namespace namm::cpu
