// CMA-ES with the active (negative-weight) rank-mu update, as the reference trains NAMMs (spec §6), after
// Hansen's tutorial (arXiv:1604.00772). Fitness is "higher is better", as in the reference.
//
// Parameters (CmaesParams) are derived once from the dimension and the options; the state (CmaesState) is plain
// data; ask() and tell() are functions of the two. Nothing here knows about storage, networks or NAMMs.
//
// Deliberate differences from the reference, each an option or invisible to the optimization:
//  - State is float64 (the reference: float32 on the GPU). Only the lower triangle of C is stored and updated
//    (C is symmetric by construction, so the reference's symmetrization before eigh is the identity).
//  - The eigendecomposition can be lazy (EigenSchedule::kLazy, Hansen's rule): it is redone only when
//    gap_factor / (N (c_1 + c_mu)) generations have passed since the last one, which keeps a generation at
//    O(lambda N^2). kEveryGeneration decomposes every generation and adds the reference's 1e-6 jitter to every
//    entry of C at generation 0, for parity runs.
//  - A lazy decomposition may also be delayed (eigen_delay > 0): tell() then only requests it, keeping C as it
//    was; the caller decomposes that copy whenever it likes (decompose(), e.g. on another thread) and applies
//    the result when the state reaches the request's generation + eigen_delay (eigen_due(), apply_eigensystem()).
//    Which eigensystem samples which generation is fixed by the schedule, not by timing, so runs stay
//    reproducible while a 9 s decomposition (N = 4172) overlaps the generations that follow it.
//  - Samples come from Philox keyed by (seed, draw index), so the population of a generation is a pure function
//    of the state and the draw index (the reference draws from a stateful torch generator).
//  - tell() whitens a sample with the draw it came from (C^-1/2 y = B z, as y = B D z with the same eigensystem)
//    instead of multiplying y by B D^-1 B^T as the reference does: the same vector, without a lambda x N x N
//    product (up to rounding). Sampled with Whitening::kWithDirections, a population also carries B z_k for every
//    candidate (computed with y_k in one product, off the caller's path), and tell() sums the ranked ones:
//    the same vector again, with other rounding, and no N x N product left in tell().
//  - tell() can leave its O(N^2) covariance update to the caller (CovarianceTiming::kDeferred): the update is
//    kept as data (CovarianceUpdate: the weighted samples, p_c and the decay) and applied later, in order, with
//    the same BLAS calls, so C comes out bit for bit as if applied at once. Nothing but a decomposition reads C,
//    so a trainer applies it on another thread while the next generation runs.
//  - The separable variant (Covariance::kDiagonal, Ros & Hansen 2008) keeps only the diagonal of C, with the
//    learning rates c_1, c_mu multiplied by (N + 2) / 3, for dimensions where an N x N matrix is too large.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "namm/status.h"

namespace namm::coordinator {

enum class EigenSchedule {
  kLazy,             // Hansen's rule: decompose again after gap_factor / (N (c_1 + c_mu)) generations
  kEveryGeneration,  // the reference: every generation, with its generation-0 jitter
};

enum class Covariance {
  kFull,      // N x N covariance (the reference)
  kDiagonal,  // separable CMA-ES: diagonal covariance, O(N) memory and time per sample
};

struct CmaesOptions {
  int64_t population = 32;    // lambda
  double elite_ratio = 0.5;   // mu = max(1, floor(lambda * elite_ratio))
  double sigma0 = 0.065;      // the reference's initial step size (the paper's table says 0.65; the code 0.065)
  double c_m = 1.0;           // learning rate of the mean
  uint64_t seed = 1337;
  EigenSchedule eigen_schedule = EigenSchedule::kLazy;
  // Lazy gap in units of 1 / (N (c_1 + c_mu)) generations. 0.5 is pycma/purecma's choice (the decomposition then
  // costs about as much as the generations it serves); cmaes.m uses 0.1.
  double eigen_gap_factor = 0.5;
  // Lazy schedule, full covariance: generations from requesting a decomposition to applying it (0: tell()
  // decomposes at once).
  int64_t eigen_delay = 0;
  Covariance covariance = Covariance::kFull;
};

// The strategy parameters, derived once (spec §6.1). With N = 4172, lambda = 32: mu_eff = 9.178829,
// c_1 = 1.148340e-7, c_mu = 8.366038e-7, alpha_min = 1.137262, c_sigma = 2.670414e-3, d_sigma = 1.002670,
// c_c = 9.583802e-4, chi_N = 64.587151.
struct CmaesParams {
  int64_t dimension = 0;   // N
  int64_t population = 0;  // lambda
  int64_t mu = 0;
  CmaesOptions options;
  std::vector<double> weights;            // w_i, ranked best first: positives sum to 1, negatives to -alpha_min
  double mu_eff = 0, mu_eff_minus = 0;
  double c_1 = 0, c_mu = 0, alpha_min = 0;
  double c_sigma = 0, d_sigma = 0, c_c = 0, c_m = 1;
  double chi_n = 0;
  // Generations between eigendecompositions (0: every generation).
  double eigen_gap_generations = 0;

