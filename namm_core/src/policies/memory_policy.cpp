#include "namm/policies/memory_policy.h"

#include <algorithm>
#include <typeinfo>

#include "aten.h"
#include "namm/dtype.h"

namespace namm {

Status MemoryPolicy::BeginSequence(const SequenceInfo& /*info*/) { return Status::Ok(); }

Status MemoryPolicy::Observe(int /*layer*/, const at::Tensor& /*attention*/, int64_t /*first_query*/,
                             LayerKVCache& /*cache*/) {
  return Status::Ok();
}

Result<std::optional<at::Tensor>> MemoryPolicy::EndPrefill(int /*layer*/, LayerKVCache& /*cache*/) {
  return std::optional<at::Tensor>();
}

std::vector<Result<at::Tensor>> MemoryPolicy::SelectTogether(const std::vector<MemoryUpdate>& updates) {
  std::vector<Result<at::Tensor>> kept;
  kept.reserve(updates.size());
  for (const MemoryUpdate& u : updates) kept.push_back(u.policy->Select(u.layer, *u.cache));
  return kept;
}

Status apply_memory_update(MemoryPolicy& policy, int layer, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(at::Tensor keep, policy.Select(layer, cache));
  return cache.Gather(keep);
}

std::vector<Status> apply_memory_updates(const std::vector<MemoryUpdate>& updates) {
  // Updates grouped by their policy's class, each group's first policy selecting for all of it.
  std::vector<Result<at::Tensor>> kept(updates.size(), Result<at::Tensor>(Status::Internal("not selected")));
  std::vector<bool> grouped(updates.size(), false);
  for (std::size_t i = 0; i < updates.size(); ++i) {
    if (grouped[i]) continue;
    std::vector<MemoryUpdate> group;
    std::vector<std::size_t> where;
    for (std::size_t j = i; j < updates.size(); ++j) {
      if (!grouped[j] && typeid(*updates[j].policy) == typeid(*updates[i].policy)) {
        grouped[j] = true;
        group.push_back(updates[j]);
        where.push_back(j);
      }
    }
    std::vector<Result<at::Tensor>> selected = updates[i].policy->SelectTogether(group);
    for (std::size_t g = 0; g < where.size(); ++g) kept[where[g]] = std::move(selected[g]);
  }
  // A gather is a few row copies per head: on the calling thread (waking the pool would cost more).
  std::vector<Status> statuses(updates.size());
  for (std::size_t i = 0; i < updates.size(); ++i) {
    statuses[i] = kept[i].ok() ? updates[i].cache->Gather(*kept[i]) : kept[i].status();
  }
  return statuses;
}

Result<bool> apply_end_of_prefill(MemoryPolicy& policy, int layer, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(std::optional<at::Tensor> keep, policy.EndPrefill(layer, cache));
  if (!keep) return false;
  NAMM_RETURN_IF_ERROR(cache.Gather(*keep));
  return true;
}

Status observe_newest(MemoryPolicy& policy, int layer, const at::Tensor& attention, LayerKVCache& cache) {
  const int64_t rows = attention.defined() && attention.dim() == 3 ? attention.size(1) : 0;
  return policy.Observe(layer, attention, cache.tokens_seen() - rows, cache);
}

std::pair<int64_t, int64_t> prompt_window_rows(const at::Tensor& attention, int64_t first_query,
                                               int64_t prompt_tokens, int64_t window) {
  const int64_t first = first_query, n_q = attention.size(1);
  const int64_t lo = std::max(first, prompt_tokens - window), hi = std::min(first + n_q, prompt_tokens);
  return lo < hi ? std::make_pair(lo - first, hi - first) : std::make_pair(int64_t{0}, int64_t{0});
}

at::Tensor all_token_indices(const LayerKVCache& cache) {
  return at::arange(cache.size(), cache.positions().options())
      .unsqueeze(0)
      .expand({cache.kv_heads(), cache.size()})
      .contiguous();
}

Status validate_observed_attention(const at::Tensor& attention, int64_t first_query, const LayerKVCache& cache) {
  if (!attention.defined() || attention.dim() != 3) {
    return Status::InvalidArgument(
        "attention must be [q_heads, n_queries, n_keys], got " +
        (attention.defined() ? shape_to_string(attention.sizes().vec()) : "nothing"));
  }
  if (!at::isFloatingType(attention.scalar_type())) {
    return Status::InvalidArgument("attention must be floating point");
  }
  if (attention.size(0) % cache.kv_heads() != 0) {
    return Status::InvalidArgument("attention has " + std::to_string(attention.size(0)) +
                                   " query heads, not a multiple of the cache's " +
                                   std::to_string(cache.kv_heads()) + " KV heads");
  }
  if (attention.size(2) != cache.size()) {
    return Status::InvalidArgument("attention covers " + std::to_string(attention.size(2)) +
                                   " keys but the cache holds " + std::to_string(cache.size()) + " tokens");
  }
  if (first_query < 0 || first_query + attention.size(1) > cache.tokens_seen()) {
    return Status::InvalidArgument("queries " + std::to_string(first_query) + ".." +
                                   std::to_string(first_query + attention.size(1) - 1) + " observed, but the cache has seen " +
                                   std::to_string(cache.tokens_seen()) + " tokens (queries must be cached first)");
  }
  return Status::Ok();
}

}  // namespace namm
