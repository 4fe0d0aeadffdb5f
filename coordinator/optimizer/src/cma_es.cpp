#include "namm/coordinator/cma_es.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "dense_linalg.h"
#include "namm/philox.h"

namespace namm::coordinator {

namespace {

// The reference caps the dimension that enters c_1, c_mu and chi_N (n_c = min(N, 40000)).
constexpr int64_t kMaxEffectiveDimension = 40000;
// Largest N whose N x N float64 covariance fits one SQLite blob (1e9 bytes).
constexpr int64_t kMaxFullDimension = 11180;
// Candidates per generation: far beyond any useful population, and a bound on what a spec can make us allocate.
constexpr int64_t kMaxPopulation = 1 << 20;
// Philox counter tag of CMA-ES sampling noise (other streams use other tags).
constexpr uint32_t kSamplingStream = 0x434D4145;  // "CMAE"

double SquaredNorm(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x * x;
  return sum;
}

bool Full(const CmaesParams& p) { return p.options.covariance == Covariance::kFull; }

double EigenvalueScale(double eigenvalue) { return std::sqrt(eigenvalue > 0 ? eigenvalue : 1e-20); }

// The eigensystem of a diagonal covariance: the variances' square roots.
Eigensystem DiagonalEigensystem(int64_t generation, const std::vector<double>& variances) {
  Eigensystem eigen;
  eigen.generation = generation;
  eigen.scales.resize(variances.size());
  for (std::size_t i = 0; i < variances.size(); ++i) eigen.scales[i] = EigenvalueScale(variances[i]);
  return eigen;
}

// Recomputes state.eigen from state.covariance (at state.generation).
Status Decompose(const CmaesParams& p, CmaesState& s) {
  if (!Full(p)) {
    s.eigen = DiagonalEigensystem(s.generation, s.covariance);
    return Status::Ok();
  }
  std::vector<double> c = s.covariance;
  if (p.options.eigen_schedule == EigenSchedule::kEveryGeneration && s.generation == 0) {
    // The reference's generation-0 jitter: 1e-6 added to every entry of C (only the lower triangle is read).
    const int64_t n = p.dimension;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j <= i; ++j) c[static_cast<std::size_t>(i * n + j)] += 1e-6;
    }
  }
  NAMM_ASSIGN_OR_RETURN(s.eigen, decompose(p, s.generation, c));
  return Status::Ok();
}

bool Lazy(const CmaesParams& p) { return Full(p) && p.options.eigen_schedule == EigenSchedule::kLazy; }

}  // namespace

std::string CmaesParams::Describe() const {
  std::ostringstream out;
  out.precision(7);
  out << "CMA-ES N=" << dimension << " lambda=" << population << " mu=" << mu << " mu_eff=" << mu_eff
      << " mu_eff-=" << mu_eff_minus << " c_1=" << c_1 << " c_mu=" << c_mu << " alpha_min=" << alpha_min
      << " c_sigma=" << c_sigma << " d_sigma=" << d_sigma << " c_c=" << c_c << " c_m=" << c_m << " chi_N=" << chi_n
      << " sigma0=" << options.sigma0 << " covariance=" << (Full(*this) ? "full" : "diagonal")
      << " eigen_gap_generations=" << eigen_gap_generations;
  return out.str();
}

