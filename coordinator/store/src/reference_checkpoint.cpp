#include "namm/coordinator/reference_checkpoint.h"

#include <cmath>
#include <limits>

#include "namm/feature_constants.h"
#include "namm/torch_archive.h"

namespace namm::coordinator {

namespace {

constexpr const char* kStatsPrefix = "stored_buffers_to_save.token_embedding_0_";

TorchValue Scalar(double v) { return TorchValue::Tensor(TorchTensor::FromFloats({v}, {})); }
TorchValue Vector(const std::vector<double>& v) {
  return TorchValue::Tensor(TorchTensor::FromFloats(v, {static_cast<int64_t>(v.size())}));
}
TorchValue Matrix(const std::vector<double>& v, int64_t rows, int64_t columns) {
  return TorchValue::Tensor(TorchTensor::FromFloats(v, {rows, columns}));
}

// C as a full symmetric N x N matrix, from the settled state's (full: lower triangle; diagonal: variances).
std::vector<double> FullCovariance(const CmaesParams& params, const std::vector<double>& covariance) {
  const auto n = static_cast<std::size_t>(params.dimension);
  const bool diagonal = params.options.covariance == Covariance::kDiagonal;
  std::vector<double> c(n * n, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    if (diagonal) c[i * n + i] = covariance[i];
    for (std::size_t j = 0; !diagonal && j <= i; ++j) c[i * n + j] = c[j * n + i] = covariance[i * n + j];
  }
  return c;
}

// B with the eigenvectors as columns (ours are rows), identity without a basis (diagonal).
std::vector<double> EigenvectorColumns(const CmaesParams& params, const Eigensystem& eigen) {
  const auto n = static_cast<std::size_t>(params.dimension);
  std::vector<double> b(n * n, 0.0);
  const bool basis = eigen.basis != nullptr && eigen.basis->size() == n * n;
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t k = 0; k < n; ++k) b[i * n + k] = basis ? (*eigen.basis)[k * n + i] : (i == k ? 1.0 : 0.0);
  }
  return b;
}

Status Bad(const std::string& path, const std::string& what) {
  return Status::Corruption(path + " is not a reference checkpoint namm can read: " + what);
}

// A count stored as a float: a whole number from 0 to 2^53 (where doubles stop holding every integer).
Result<int64_t> Count(double v, const std::string& what, const std::string& path) {
  if (!(v >= 0 && v <= 9007199254740992.0) || v != std::floor(v)) {
    return Bad(path, what + " is " + std::to_string(v) + ", not a whole number from 0 to 2^53");
  }
  return static_cast<int64_t>(v);
}

// A float tensor entry of `state` with `numel` elements (any shape), finite.
Result<std::vector<double>> Floats(const TorchValue& state, const std::string& key, int64_t numel,
                                   const std::string& path) {
  const TorchValue* v = state.Find(key);
  if (v == nullptr) return Bad(path, "evolution_state has no '" + key + "'");
  if (v->kind != TorchValue::Kind::kTensor) {
    return Bad(path, "evolution_state['" + key + "'] is a " + v->kind_name() + ", not a tensor");
  }
  const DType dtype = v->tensor.dtype;
  if (dtype != DType::kF32 && dtype != DType::kF64 && dtype != DType::kI64) {
    return Bad(path, "evolution_state['" + key + "'] is not a float32, float64 or int64 tensor");
  }
  if (numel >= 0 && v->tensor.numel() != numel) {
    return Bad(path, "evolution_state['" + key + "'] has shape " + shape_to_string(v->tensor.shape) + ", " +
                         std::to_string(numel) + " elements expected");
  }
  std::vector<double> out = v->tensor.ToDoubles();
  for (double x : out) {
    if (!std::isfinite(x)) return Bad(path, "evolution_state['" + key + "'] holds a non-finite number");
  }
  return out;
}

}  // namespace

