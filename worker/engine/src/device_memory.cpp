#include "namm/worker/device_memory.h"

#include <fstream>
#include <string>

#ifdef NAMM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace namm::worker {

DeviceMemory device_memory(const c10::Device& device) {
  DeviceMemory memory;
#ifdef NAMM_WITH_CUDA
  if (device.is_cuda()) {
    int previous = 0;
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device.index()) != cudaSuccess) return memory;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      memory.free = static_cast<int64_t>(free_bytes);
      memory.total = static_cast<int64_t>(total_bytes);
    }
    cudaSetDevice(previous);
    return memory;
  }
#endif
  if (!device.is_cpu()) return memory;
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") memory.free = kib * 1024;
    if (key == "MemTotal:") memory.total = kib * 1024;
  }
  return memory;
}

}  // namespace namm::worker
