// Keeps every token: the base model, and the reference every other policy is normalized by.
#pragma once

#include <string>

#include "namm/policies/memory_policy.h"

namespace namm {

class FullCachePolicy final : public MemoryPolicy {
 public:
  std::string name() const override { return "full"; }
  bool may_evict() const override { return false; }
  std::string prefix_key() const override { return "full"; }  // stateless
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;
};

}  // namespace namm