Result<CmaesParams> make_cmaes_params(int64_t dimension, const CmaesOptions& o) {
  if (dimension < 1) return Status::InvalidArgument("CMA-ES needs a dimension >= 1, got " + std::to_string(dimension));
  if (o.population < 2 || o.population > kMaxPopulation) {
    return Status::InvalidArgument("CMA-ES needs a population of 2 to " + std::to_string(kMaxPopulation) + ", got " +
                                   std::to_string(o.population));
  }
  if (!(o.elite_ratio > 0 && o.elite_ratio <= 1)) {
    return Status::InvalidArgument("the elite ratio must be in (0, 1], got " + std::to_string(o.elite_ratio));
  }
  if (!(o.sigma0 > 0) || !std::isfinite(o.sigma0)) {
    return Status::InvalidArgument("sigma0 must be positive and finite, got " + std::to_string(o.sigma0));
  }
  if (!(o.c_m > 0) || !std::isfinite(o.c_m)) return Status::InvalidArgument("c_m must be positive and finite");
  if (!(o.eigen_gap_factor >= 0) || !std::isfinite(o.eigen_gap_factor)) {
    return Status::InvalidArgument("the eigendecomposition gap factor must be >= 0");
  }
  if (o.eigen_delay < 0 || o.eigen_delay > 100000) {
    return Status::InvalidArgument("the eigendecomposition delay must be 0 to 100000 generations, got " +
                                   std::to_string(o.eigen_delay));
  }
  if (o.covariance == Covariance::kFull && dimension > kMaxFullDimension) {
    return Status::InvalidArgument("a full covariance of dimension " + std::to_string(dimension) +
                                   " does not fit one stored blob (limit " + std::to_string(kMaxFullDimension) +
                                   "); use the diagonal (separable) covariance");
  }
  CmaesParams p;
  p.dimension = dimension;
  p.population = o.population;
  p.options = o;
  p.mu = std::max<int64_t>(1, static_cast<int64_t>(std::floor(static_cast<double>(o.population) * o.elite_ratio)));
  const double n = static_cast<double>(dimension);
  const double nc = static_cast<double>(std::min(dimension, kMaxEffectiveDimension));
  const double lambda = static_cast<double>(o.population);

  std::vector<double> raw(static_cast<std::size_t>(o.population));
  for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = std::log((lambda + 1) / 2) - std::log(static_cast<double>(i) + 1);
  auto effective = [](auto begin, auto end) {
    double sum = 0, squares = 0;
    for (auto it = begin; it != end; ++it) {
      sum += *it;
      squares += *it * *it;
    }
    return squares > 0 ? sum * sum / squares : 0.0;
  };
  const auto mu_end = raw.begin() + p.mu;
  p.mu_eff = effective(raw.begin(), mu_end);
  p.mu_eff_minus = effective(mu_end, raw.end());

  p.c_1 = 2 / ((nc + 1.3) * (nc + 1.3) + p.mu_eff);
  p.c_mu = std::min(1 - p.c_1 - 1e-8, 2 * (p.mu_eff - 2 + 1 / p.mu_eff) / ((nc + 2) * (nc + 2) + p.mu_eff));
  if (o.covariance == Covariance::kDiagonal) {
    const double boost = (n + 2) / 3;  // Ros & Hansen 2008
    p.c_1 = std::min(p.c_1 * boost, 0.5);
    p.c_mu = std::min(1 - p.c_1 - 1e-8, p.c_mu * boost);
  }
  p.alpha_min = std::min({1 + p.c_1 / p.c_mu, 1 + 2 * p.mu_eff_minus / (p.mu_eff + 2),
                          (1 - p.c_1 - p.c_mu) / (n * p.c_mu)});
  double positive = 0, negative = 0;
  for (double w : raw) (w >= 0 ? positive : negative) += std::abs(w);
  p.weights.resize(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) {
    p.weights[i] = raw[i] >= 0 ? raw[i] / positive : p.alpha_min * raw[i] / negative;
  }
  p.c_sigma = (p.mu_eff + 2) / (n + p.mu_eff + 5);
  p.d_sigma = 1 + 2 * std::max(0.0, std::sqrt((p.mu_eff - 1) / (n + 1)) - 1) + p.c_sigma;
  p.c_c = (4 + p.mu_eff / n) / (n + 4 + 2 * p.mu_eff / n);
  p.c_m = o.c_m;
  p.chi_n = std::sqrt(n) * (1 - 1 / (4 * n) + 1 / (21 * nc * nc));
  p.eigen_gap_generations =
      o.eigen_schedule == EigenSchedule::kEveryGeneration ? 0.0 : o.eigen_gap_factor / (n * (p.c_1 + p.c_mu));
  return p;
}

bool CmaesState::operator==(const CmaesState& o) const {
  const bool same_pending = pending_generation == o.pending_generation &&
                            (pending_covariance == o.pending_covariance ||
                             (pending_covariance && o.pending_covariance && *pending_covariance == *o.pending_covariance));
  return generation == o.generation && mean == o.mean && sigma == o.sigma && covariance == o.covariance &&
         covariance_backlog == o.covariance_backlog && path_c == o.path_c && path_sigma == o.path_sigma && eigen.generation == o.eigen.generation &&
         (eigen.basis == o.eigen.basis || (eigen.basis && o.eigen.basis && *eigen.basis == *o.eigen.basis)) &&
         eigen.scales == o.eigen.scales && same_pending &&
         best_member == o.best_member && best_fitness == o.best_fitness && best_generation == o.best_generation;
}

