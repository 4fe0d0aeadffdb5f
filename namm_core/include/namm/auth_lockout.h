// The standing of peer addresses that present a wrong secret: the coordinator's workers (WorkerService::
// Authenticate, refused with RESOURCE_EXHAUSTED) and namm-api's clients (a wrong API key, refused with 429).
//
// An address with `max_failures` failed authentications within `window` is locked out for `lockout`: its calls
// with a wrong or missing secret are then refused at once. A call with the right secret is never refused, so that
// clients sharing an address with a guesser (behind NAT, on one host) keep working; the secret's length is what
// stops guessing, the lockout spares the server the work and the logs. The table is bounded: an entry expires once its window and lockout are over, and at most
// `max_addresses` are kept (the stalest goes first), so that a flood of addresses cannot grow memory. Warnings
// are rate-limited: at most one per `warn_interval`, saying how many were left out. Thread-safe; the caller's
// clock.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace namm {

class AuthLockout {
 public:
  using Clock = std::chrono::steady_clock;
  struct Options {
    int max_failures = 20;  // 0: no lockout
    Clock::duration window = std::chrono::minutes(1), lockout = std::chrono::minutes(1);
    std::size_t max_addresses = 4096;
    Clock::duration warn_interval = std::chrono::seconds(1);
    std::string callers = "workers";  // who calls, for the warnings ("clients")
  };
  struct Verdict {
    bool locked_out = false;  // refuse with RESOURCE_EXHAUSTED (else UNAUTHENTICATED)
    std::string warning;      // to log, when not rate-limited ("" otherwise)
  };

  explicit AuthLockout(Options options) : options_(options) {}

  // A failed authentication from `address` (`why`: what was wrong) at `now`.
  Verdict Failed(const std::string& address, const std::string& why, Clock::time_point now);
  std::size_t addresses() const;

 private:
  struct Entry {
    int failures = 0;
    Clock::time_point window_start, last_failure, locked_until;
  };
  // Drops entries whose window and lockout are over; if still full, the stalest (mu_ held).
  void MakeRoom(Clock::time_point now);
  // The warning, or "" while rate-limited (mu_ held).
  std::string Warn(const std::string& message, Clock::time_point now);

  const Options options_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;
  Clock::time_point last_warning_;
  bool warned_ = false;
  int64_t unwarned_ = 0;  // failures left out of the log since the last warning
};

}  // namespace namm
