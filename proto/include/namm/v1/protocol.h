// The version of the coordinator protocol that worker and coordinator exchange at registration: a mismatch is
// refused with a message naming both, rather than failing later in ways that are hard to read. Bump it with every
// change of meaning (2: held leases and lease_done, results acknowledged once logged; 3: a report is refused per
// prompt, never whole for one prompt, and NOT_FOUND means an unknown worker only).
#pragma once

#include <cstddef>
#include <cstdint>

namespace namm::v1 {

constexpr uint32_t kProtocolVersion = 3;

// Leases, and prompts, one call may name (a registration's held leases and their prompts, a heartbeat's leases):
// the coordinator refuses more, so a worker names no more.
constexpr std::size_t kMaxIdsPerCall = 4096;

}  // namespace namm::v1
