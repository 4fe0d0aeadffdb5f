#include "namm/coordinator/checkpoint_codec.h"

#include <cmath>

#include "byte_codec.h"

namespace namm::coordinator {

namespace {

constexpr char kStateMagic[9] = "NAMMCMAS";
constexpr char kEigenMagic[9] = "NAMMEIGS";
constexpr char kNormMagic[9] = "NAMMNORM";
constexpr uint32_t kVersion = 1;       // eigensystems, normalization statistics
constexpr uint32_t kStateVersion = 2;  // 2: what the record holds (parts), and the pending decomposition
constexpr uint8_t kFullCovariance = 1, kDiagonalCovariance = 2;
constexpr uint8_t kHasCovariance = 1, kPendingIsCovariance = 2;

bool IsFull(const CmaesState& s) { return s.covariance.size() != s.mean.size(); }

}  // namespace

std::string encode_cmaes_state(const CmaesState& s, bool with_covariance) {
  const std::size_t n = s.mean.size();
  ByteWriter w(kStateMagic, kStateVersion);
  w.Put(static_cast<uint64_t>(n));
  w.Put(IsFull(s) ? kFullCovariance : kDiagonalCovariance);
  const bool pending_is_covariance =
      with_covariance && s.pending_covariance && *s.pending_covariance == s.covariance;
  w.Put(static_cast<uint8_t>((with_covariance ? kHasCovariance : 0) | (pending_is_covariance ? kPendingIsCovariance : 0)));
  w.Put(s.generation);
  w.Put(s.sigma);
  w.PutDoubles(s.mean.data(), n);
  if (with_covariance && IsFull(s)) {
    for (std::size_t i = 0; i < n; ++i) w.PutDoubles(s.covariance.data() + i * n, i + 1);
  } else if (with_covariance) {
    w.PutDoubles(s.covariance.data(), n);
  }
  w.PutDoubles(s.path_c.data(), n);
  w.PutDoubles(s.path_sigma.data(), n);
  w.Put(s.eigen.generation);
  w.Put(s.pending_generation);
  w.PutVector(s.best_member);
  w.Put(s.best_fitness);
  w.Put(s.best_generation);
  return w.Finish();
}

Result<CmaesState> decode_cmaes_state(std::string_view record, const CmaesParams& p, const std::string& what,
                                      bool* has_covariance) {
  NAMM_ASSIGN_OR_RETURN(ByteReader r, ByteReader::Open(record, kStateMagic, kStateVersion, what));
  uint64_t n = 0;
  uint8_t kind = 0, parts = kHasCovariance;  // version 1 always held C
  NAMM_RETURN_IF_ERROR(r.Get(&n));
  NAMM_RETURN_IF_ERROR(r.Get(&kind));
  const bool full = p.options.covariance == Covariance::kFull;
  if (n != static_cast<uint64_t>(p.dimension) || kind != (full ? kFullCovariance : kDiagonalCovariance)) {
    return Status::InvalidArgument(what + " holds a " + (kind == kFullCovariance ? "full" : "diagonal") +
                                   "-covariance state of dimension " + std::to_string(n) + "; the run needs a " +
                                   (full ? "full" : "diagonal") + "-covariance state of dimension " +
                                   std::to_string(p.dimension));
  }
  if (r.version() >= 2) NAMM_RETURN_IF_ERROR(r.Get(&parts));
  CmaesState s;
  NAMM_RETURN_IF_ERROR(r.Get(&s.generation));
  NAMM_RETURN_IF_ERROR(r.Get(&s.sigma));
  s.mean.resize(n);
  NAMM_RETURN_IF_ERROR(r.GetDoubles(s.mean.data(), n));
  if ((parts & kHasCovariance) && full) {
    s.covariance.assign(n * n, 0.0);
    for (std::size_t i = 0; i < n; ++i) NAMM_RETURN_IF_ERROR(r.GetDoubles(s.covariance.data() + i * n, i + 1));
  } else if (parts & kHasCovariance) {
    s.covariance.resize(n);
    NAMM_RETURN_IF_ERROR(r.GetDoubles(s.covariance.data(), n));
  }
  s.path_c.resize(n);
  s.path_sigma.resize(n);
  NAMM_RETURN_IF_ERROR(r.GetDoubles(s.path_c.data(), n));
  NAMM_RETURN_IF_ERROR(r.GetDoubles(s.path_sigma.data(), n));
  NAMM_RETURN_IF_ERROR(r.Get(&s.eigen.generation));
  if (r.version() >= 2) NAMM_RETURN_IF_ERROR(r.Get(&s.pending_generation));
  NAMM_RETURN_IF_ERROR(r.GetVector(&s.best_member, n));
  NAMM_RETURN_IF_ERROR(r.Get(&s.best_fitness));
  NAMM_RETURN_IF_ERROR(r.Get(&s.best_generation));
  NAMM_RETURN_IF_ERROR(r.ExpectEnd());
  if (s.generation < 0 || s.eigen.generation < 0 || s.eigen.generation > s.generation ||
      s.pending_generation < -1 || s.pending_generation > s.generation || !(std::isfinite(s.sigma) && s.sigma > 0) ||
      s.best_member.size() != n || (s.pending_generation >= 0 && (parts & kHasCovariance) && !(parts & kPendingIsCovariance))) {
    return r.Corrupt("inconsistent generation counters, step size, best member or pending decomposition");
  }
  if (parts & kPendingIsCovariance) s.pending_covariance = std::make_shared<const std::vector<double>>(s.covariance);
  if (has_covariance != nullptr) *has_covariance = (parts & kHasCovariance) != 0;
  return s;
}

std::string encode_eigensystem(const Eigensystem& e) {
  ByteWriter w(kEigenMagic, kVersion);
  w.Put(e.generation);
  w.PutVector(e.scales);
  w.PutVector(e.basis ? *e.basis : std::vector<double>());
  return w.Finish();
}

uint32_t eigensystem_checksum(const Eigensystem& e) {
  const auto bytes = [](const std::vector<double>& v) {
    return std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(double));
  };
  uint32_t crc = crc32_of(bytes(e.scales));
  return e.basis ? crc32_of(bytes(*e.basis), crc) : crc;
}

