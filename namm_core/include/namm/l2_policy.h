// L2-norm baseline (Devoto et al. 2024): keys with a small L2 norm tend to receive high attention, so keep
// the `budget` tokens per KV head whose (post-RoPE) keys have the lowest L2 norm; the newest token is always
// kept. Needs no attention probabilities. Eviction happens at the engine's memory updates.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "namm/memory_policy.h"

namespace namm {

class L2Policy final : public MemoryPolicy {
 public:
  static Result<std::unique_ptr<L2Policy>> Create(int64_t budget);  // budget: tokens kept per head (> 0)

  std::string name() const override;
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;

 private:
  explicit L2Policy(int64_t budget) : budget_(budget) {}
  int64_t budget_;
};

}  // namespace namm