bool CovarianceUpdate::operator==(const CovarianceUpdate& o) const {
  return generation == o.generation && decay == o.decay && positive_rows == o.positive_rows && rows == o.rows &&
         path_c == o.path_c;
}

void apply_covariance_update(const CmaesParams& p, const CovarianceUpdate& u, std::vector<double>& covariance) {
  const int64_t n = p.dimension;
  const int64_t rows = static_cast<int64_t>(u.rows.size()) / n;
  double* c = covariance.data();
  linalg::symmetric_rank_k(n, u.positive_rows, p.c_mu, u.rows.data(), u.decay, c);
  if (rows > u.positive_rows) {
    linalg::symmetric_rank_k(n, rows - u.positive_rows, -p.c_mu, u.rows.data() + u.positive_rows * n, 1.0, c);
  }
  linalg::symmetric_rank_1(n, p.c_1, u.path_c.data(), c);
}

CovarianceCopies apply_covariance_backlog(const CmaesParams& p, const std::vector<CovarianceUpdate>& backlog,
                                          std::vector<double>& covariance, int64_t copy_before, int64_t copy_after) {
  CovarianceCopies copies;
  for (const CovarianceUpdate& u : backlog) {
    if (u.generation == copy_before) copies.before = std::make_shared<const std::vector<double>>(covariance);
    apply_covariance_update(p, u, covariance);
    if (u.generation == copy_after) copies.after = std::make_shared<const std::vector<double>>(covariance);
  }
  return copies;
}

void settle_covariance(const CmaesParams& p, CmaesState& s) {
  auto copy = apply_covariance_backlog(p, s.covariance_backlog, s.covariance, -1,
                                       s.pending_covariance ? -1 : s.pending_generation).after;
  if (copy) s.pending_covariance = std::move(copy);
  s.covariance_backlog.clear();
}

Result<Eigensystem> decompose(const CmaesParams& p, int64_t generation, const std::vector<double>& covariance) {
  const int64_t n = p.dimension;
  if (!Full(p)) return DiagonalEigensystem(generation, covariance);
  Eigensystem eigen;
  eigen.generation = generation;
  std::vector<double> eigenvalues, basis;
  NAMM_RETURN_IF_ERROR(linalg::symmetric_eigen(n, covariance, &eigenvalues, &basis));
  eigen.basis = std::make_shared<const std::vector<double>>(std::move(basis));
  eigen.scales.resize(eigenvalues.size());
  for (std::size_t i = 0; i < eigenvalues.size(); ++i) eigen.scales[i] = EigenvalueScale(eigenvalues[i]);
  return eigen;
}

Status refresh_eigensystem(const CmaesParams& p, CmaesState& s) { return Decompose(p, s); }

Eigensystem identity_eigensystem(const CmaesParams& p) {
  const auto n = static_cast<std::size_t>(p.dimension);
  Eigensystem eigen;
  eigen.generation = 0;
  auto identity = std::make_shared<std::vector<double>>(n * n, 0.0);
  for (std::size_t i = 0; i < n; ++i) (*identity)[i * n + i] = 1.0;
  eigen.basis = std::move(identity);
  eigen.scales.assign(n, 1.0);
  return eigen;
}

bool eigen_due(const CmaesParams& p, const CmaesState& s) {
  return s.pending_generation >= 0 && s.generation >= s.pending_generation + p.options.eigen_delay;
}

Status apply_eigensystem(CmaesState& s, Eigensystem eigen) {
  if (s.pending_generation < 0 || eigen.generation != s.pending_generation) {
    return Status::FailedPrecondition("an eigensystem of generation " + std::to_string(eigen.generation) +
                                      " does not match the requested decomposition (" +
                                      std::to_string(s.pending_generation) + ")");
  }
  s.eigen = std::move(eigen);
  s.pending_generation = -1;
  s.pending_covariance.reset();
  return Status::Ok();
}

