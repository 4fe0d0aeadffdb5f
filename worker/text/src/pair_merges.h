// The merge loop shared by the BPE tokenizers: repeatedly merge the adjacent pair with the smallest priority,
// the leftmost one among equal priorities, until no adjacent pair can merge. A priority queue over a linked
// list of symbols makes it O(n log n), so a whole long prompt can be one word (SentencePiece-style tokenizers
// without a pre-tokenizer).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <queue>
#include <tuple>
#include <utility>
#include <vector>

namespace namm::worker {

// lookup(left, right) -> (priority, merged id) if the pair merges. `ids` is rewritten in place.
template <typename Lookup>
void MergePairs(std::vector<int64_t>& ids, const Lookup& lookup) {
  const std::size_t n = ids.size();
  if (n < 2) return;
  std::vector<std::ptrdiff_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (std::size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<std::ptrdiff_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<std::ptrdiff_t>(i + 1) : -1;
  }
  // (priority, left position, left id, right id, merged id); stale entries are skipped when popped.
  using Candidate = std::tuple<double, std::size_t, int64_t, int64_t, int64_t>;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto consider = [&](std::ptrdiff_t left) {
    if (left < 0 || next[static_cast<std::size_t>(left)] < 0) return;
    const auto l = static_cast<std::size_t>(left), r = static_cast<std::size_t>(next[l]);
    if (const std::optional<std::pair<double, int64_t>> merge = lookup(ids[l], ids[r])) {
      queue.emplace(merge->first, l, ids[l], ids[r], merge->second);
    }
  };
  for (std::size_t i = 0; i + 1 < n; ++i) consider(static_cast<std::ptrdiff_t>(i));
  while (!queue.empty()) {
    const auto [priority, l, left_id, right_id, merged] = queue.top();
    queue.pop();
    (void)priority;
    if (!alive[l] || ids[l] != left_id || next[l] < 0 || ids[static_cast<std::size_t>(next[l])] != right_id) continue;
    const auto r = static_cast<std::size_t>(next[l]);
    ids[l] = merged;
    alive[r] = false;
    next[l] = next[r];
    if (next[r] >= 0) prev[static_cast<std::size_t>(next[r])] = static_cast<std::ptrdiff_t>(l);
    consider(prev[l]);
    consider(static_cast<std::ptrdiff_t>(l));
  }
  std::size_t out = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (alive[i]) ids[out++] = ids[i];
  }
  ids.resize(out);
}

}  // namespace namm::worker
