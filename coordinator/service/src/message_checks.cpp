#include "message_checks.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "namm/feature_constants.h"
#include "namm/v1/protocol.h"

namespace namm::coordinator {

namespace {

bool Printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

// "cpu", "cuda" (the current CUDA device: what `namm-worker --device cuda` sends) or "cuda:N" (N: 1 to 3 digits).
bool IsDevice(const std::string& s) {
  if (s == "cpu" || s == "cuda") return true;
  const std::string prefix = "cuda:";
  if (s.rfind(prefix, 0) != 0 || s.size() == prefix.size() || s.size() > prefix.size() + 3) return false;
  return std::all_of(s.begin() + static_cast<std::ptrdiff_t>(prefix.size()), s.end(),
                     [](char c) { return c >= '0' && c <= '9'; });
}

std::string CheckNormStats(const v1::NormStats& stats) {
  if (stats.count() < 0 || stats.count() > kMaxNormCount) {
    return "count " + std::to_string(stats.count()) + " is not in [0, 2^40]";
  }
  if (stats.mean_size() != static_cast<int>(kStftBins) || stats.var_size() != static_cast<int>(kStftBins)) {
    return "mean and var need " + std::to_string(kStftBins) + " values each, got " +
           std::to_string(stats.mean_size()) + " and " + std::to_string(stats.var_size());
  }
  for (int i = 0; i < stats.mean_size(); ++i) {
    if (!(std::abs(stats.mean(i)) <= kMaxNormMean) || !(stats.var(i) >= 0 && stats.var(i) <= kMaxNormVar)) {
      return "bin " + std::to_string(i) + " has a mean outside [-1e12, 1e12] or a variance outside [0, 1e24]";
    }
  }
  return "";
}

}  // namespace

std::string CheckResult(const v1::PromptResult& r) {
  if (!std::isfinite(r.score()) || r.score() < 0 || r.score() > 1) {
    std::ostringstream text;
    text << "score " << r.score() << " is not a finite number in [0, 1]";
    return text.str();
  }
  if (r.prompt_tokens() < 0 || r.generated_tokens() < 0 || r.prompt_tokens() > kMaxResultTokens ||
      r.generated_tokens() > kMaxResultTokens) {
    return "token counts must be in [0, 2^31]";
  }
  const int64_t tokens = r.prompt_tokens() + r.generated_tokens();  // a cache holds at most the tokens seen
  if (!(r.cache_size_mean() >= 0 && r.cache_size_mean() <= static_cast<double>(tokens + 1))) {
    std::ostringstream text;
    text << "cache_size_mean " << r.cache_size_mean() << " is not in [0, " << tokens + 1
         << "] (the prompt's tokens + 1)";
    return text.str();
  }
  if (r.cache_size_final() < 0 || r.cache_size_final() > tokens + 1) {
    return "cache_size_final " + std::to_string(r.cache_size_final()) + " is not in [0, " +
           std::to_string(tokens + 1) + "] (the prompt's tokens + 1)";
  }
  if (!(r.seconds() == 0 || (r.seconds() >= kMinSeconds && r.seconds() <= kMaxSeconds))) {
    std::ostringstream text;
    text << "seconds " << r.seconds() << " is neither 0 nor in [1e-9, 1e9]";
    return text.str();
  }
  if (r.has_norm_stats()) {
    const std::string bad = CheckNormStats(r.norm_stats());
    if (!bad.empty()) return "norm_stats: " + bad;
  }
  return "";
}

std::string CheckFailure(const v1::PromptFailure& f) {
  if (f.error().size() > kMaxErrorBytes) {
    return "the failure's error has more than " + std::to_string(kMaxErrorBytes) + " bytes";
  }
  return "";
}

std::string CheckRegister(const v1::RegisterRequest& request) {
  if (request.protocol_version() != v1::kProtocolVersion) {
    return "the worker speaks protocol version " + std::to_string(request.protocol_version()) +
           " and this coordinator " + std::to_string(v1::kProtocolVersion) +
           ": run the same namm release on both (0: a release from before versions were exchanged)";
  }
  const std::string& name = request.worker_name();
  if (name.empty() || name.size() > 128 || !Printable(name)) return "worker_name must be 1 to 128 printable ASCII characters";
  const v1::Capabilities& caps = request.capabilities();
  if (!IsDevice(caps.device())) return "capabilities.device must be cpu, cuda or cuda:N, got '" + caps.device() + "'";
  if (caps.memory_bytes() < 0) return "capabilities.memory_bytes is negative";
  if (caps.max_concurrent_leases() < 1 || caps.max_concurrent_leases() > kMaxSlots) {
    return "capabilities.max_concurrent_leases must be 1 to " + std::to_string(kMaxSlots) + ", got " +
           std::to_string(caps.max_concurrent_leases());
  }
  std::size_t held_prompts = 0;
  for (const v1::HeldLease& h : request.held_leases()) {
    held_prompts += static_cast<std::size_t>(h.prompts_size());
    if (h.kind() != v1::Lease::KIND_CANDIDATE && h.kind() != v1::Lease::KIND_REFERENCE) {
      return "held lease " + std::to_string(h.lease_id()) + " has no kind";
    }
  }
  if (static_cast<std::size_t>(request.held_leases_size()) > kMaxIdsPerCall || held_prompts > kMaxIdsPerCall) {
    return "a registration names at most " + std::to_string(kMaxIdsPerCall) + " held leases and prompts";
  }
  return "";
}

std::string CheckReport(const v1::ReportRequest& request, std::set<int64_t>* prompts) {
  const std::size_t entries = static_cast<std::size_t>(request.results_size() + request.failures_size());
  if (entries == 0 && !request.lease_done()) return "a report needs at least one result or failure, or lease_done";
  if (entries > kMaxResultsPerReport) {
    return "a report holds at most " + std::to_string(kMaxResultsPerReport) + " results and failures";
  }
  for (const v1::PromptResult& r : request.results()) {
    if (!prompts->insert(r.prompt()).second) return "prompt " + std::to_string(r.prompt()) + " is reported twice";
  }
  for (const v1::PromptFailure& f : request.failures()) {
    if (!prompts->insert(f.prompt()).second) return "prompt " + std::to_string(f.prompt()) + " is reported twice";
  }
  return "";
}

std::string CheckIdCount(int count, const std::string& what) {
  if (count < 0 || static_cast<std::size_t>(count) > kMaxIdsPerCall) {
    return what + " names at most " + std::to_string(kMaxIdsPerCall) + " leases";
  }
  return "";
}

bool SameSecret(const std::string& presented, const std::string& secret) {
  // Every byte of the secret is compared, whatever was presented: neither a matching prefix nor the presented
  // length shows in the time taken.
  unsigned char diff = presented.size() == secret.size() ? 0 : 1;
  for (std::size_t i = 0; i < secret.size(); ++i) {
    const unsigned char p = i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
    diff |= static_cast<unsigned char>(p ^ static_cast<unsigned char>(secret[i]));
  }
  return diff == 0;
}

}  // namespace namm::coordinator