Result<CmaesState> initial_cmaes_state(const CmaesParams& p, const std::vector<double>& initial_mean) {
  const auto n = static_cast<std::size_t>(p.dimension);
  if (initial_mean.size() != n) {
    return Status::InvalidArgument("the initial mean has " + std::to_string(initial_mean.size()) +
                                   " values, the problem " + std::to_string(n));
  }
  if (!std::all_of(initial_mean.begin(), initial_mean.end(), [](double v) { return std::isfinite(v); })) {
    return Status::InvalidArgument("the initial mean has a non-finite value");
  }
  CmaesState s;
  s.mean = initial_mean;
  s.sigma = p.options.sigma0;
  s.covariance.assign(Full(p) ? n * n : n, 0.0);
  for (std::size_t i = 0; i < n; ++i) s.covariance[Full(p) ? i * n + i : i] = 1.0;
  s.path_c.assign(n, 0.0);
  s.path_sigma.assign(n, 0.0);
  s.best_member = initial_mean;
  if (Lazy(p)) {
    s.eigen = identity_eigensystem(p);
  } else {
    NAMM_RETURN_IF_ERROR(Decompose(p, s));
  }
  return s;
}

Population sample_directions(const CmaesParams& p, const Eigensystem& eigen, int64_t generation, uint64_t draw,
                             Whitening whitening) {
  const int64_t n = p.dimension, lambda = p.population;
  Population pop;
  pop.generation = generation;
  pop.draw = draw;
  pop.size = lambda;
  pop.dimension = n;
  // z, and z scaled by D, row by row; each Philox block gives the normals of coordinates 2j and 2j + 1.
  pop.z.resize(static_cast<std::size_t>(lambda * n));
  // Rows [0, lambda): D z_k; with the whitened directions, rows [lambda, 2 lambda): z_k (one product for both).
  const bool whiten = whitening == Whitening::kWithDirections && Full(p);
  std::vector<double> scaled(static_cast<std::size_t>((whiten ? 2 : 1) * lambda * n));
  for (int64_t k = 0; k < lambda; ++k) {
    for (int64_t j = 0; 2 * j < n; ++j) {
      const PhiloxCounter counter{static_cast<uint32_t>(j), static_cast<uint32_t>(k), static_cast<uint32_t>(draw),
                                  kSamplingStream ^ static_cast<uint32_t>(draw >> 32)};
      const auto z = philox_normal_pair(counter, p.options.seed);
      for (int64_t t = 0; t < 2 && 2 * j + t < n; ++t) {
        const auto at = static_cast<std::size_t>(k * n + 2 * j + t);
        pop.z[at] = z[static_cast<std::size_t>(t)];
        scaled[at] = z[static_cast<std::size_t>(t)] * eigen.scales[static_cast<std::size_t>(2 * j + t)];
        if (whiten) scaled[static_cast<std::size_t>(lambda * n) + at] = z[static_cast<std::size_t>(t)];
      }
    }
  }
  if (Full(p)) {
    // y_k = B (D z_k): with the eigenvectors as rows of E, Y = (Z D) E (and B z_k: Z E).
    std::vector<double> product(scaled.size());
    linalg::matmul(static_cast<int64_t>(scaled.size()) / n, n, n, 1.0, scaled.data(), false, eigen.basis->data(), false,
                   0.0, product.data());
    if (whiten) pop.whitened.assign(product.begin() + lambda * n, product.end());
    product.resize(static_cast<std::size_t>(lambda * n));
    pop.y = std::move(product);
  } else {
    pop.y = std::move(scaled);
  }
  return pop;
}

void place_candidates(const CmaesState& s, Population* pop) {
  const int64_t n = pop->dimension;
  pop->x.resize(pop->y.size());
  for (int64_t k = 0; k < pop->size; ++k) {
    for (int64_t i = 0; i < n; ++i) {
      const auto at = static_cast<std::size_t>(k * n + i);
      pop->x[at] = s.mean[static_cast<std::size_t>(i)] + s.sigma * pop->y[at];
    }
  }
}

Population ask(const CmaesParams& p, const CmaesState& s, uint64_t draw, Whitening whitening) {
  Population pop = sample_directions(p, s.eigen, s.generation, draw, whitening);
  place_candidates(s, &pop);
  return pop;
}

bool defers_covariance_update(const CmaesParams& p) { return Lazy(p) && p.options.eigen_delay > 0; }

