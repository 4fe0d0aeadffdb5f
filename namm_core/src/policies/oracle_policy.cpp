#include "namm/policies/oracle_policy.h"

#include "aten.h"
#include "namm/selection.h"
#include "torch_status.h"

namespace namm {

Result<std::unique_ptr<OraclePolicy>> OraclePolicy::Create(std::vector<std::pair<int64_t, int64_t>> spans) {
  for (const auto& [begin, end] : spans) {
    if (begin < 0 || begin >= end) {
      return Status::InvalidArgument("an oracle span needs 0 <= begin < end, got [" + std::to_string(begin) +
                                     ", " + std::to_string(end) + ")");
    }
  }
  return std::unique_ptr<OraclePolicy>(new OraclePolicy(std::move(spans)));
}

Result<at::Tensor> OraclePolicy::Select(int /*layer*/, LayerKVCache& cache) {
  return internal::catch_torch_errors("oracle select", [&]() -> Result<at::Tensor> {
    const at::Tensor positions = cache.positions();
    at::Tensor evicted = at::zeros(positions.sizes(), positions.options().dtype(at::kBool));
    for (const auto& [begin, end] : spans_)
      evicted.logical_or_(positions.ge(begin).logical_and_(positions.lt(end)));
    const at::Tensor keep = force_keep_newest(evicted.logical_not().to(at::kFloat));
    // Every head holds the same positions, so every head keeps the same count.
    return keep_top_k_per_head(keep, keep.gt(0).sum(1).max().item<int64_t>());
  });
}

Result<std::optional<at::Tensor>> OraclePolicy::EndPrefill(int layer, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(at::Tensor keep, Select(layer, cache));
  return std::optional<at::Tensor>(std::move(keep));
}

}  // namespace namm
