// The incremental stage schedule (spec §7.3-7.5) over run-global generation numbers: which stage a generation
// belongs to, and whether the mean is evaluated there.
//
// Generations are numbered across the whole run (the reference's iteration counter continues across stages).
// The mean is evaluated every `eval_interval` generations and at the first generation of every stage; the
// stage-start evaluation is not eligible to become the stage's best checkpoint (the reference saves ckpt.pt only
// for iter > start_iter), so a stage hands over the best state it actually produced.
#pragma once

#include <cstdint>
#include <vector>

namespace namm::coordinator {

struct ScheduledGeneration {
  int64_t stage = 0;
  int64_t index_in_stage = 0;
  bool stage_start = false;
  bool stage_end = false;        // the stage's last generation
  bool evaluate_mean = false;
  bool eval_eligible = false;    // the evaluation may become the stage's best checkpoint
};

class StageSchedule {
 public:
  StageSchedule(std::vector<int64_t> generations_per_stage, int64_t eval_interval);

  int64_t total_generations() const { return total_; }
  int64_t stages() const { return static_cast<int64_t>(generations_.size()); }
  int64_t first_generation(int64_t stage) const;
  // `generation` in [0, total_generations()).
  ScheduledGeneration At(int64_t generation) const;

 private:
  std::vector<int64_t> generations_;
  int64_t eval_interval_;
  int64_t total_ = 0;
};

}  // namespace namm::coordinator
