#include "namm/coordinator/prompt_sampler.h"

#include <algorithm>
#include <numeric>

#include "namm/philox.h"
#include "namm/tasks/task_variant.h"

namespace namm::coordinator {

namespace {

constexpr uint32_t kPromptStream = 0x50524D50;  // "PRMP"

// FNV-1a: a stable 64-bit name hash (std::hash may differ between standard libraries).
uint64_t NameHash(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

std::vector<int64_t> sample_prompts(uint64_t seed, uint64_t stream, const std::string& task, int64_t rows,
                                    int64_t count) {
  std::vector<int64_t> order(static_cast<std::size_t>(std::max<int64_t>(rows, 0)));
  std::iota(order.begin(), order.end(), 0);
  if (count >= rows) return order;
  const uint64_t key = seed ^ NameHash(tasks::base_task(task));
  for (int64_t i = 0; i < count; ++i) {
    const PhiloxCounter counter{static_cast<uint32_t>(i), static_cast<uint32_t>(stream),
                                static_cast<uint32_t>(stream >> 32), kPromptStream};
    const auto j = i + static_cast<int64_t>(philox_uniform(counter, key) * static_cast<double>(rows - i));
    std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(j)]);
  }
  order.resize(static_cast<std::size_t>(count));
  std::sort(order.begin(), order.end());
  return order;
}

}  // namespace namm::coordinator