  // One line per parameter, for logs.
  std::string Describe() const;
};

// Refuses dimensions < 1, populations < 2, elite ratios outside (0, 1], non-positive sigma0 or c_m, and a full
// covariance too large to store (N^2 doubles must fit a 1 GB SQLite blob: N <= 11180; use kDiagonal beyond).
Result<CmaesParams> make_cmaes_params(int64_t dimension, const CmaesOptions& options);

// The sampling distribution's eigendecomposition C = B diag(D^2) B^T, computed from C at `generation`.
struct Eigensystem {
  int64_t generation = -1;
  // kFull: N x N row-major, row k = the k-th unit eigenvector (B transposed); immutable once computed, so that
  // copies of a state share it. kDiagonal: none (B = I).
  std::shared_ptr<const std::vector<double>> basis;
  std::vector<double> scales;  // D: square roots of the eigenvalues (non-positive eigenvalues become 1e-20 first)
};

// One tell()'s covariance update, as data (full covariance): C <- decay C + c_mu (P^T P - Q^T Q) + c_1 p_c p_c^T,
// with P (Q) the ranked samples of positive (negative) weight scaled by sqrt(|w|).
struct CovarianceUpdate {
  int64_t generation = 0;       // the optimizer generation the tell() reached
  double decay = 1;
  int64_t positive_rows = 0;    // rows [0, positive_rows) of `rows` are P, the rest Q
  std::vector<double> rows;     // [rows, N] row-major
  std::vector<double> path_c;   // p_c after that tell()

  bool operator==(const CovarianceUpdate& other) const;
};

// Applies `update` to `covariance` (laid out as CmaesState::covariance). A pure function of its inputs.
void apply_covariance_update(const CmaesParams& params, const CovarianceUpdate& update,
                             std::vector<double>& covariance);

// Everything that changes during a run. Plain data: copy it, compare it, serialize it.
struct CmaesState {
  int64_t generation = 0;            // g: completed tell() calls
  std::vector<double> mean;          // m
  double sigma = 0;                  // step size
  // kFull: N x N row-major, only the lower triangle (row >= column) is meaningful. kDiagonal: the N variances.
  std::vector<double> covariance;
  // Updates deferred by tell() and not applied yet: C is `covariance` with these applied in order.
  std::vector<CovarianceUpdate> covariance_backlog;
  std::vector<double> path_c;        // p_c
  std::vector<double> path_sigma;    // p_sigma
  Eigensystem eigen;                 // what ask() samples with and tell() whitens with
  // A requested decomposition (eigen_delay > 0): C as it was at optimizer generation pending_generation (-1:
  // none), shared, not copied, by whoever decomposes it; null until the backlog's update of that generation is
  // applied (settle_covariance()).
  int64_t pending_generation = -1;
  std::shared_ptr<const std::vector<double>> pending_covariance;
  std::vector<double> best_member;   // best candidate seen by tell()
  double best_fitness = -std::numeric_limits<double>::infinity();
  int64_t best_generation = -1;      // the g of the tell() that saw it

