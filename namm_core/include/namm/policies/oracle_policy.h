// An evaluation ceiling, not a memory policy one could deploy: evicts exactly the tokens whose absolute
// positions a synthetic row marks as irrelevant (its interruption), at every memory update and at the end of
// prefill, and keeps everything else. It tells whether a task is worth training a NAMM on: if evicting the
// marked tokens does not recover the clean score, no policy can.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "namm/policies/memory_policy.h"

namespace namm {

class OraclePolicy final : public MemoryPolicy {
 public:
  // spans: [begin, end) absolute positions to evict, begin < end.
  static Result<std::unique_ptr<OraclePolicy>> Create(std::vector<std::pair<int64_t, int64_t>> spans);

  std::string name() const override { return "oracle"; }
  // Every token outside the spans (the newest always).
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override;
  Result<std::optional<at::Tensor>> EndPrefill(int layer, LayerKVCache& cache) override;

 private:
  explicit OraclePolicy(std::vector<std::pair<int64_t, int64_t>> spans) : spans_(std::move(spans)) {}
  std::vector<std::pair<int64_t, int64_t>> spans_;
};

}  // namespace namm
