// Validation of what workers send (proto/namm/v1/coordinator.proto), apart from the service so that it can be
// fuzzed alone (tests/fuzz). Each check returns "" for a well-formed message, else what is wrong, naming the field.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "namm/v1/coordinator.pb.h"

namespace namm::coordinator {

constexpr int kMaxSlots = 64;                     // leases a worker runs at once
constexpr std::size_t kMaxResultsPerReport = 1024;
constexpr std::size_t kMaxErrorBytes = 2048;
constexpr std::size_t kMaxIdsPerCall = 4096;      // leases (and held prompts) named in one call

// Name, capabilities (except the fingerprint, the run's business), held leases, protocol version.
std::string CheckRegister(const v1::RegisterRequest& request);
// Results and failures: sizes, numbers, each prompt at most once; `prompts` gets the prompts reported.
std::string CheckReport(const v1::ReportRequest& request, std::set<int64_t>* prompts);
// The number of lease ids a heartbeat or a drain names.
std::string CheckIdCount(int count, const std::string& what);

// Whether `presented` equals `secret`, in a time that depends only on the secret's length.
bool SameSecret(const std::string& presented, const std::string& secret);

}  // namespace namm::coordinator