  bool operator==(const CmaesState& other) const;
};

// The initial state: mean = `initial_mean` (the reference: zeros), sigma = sigma0, C = I, paths zero, and the
// first eigendecomposition done.
Result<CmaesState> initial_cmaes_state(const CmaesParams& params, const std::vector<double>& initial_mean);

// Where tell() gets C^-1/2 y_k = B z_k. Either way is exact up to rounding; a run keeps the one it started with.
enum class Whitening {
  kAtTell,          // tell() multiplies the weighted sum of the ranked z_k by B (one N x N product)
  kWithDirections,  // sampling computes B z_k with y_k (Population::whitened); tell() sums them
};

// One generation's candidates: x_k = m + sigma y_k with y_k = B D z_k, z_k ~ N(0, I).
struct Population {
  int64_t generation = 0;         // the state's g when sampled
  uint64_t draw = 0;              // the draw index the noise came from
  int64_t size = 0, dimension = 0;
  std::vector<double> x;          // [lambda, N] row-major
  std::vector<double> y;          // [lambda, N] row-major
  std::vector<double> z;          // [lambda, N] row-major: the standard normal draws (y = B D z)
  std::vector<double> whitened;   // [lambda, N] row-major: B z (Whitening::kWithDirections, full covariance), or empty

  const double* candidate(int64_t k) const { return x.data() + k * dimension; }
};

// The eigensystem of the covariance `covariance` (laid out as CmaesState::covariance) of optimizer generation
// `generation`. A pure function: safe on any thread.
Result<Eigensystem> decompose(const CmaesParams& params, int64_t generation, const std::vector<double>& covariance);
// Recomputes state.eigen from the state's own covariance, as tell() does outside the lazy schedule (with the
// reference's generation-0 jitter under kEveryGeneration).
Status refresh_eigensystem(const CmaesParams& params, CmaesState& state);
// The eigensystem of C = I at generation 0 under the lazy schedule: exact, without LAPACK.
Eigensystem identity_eigensystem(const CmaesParams& params);
// Whether the requested decomposition must be applied before the next ask().
bool eigen_due(const CmaesParams& params, const CmaesState& state);
// Applies the eigensystem of the pending covariance (refused for another generation's).
Status apply_eigensystem(CmaesState& state, Eigensystem eigen);

// Samples generation `state.generation`'s population from noise block `draw` (a pure function of params,
// state and draw); a due decomposition must have been applied first. The reference's run keys its draws by
// generation; a caller that rewinds the state (the stage hand-over restores an earlier checkpoint) passes a fresh
// draw index so that no noise is reused.
Population ask(const CmaesParams& params, const CmaesState& state, uint64_t draw,
               Whitening whitening = Whitening::kAtTell);
// ask() in two steps: the draws and directions (z, y = B D z, and B z if asked), which need only the
// eigensystem and so can be computed ahead (a lambda x N x N product, 2 lambda x N x N with B z); then the
// candidates x = m + sigma y.
Population sample_directions(const CmaesParams& params, const Eigensystem& eigen, int64_t generation, uint64_t draw,
                             Whitening whitening = Whitening::kAtTell);
void place_candidates(const CmaesState& state, Population* population);

enum class CovarianceTiming {
  kNow,       // tell() updates C
  kDeferred,  // tell() appends its update to state.covariance_backlog (full covariance, lazy delayed schedule;
              // otherwise, or when the schedule needs C at once, it updates C itself)
};

// Whether tell(kDeferred) leaves its covariance update in the backlog under these parameters (full covariance,
// lazy delayed schedule: the only one whose tell() needs no C).
bool defers_covariance_update(const CmaesParams& params);

// Updates the state with the fitness of each candidate of `population` (higher is better; ties keep candidate
// order). Refuses a population sampled from another generation, a wrong number of values, and any non-finite
// fitness (naming the candidate), leaving the state untouched. Ends with the eigendecomposition the schedule
// calls for (or, delayed, its request), so that the next ask() is cheap.
Status tell(const CmaesParams& params, CmaesState& state, const Population& population,
            const std::vector<double>& fitness, CovarianceTiming timing = CovarianceTiming::kNow);

// Applies the state's covariance backlog, in order, taking the pending decomposition's copy of C when its
// generation's update is applied.
void settle_covariance(const CmaesParams& params, CmaesState& state);
// Copies of C taken while applying a backlog (null when the named update was not in it).
struct CovarianceCopies {
  std::shared_ptr<const std::vector<double>> before;  // right before the update of generation copy_before
  std::shared_ptr<const std::vector<double>> after;   // right after the update of generation copy_after
};
// The same on parts of a state held elsewhere (e.g. by another thread): applies `backlog` to `covariance`,
// copying C around the named updates (-1: no copy).
CovarianceCopies apply_covariance_backlog(const CmaesParams& params, const std::vector<CovarianceUpdate>& backlog,
                                          std::vector<double>& covariance, int64_t copy_before, int64_t copy_after);

}  // namespace namm::coordinator
