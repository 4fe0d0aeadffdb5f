#include "namm/blas_threads.h"

#include <dlfcn.h>

#include <mutex>

namespace namm {

void set_blas_threads(int threads) {
  // Looked up at run time: the program links the generic BLAS interface, whichever library provides it.
  using SetThreads = void (*)(int);
  using GetThreads = int (*)();
  static const auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  static const auto get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  static const int library_default = get != nullptr ? get() : 0;  // read before the first change
  static std::mutex mutex;
  if (set == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex);
  set(threads > 0 ? threads : library_default);
}

}  // namespace namm
