#include "namm/coordinator/stage_schedule.h"

#include <numeric>

namespace namm::coordinator {

StageSchedule::StageSchedule(std::vector<int64_t> generations_per_stage, int64_t eval_interval)
    : generations_(std::move(generations_per_stage)),
      eval_interval_(eval_interval),
      total_(std::accumulate(generations_.begin(), generations_.end(), int64_t{0})) {}

int64_t StageSchedule::first_generation(int64_t stage) const {
  return std::accumulate(generations_.begin(), generations_.begin() + stage, int64_t{0});
}

ScheduledGeneration StageSchedule::At(int64_t generation) const {
  ScheduledGeneration s;
  int64_t first = 0;
  while (s.stage + 1 < stages() && generation >= first + generations_[static_cast<std::size_t>(s.stage)]) {
    first += generations_[static_cast<std::size_t>(s.stage)];
    ++s.stage;
  }
  s.index_in_stage = generation - first;
  s.stage_start = s.index_in_stage == 0;
  s.stage_end = s.index_in_stage == generations_[static_cast<std::size_t>(s.stage)] - 1;
  s.evaluate_mean = s.stage_start || generation % eval_interval_ == 0;
  s.eval_eligible = s.evaluate_mean && !s.stage_start;
  return s;
}

}  // namespace namm::coordinator
