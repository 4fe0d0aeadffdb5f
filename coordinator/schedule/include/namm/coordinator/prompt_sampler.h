// Seeded prompt sampling (spec §7.1 step 2): each generation draws, for each task, a fresh set of distinct
// prompts shared by every candidate. The draw is a pure function of (seed, generation, task), so any
// generation's sample can be recomputed for an audit or a replay (the store also records it).
//
// The reference uses numpy's stateful np.random.choice(n, 64, replace=False); we use a partial Fisher-Yates
// shuffle driven by Philox, keyed by the task's name, so adding a task to a stage does not change the samples
// of the others. A task's variants ("T@budget=16", namm/tasks/task_variant.h) draw their base task's prompts:
// a candidate is scored on the same prompts at every budget, so its per-budget scores pair.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace namm::coordinator {

// `count` distinct row indices of [0, rows) in ascending order (all rows when count >= rows). `stream` is the
// generation (or kEvalStream for the fixed evaluation subset).
std::vector<int64_t> sample_prompts(uint64_t seed, uint64_t stream, const std::string& task, int64_t rows,
                                    int64_t count);

constexpr uint64_t kEvalStream = ~uint64_t{0};

}  // namespace namm::coordinator
