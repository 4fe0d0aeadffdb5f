// Validation of what workers send (proto/namm/v1/coordinator.proto), apart from the service so that it can be
// fuzzed alone (tests/fuzz). Each check returns "" for a well-formed message, else what is wrong, naming the field.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "namm/v1/coordinator.pb.h"
#include "namm/v1/protocol.h"

namespace namm::coordinator {

constexpr int kMaxSlots = 64;                     // leases a worker runs at once
constexpr std::size_t kMaxResultsPerReport = 1024;
constexpr std::size_t kMaxErrorBytes = 2048;
using v1::kMaxIdsPerCall;                         // leases (and held prompts) named in one call
// Bounds on a result's numbers far past any real prompt's, so that the sums and products the trainer makes of
// them stay finite and exact (a count of 2^63 - 1 wrapped the frozen statistics negative; a cache of 1e308
// made a fitness infinite; a denormal time an infinite speed).
constexpr int64_t kMaxResultTokens = int64_t{1} << 31;   // prompt_tokens, generated_tokens each
constexpr int64_t kMaxNormCount = int64_t{1} << 40;      // feature vectors behind one prompt's statistics
constexpr double kMaxNormMean = 1e12, kMaxNormVar = 1e24;
constexpr double kMinSeconds = 1e-9, kMaxSeconds = 1e9;  // or exactly 0 (not measured)

// Name, capabilities (except the fingerprint, the run's business), held leases, protocol version.
std::string CheckRegister(const v1::RegisterRequest& request);
// A report's shape: its size, each prompt at most once; `prompts` gets the prompts reported. What each result or
// failure holds is checked on its own (CheckResult, CheckFailure): one malformed entry is refused alone.
std::string CheckReport(const v1::ReportRequest& request, std::set<int64_t>* prompts);
// One result's numbers: score in [0, 1], counts and seconds within the bounds above, cache sizes at most the
// tokens the prompt had (+1 for rounding), well-formed statistics within their bounds.
std::string CheckResult(const v1::PromptResult& result);
// One failure: its error's size.
std::string CheckFailure(const v1::PromptFailure& failure);
// The number of lease ids a heartbeat or a drain names.
std::string CheckIdCount(int count, const std::string& what);

// Whether `presented` equals `secret`, in a time that depends only on the secret's length.
bool SameSecret(const std::string& presented, const std::string& secret);

}  // namespace namm::coordinator