Status tell(const CmaesParams& p, CmaesState& s, const Population& pop, const std::vector<double>& fitness,
            CovarianceTiming timing) {
  const int64_t n = p.dimension, lambda = p.population;
  if (pop.generation != s.generation) {
    return Status::FailedPrecondition("the population was sampled at generation " + std::to_string(pop.generation) +
                                      " but the optimizer is at generation " + std::to_string(s.generation));
  }
  if (pop.size != lambda || pop.dimension != n || static_cast<int64_t>(fitness.size()) != lambda ||
      pop.z.size() != pop.y.size() || (!pop.whitened.empty() && pop.whitened.size() != pop.y.size())) {
    return Status::InvalidArgument("tell() needs " + std::to_string(lambda) + " fitness values for " +
                                   std::to_string(lambda) + " candidates of dimension " + std::to_string(n) + ", got " +
                                   std::to_string(fitness.size()) + " values for " + std::to_string(pop.size) + "x" +
                                   std::to_string(pop.dimension));
  }
  for (std::size_t k = 0; k < fitness.size(); ++k) {
    if (!std::isfinite(fitness[k])) {
      return Status::InvalidArgument("fitness of candidate " + std::to_string(k) + " is " + std::to_string(fitness[k]) +
                                     "; non-finite fitness is refused, not folded into the optimizer");
    }
  }
  const auto N = static_cast<std::size_t>(n);
  std::vector<int64_t> order(static_cast<std::size_t>(lambda));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return fitness[static_cast<std::size_t>(a)] > fitness[static_cast<std::size_t>(b)];
  });
  auto y_of = [&](int64_t rank) { return pop.y.data() + order[static_cast<std::size_t>(rank)] * n; };
  const int64_t g = s.generation + 1;

  // <y>_w over the mu best, and the whitened samples (D^-1 B^T y_(i), whose norm is that of C^-1/2 y_(i)).
  std::vector<double> y_w(N, 0.0);
  for (int64_t r = 0; r < p.mu; ++r) {
    const double w = p.weights[static_cast<std::size_t>(r)];
    const double* y = y_of(r);
    for (std::size_t i = 0; i < N; ++i) y_w[i] += w * y[i];
  }
  std::vector<double> sorted_y(static_cast<std::size_t>(lambda * n));
  for (int64_t r = 0; r < lambda; ++r) std::copy(y_of(r), y_of(r) + n, sorted_y.begin() + r * n);
  // D^-1 B^T y = z: the draws themselves, sorted.
  std::vector<double> whitened(sorted_y.size());
  for (int64_t r = 0; r < lambda; ++r) {
    const double* z = pop.z.data() + order[static_cast<std::size_t>(r)] * n;
    std::copy(z, z + n, whitened.begin() + r * n);
  }
  // C^-1/2 <y>_w = B D^-1 B^T <y>_w = B (sum_r w_r whitened_r).
  std::vector<double> whitened_w(N, 0.0);
  for (int64_t r = 0; r < p.mu; ++r) {
    const double w = p.weights[static_cast<std::size_t>(r)];
    for (std::size_t j = 0; j < N; ++j) whitened_w[j] += w * whitened[static_cast<std::size_t>(r) * N + j];
  }
  std::vector<double> inv_sqrt_y_w(N, 0.0);
  if (Full(p) && !pop.whitened.empty()) {
    for (int64_t r = 0; r < p.mu; ++r) {  // sum_r w_r B z_(r)
      const double w = p.weights[static_cast<std::size_t>(r)];
      const double* bz = pop.whitened.data() + order[static_cast<std::size_t>(r)] * n;
      for (std::size_t i = 0; i < N; ++i) inv_sqrt_y_w[i] += w * bz[i];
    }
  } else if (Full(p)) {
    linalg::matmul(1, n, n, 1.0, whitened_w.data(), false, s.eigen.basis->data(), false, 0.0, inv_sqrt_y_w.data());
  } else {
    inv_sqrt_y_w = whitened_w;
  }

  for (std::size_t i = 0; i < N; ++i) s.mean[i] += p.c_m * s.sigma * y_w[i];
  const double sigma_gain = std::sqrt(p.c_sigma * (2 - p.c_sigma) * p.mu_eff);
  for (std::size_t i = 0; i < N; ++i) s.path_sigma[i] = (1 - p.c_sigma) * s.path_sigma[i] + sigma_gain * inv_sqrt_y_w[i];
  const double ps_norm = std::sqrt(SquaredNorm(s.path_sigma));
  const double h_sigma =
      ps_norm / std::sqrt(1 - std::pow(1 - p.c_sigma, 2.0 * static_cast<double>(g))) <
              (1.4 + 2 / (static_cast<double>(n) + 1)) * p.chi_n
          ? 1.0
          : 0.0;
  const double c_gain = h_sigma * std::sqrt(p.c_c * (2 - p.c_c) * p.mu_eff);
  for (std::size_t i = 0; i < N; ++i) s.path_c[i] = (1 - p.c_c) * s.path_c[i] + c_gain * y_w[i];

  // Active rank-mu update: negative weights are rescaled by N / ||C^-1/2 y||^2 (spec §6.4 step 6).
  std::vector<double> w_adjusted(static_cast<std::size_t>(lambda));
  double weight_sum = 0;
  for (int64_t r = 0; r < lambda; ++r) {
    const double w = p.weights[static_cast<std::size_t>(r)];
    weight_sum += w;
    double norm2 = 0;
    for (std::size_t j = 0; j < N; ++j) norm2 += whitened[static_cast<std::size_t>(r) * N + j] * whitened[static_cast<std::size_t>(r) * N + j];
    w_adjusted[static_cast<std::size_t>(r)] = w >= 0 ? w : w * static_cast<double>(n) / (norm2 + 1e-20);
  }
  const double delta = (1 - h_sigma) * p.c_c * (2 - p.c_c);
  const double decay = 1 + p.c_1 * delta - p.c_1 - p.c_mu * weight_sum;
  const bool defer = timing == CovarianceTiming::kDeferred && defers_covariance_update(p);
  if (Full(p)) {
    // Rows scaled by sqrt(|w|): the positive and the negative parts are two symmetric rank-k updates.
    CovarianceUpdate update;
    update.generation = g;
    update.decay = decay;
    update.rows.reserve(static_cast<std::size_t>(lambda) * N);
    for (const bool positive : {true, false}) {
      for (int64_t r = 0; r < lambda; ++r) {
        const double w = w_adjusted[static_cast<std::size_t>(r)];
        if (w == 0 || (w > 0) != positive) continue;
        const double scale = std::sqrt(std::abs(w));
        for (std::size_t j = 0; j < N; ++j) update.rows.push_back(scale * sorted_y[static_cast<std::size_t>(r) * N + j]);
        if (positive) ++update.positive_rows;
      }
    }
    update.path_c = s.path_c;
    s.covariance_backlog.push_back(std::move(update));
    if (!defer) settle_covariance(p, s);
  } else {
    for (std::size_t i = 0; i < N; ++i) {
      double rank_mu = 0;
      for (int64_t r = 0; r < lambda; ++r) {
        const double y = sorted_y[static_cast<std::size_t>(r) * N + i];
        rank_mu += w_adjusted[static_cast<std::size_t>(r)] * y * y;
      }
      s.covariance[i] = decay * s.covariance[i] + p.c_1 * s.path_c[i] * s.path_c[i] + p.c_mu * rank_mu;
    }
  }
  s.sigma *= std::exp((p.c_sigma / p.d_sigma) * (ps_norm / p.chi_n - 1));

  const int64_t best = order[0];
  if (fitness[static_cast<std::size_t>(best)] > s.best_fitness) {
    s.best_fitness = fitness[static_cast<std::size_t>(best)];
    s.best_member.assign(pop.candidate(best), pop.candidate(best) + n);
    s.best_generation = pop.generation;
  }
  s.generation = g;
  if (!Lazy(p)) return Decompose(p, s);
  // One request at a time, gap generations after the last.
  if (s.pending_generation < 0 && static_cast<double>(g - s.eigen.generation) > p.eigen_gap_generations) {
    s.pending_generation = g;
    // Deferred: settle_covariance() copies C once this generation's update is applied.
    if (!defer) s.pending_covariance = std::make_shared<const std::vector<double>>(s.covariance);
  }
  if (p.options.eigen_delay == 0 && s.pending_generation >= 0) {  // else the caller applies it when due
    NAMM_ASSIGN_OR_RETURN(Eigensystem eigen, decompose(p, s.pending_generation, *s.pending_covariance));
    return apply_eigensystem(s, std::move(eigen));
  }
  return Status::Ok();
}

}  // namespace namm::coordinator
