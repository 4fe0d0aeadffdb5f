// A constant tensor built once per device: building it on the host and copying it for every call would be a
// pageable host-to-device transfer, which on a GPU waits for everything queued before it.
#pragma once

#include <algorithm>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace namm::internal {

class PerDevice {
 public:
  // `build` makes the tensor on the host; On() copies it to each device once.
  explicit PerDevice(std::function<at::Tensor()> build) : build_(std::move(build)) {}

  at::Tensor On(at::Device device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = std::find_if(copies_.begin(), copies_.end(), [&](const auto& c) { return c.first == device; });
    if (it == copies_.end()) {
      copies_.emplace_back(device, build_().to(device).contiguous());
      it = copies_.end() - 1;
    }
    return it->second;
  }

 private:
  std::function<at::Tensor()> build_;
  std::mutex mutex_;
  std::vector<std::pair<at::Device, at::Tensor>> copies_;
};

}  // namespace namm::internal
