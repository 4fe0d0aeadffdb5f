// How much memory a device has, for sizing KV pools (namm-api, namm-worker serve) and for the worker's metrics.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace namm::worker {

struct DeviceMemory {
  int64_t free = 0, total = 0;  // bytes; 0 when unknown
};

// A GPU's free and total memory (cudaMemGetInfo: the whole device's, in a CUDA build), or the host's MemAvailable
// and MemTotal (/proc/meminfo).
DeviceMemory device_memory(const c10::Device& device);

}  // namespace namm::worker