Result<Eigensystem> decode_eigensystem(std::string_view record, const CmaesParams& p, const std::string& what) {
  NAMM_ASSIGN_OR_RETURN(ByteReader r, ByteReader::Open(record, kEigenMagic, kVersion, what));
  const auto n = static_cast<std::size_t>(p.dimension);
  const bool full = p.options.covariance == Covariance::kFull;
  Eigensystem e;
  std::vector<double> basis;
  NAMM_RETURN_IF_ERROR(r.Get(&e.generation));
  NAMM_RETURN_IF_ERROR(r.GetVector(&e.scales, n));
  NAMM_RETURN_IF_ERROR(r.GetVector(&basis, full ? n * n : 0));
  NAMM_RETURN_IF_ERROR(r.ExpectEnd());
  if (e.scales.size() != n || basis.size() != (full ? n * n : 0)) {
    return r.Corrupt("its sizes do not match dimension " + std::to_string(n));
  }
  if (full) e.basis = std::make_shared<const std::vector<double>>(std::move(basis));
  return e;
}

std::string encode_norm_stats(const NormStats& stats) {
  ByteWriter w(kNormMagic, kVersion);
  w.Put(stats.count);
  w.PutDoubles(stats.mean.data(), stats.mean.size());
  w.PutDoubles(stats.var.data(), stats.var.size());
  return w.Finish();
}

Result<NormStats> decode_norm_stats(std::string_view record, const std::string& what) {
  NAMM_ASSIGN_OR_RETURN(ByteReader r, ByteReader::Open(record, kNormMagic, kVersion, what));
  NormStats stats;
  NAMM_RETURN_IF_ERROR(r.Get(&stats.count));
  NAMM_RETURN_IF_ERROR(r.GetDoubles(stats.mean.data(), stats.mean.size()));
  NAMM_RETURN_IF_ERROR(r.GetDoubles(stats.var.data(), stats.var.size()));
  NAMM_RETURN_IF_ERROR(r.ExpectEnd());
  if (stats.count < 0) return r.Corrupt("negative count");
  return stats;
}

}  // namespace namm::coordinator
