// The reference's checkpoint, `ckpt.pt` (spec §7.7): what its Python code saves with torch.save and loads to
// resume or evaluate, written from and read into our CMA-ES state without a tensor library (torch_archive.h).
//
//   {'evolution_state': {mu_eff, weights, weights_truncated, g, best_member, best_fitness, evo_path_c,
//                        evo_path_sigma, mean, sigma, C, sample_C, sample_B, sample_D, x, y,
//                        stored_buffers_to_save.token_embedding_0_{online_new_output_,output_}{mean,var,num}},
//    'iter_num': int, 'best_val_loss': float}
//
// Every entry of the state is a float32 tensor, as the reference keeps them (0-dimensional for scalars).
// Where we differ, deliberately:
//  - C is the settled covariance (its backlog applied); sample_C is C itself and sample_B, sample_D the state's
//    eigendecomposition, or that of C when the state has none (the reference's ask() decomposes C again every
//    generation, so they are recomputed before use). A separable (diagonal) run's C is written as the full
//    diagonal matrix, B = I.
//  - x and y, the last population, are not part of our state: zeros (the reference's ask() overwrites them).
//  - The normalization statistics: the consolidated ones (`output_*`) are ours, mean and var [1, 1, 1, 17] and num
//    the sample count repeated for each of the 17 features; the running ones (`online_new_output_*`) are their
//    initial scalar 0, as after the reference's merge.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "namm/coordinator/cma_es.h"
#include "namm/norm_stats.h"
#include "namm/status.h"

namespace namm::coordinator {

// What a reference checkpoint holds that a NAMM or a run can use.
struct ReferenceCheckpoint {
  int64_t iter_num = 0;
  double best_val_loss = 0;
  int64_t generation = 0;             // g
  std::vector<double> mean;           // the solution (spec §6.5)
  std::vector<double> best_member;    // the best candidate seen
  double sigma = 0;
  double best_fitness = 0;
  std::optional<NormStats> norm_stats;  // the consolidated statistics, when any were collected (num > 0)
};

// Writes the whole reference state of `state`, a complete one (with its covariance: a snapshot's, not a light
// checkpoint's), to `path`.
Status write_reference_checkpoint(const std::string& path, const CmaesParams& params, const CmaesState& state,
                                  const std::optional<NormStats>& norm_stats, int64_t iter_num,
                                  double best_val_loss);

// Reads a reference checkpoint (written by its Python code or by write_reference_checkpoint). Corruption naming the
// file and the entry for a missing entry, a wrong shape or dtype, or a non-finite number.
Result<ReferenceCheckpoint> read_reference_checkpoint(const std::string& path);

}  // namespace namm::coordinator