Status write_reference_checkpoint(const std::string& path, const CmaesParams& params, const CmaesState& state,
                                  const std::optional<NormStats>& norm_stats, int64_t iter_num,
                                  double best_val_loss) {
  const int64_t n = params.dimension, lambda = params.population;
  const bool diagonal = params.options.covariance == Covariance::kDiagonal;
  if (state.mean.size() != static_cast<std::size_t>(n) || state.path_c.size() != state.mean.size() ||
      state.path_sigma.size() != state.mean.size() ||
      state.covariance.size() != (diagonal ? 1u : state.mean.size()) * state.mean.size()) {
    return Status::InvalidArgument("the optimizer state (mean of " + std::to_string(state.mean.size()) + ", " +
                                   std::to_string(state.covariance.size()) +
                                   " covariance numbers) is not a complete state of dimension " + std::to_string(n));
  }
  std::vector<double> truncated = params.weights;
  for (std::size_t i = static_cast<std::size_t>(params.mu); i < truncated.size(); ++i) truncated[i] = 0;
  CmaesState settled = state;
  if (!diagonal) settle_covariance(params, settled);
  const std::vector<double> c = FullCovariance(params, settled.covariance);
  // The state's eigensystem when it has one, else that of C now.
  Eigensystem eigen = state.eigen;
  if (eigen.scales.size() != state.mean.size() || (!diagonal && eigen.basis == nullptr)) {
    NAMM_ASSIGN_OR_RETURN(eigen, decompose(params, state.generation, settled.covariance));
  }
  const TorchValue covariance = Matrix(c, n, n);  // C and sample_C: converted once
  const double lowest = -static_cast<double>(std::numeric_limits<float>::max());
  TorchValue evolution = TorchValue::Dict();
  evolution.Set("mu_eff", Scalar(params.mu_eff))
      .Set("weights", Vector(params.weights))
      .Set("weights_truncated", Vector(truncated))
      .Set("g", Scalar(static_cast<double>(state.generation)))
      .Set("best_member", Vector(state.best_member.empty() ? state.mean : state.best_member))
      .Set("best_fitness", Scalar(std::isfinite(state.best_fitness) ? state.best_fitness : lowest))
      .Set("evo_path_c", Vector(state.path_c))
      .Set("evo_path_sigma", Vector(state.path_sigma))
      .Set("mean", Vector(state.mean))
      .Set("sigma", Scalar(state.sigma))
      .Set("C", covariance)
      .Set("sample_C", covariance)
      .Set("sample_B", Matrix(EigenvectorColumns(params, eigen), n, n))
      .Set("sample_D", Vector(eigen.scales))
      .Set("x", Matrix(std::vector<double>(static_cast<std::size_t>(lambda * n), 0.0), lambda, n))
      .Set("y", Matrix(std::vector<double>(static_cast<std::size_t>(lambda * n), 0.0), lambda, n));
  const std::vector<int64_t> stat_shape = {1, 1, 1, kStftBins};
  for (const char* stat : {"mean", "var", "num"}) {
    evolution.Set(std::string(kStatsPrefix) + "online_new_output_" + stat, Scalar(0));
  }
  if (norm_stats) {
    const std::vector<double> count(static_cast<std::size_t>(kStftBins), static_cast<double>(norm_stats->count));
    evolution.Set(std::string(kStatsPrefix) + "output_mean",
                  TorchValue::Tensor(TorchTensor::FromFloats({norm_stats->mean.begin(), norm_stats->mean.end()}, stat_shape)))
        .Set(std::string(kStatsPrefix) + "output_var",
             TorchValue::Tensor(TorchTensor::FromFloats({norm_stats->var.begin(), norm_stats->var.end()}, stat_shape)))
        .Set(std::string(kStatsPrefix) + "output_num", TorchValue::Tensor(TorchTensor::FromFloats(count, stat_shape)));
  } else {
    for (const char* stat : {"mean", "var", "num"}) evolution.Set(std::string(kStatsPrefix) + "output_" + stat, Scalar(0));
  }
  TorchValue checkpoint = TorchValue::Dict();
  checkpoint.Set("evolution_state", std::move(evolution))
      .Set("iter_num", TorchValue::Int(iter_num))
      .Set("best_val_loss", TorchValue::Float(best_val_loss));
  return write_torch_archive(path, checkpoint);
}

Result<ReferenceCheckpoint> read_reference_checkpoint(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(TorchValue checkpoint, read_torch_archive(path));
  const TorchValue* state = checkpoint.Find("evolution_state");
  if (state == nullptr || state->kind != TorchValue::Kind::kDict) {
    return Bad(path, checkpoint.kind == TorchValue::Kind::kDict ? "it has no 'evolution_state' dict"
                                                                : std::string("it holds a ") + checkpoint.kind_name() +
                                                                      ", not a dict");
  }
  ReferenceCheckpoint out;
  NAMM_ASSIGN_OR_RETURN(out.mean, Floats(*state, "mean", -1, path));
  const auto n = static_cast<int64_t>(out.mean.size());
  if (n == 0) return Bad(path, "evolution_state['mean'] is empty");
  NAMM_ASSIGN_OR_RETURN(out.best_member, Floats(*state, "best_member", n, path));
  NAMM_ASSIGN_OR_RETURN(std::vector<double> sigma, Floats(*state, "sigma", 1, path));
  NAMM_ASSIGN_OR_RETURN(std::vector<double> best_fitness, Floats(*state, "best_fitness", 1, path));
  NAMM_ASSIGN_OR_RETURN(std::vector<double> g, Floats(*state, "g", 1, path));
  out.sigma = sigma[0];
  if (!(out.sigma > 0)) {
    return Bad(path, "evolution_state['sigma'] is " + std::to_string(out.sigma) + ", not a positive step size");
  }
  out.best_fitness = best_fitness[0];
  NAMM_ASSIGN_OR_RETURN(out.generation, Count(g[0], "evolution_state['g']", path));
  if (const TorchValue* num = state->Find(std::string(kStatsPrefix) + "output_num");
      num != nullptr && num->kind == TorchValue::Kind::kTensor && num->tensor.numel() == kStftBins) {
    NAMM_ASSIGN_OR_RETURN(std::vector<double> count, Floats(*state, std::string(kStatsPrefix) + "output_num", kStftBins, path));
    NAMM_ASSIGN_OR_RETURN(std::vector<double> mean, Floats(*state, std::string(kStatsPrefix) + "output_mean", kStftBins, path));
    NAMM_ASSIGN_OR_RETURN(std::vector<double> var, Floats(*state, std::string(kStatsPrefix) + "output_var", kStftBins, path));
    NAMM_ASSIGN_OR_RETURN(const int64_t counted, Count(count[0], "the normalization count", path));
    if (counted > 0) {
      NormStats stats;
      stats.count = counted;
      std::copy(mean.begin(), mean.end(), stats.mean.begin());
      std::copy(var.begin(), var.end(), stats.var.begin());
      out.norm_stats = stats;
    }
  }
  if (const TorchValue* iter = checkpoint.Find("iter_num"); iter != nullptr && iter->kind == TorchValue::Kind::kInt) {
    out.iter_num = iter->integer;
  }
  if (const TorchValue* loss = checkpoint.Find("best_val_loss"); loss != nullptr) {
    if (loss->kind == TorchValue::Kind::kFloat) out.best_val_loss = loss->real;
    if (loss->kind == TorchValue::Kind::kTensor && loss->tensor.numel() == 1) out.best_val_loss = loss->tensor.ToDoubles()[0];
  }
  return out;
}

}  // namespace namm::coordinator
