#include "namm/auth_lockout.h"

#include <algorithm>

namespace namm {

AuthLockout::Verdict AuthLockout::Failed(const std::string& address, const std::string& why, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  Verdict v;
  if (options_.max_failures <= 0) {
    v.warning = Warn(address + ": " + why, now);
    return v;
  }
  auto it = entries_.find(address);
  if (it == entries_.end()) {
    if (entries_.size() >= options_.max_addresses) MakeRoom(now);
    it = entries_.emplace(address, Entry{}).first;
    it->second.window_start = now;
  }
  Entry& e = it->second;
  e.last_failure = now;
  if (e.locked_until > now) {
    v.locked_out = true;
    v.warning = Warn(address + " is locked out after too many authentication failures: " + why, now);
    return v;
  }
  if (now - e.window_start > options_.window) {
    e.window_start = now;
    e.failures = 0;
  }
  if (++e.failures >= options_.max_failures) {
    e.locked_until = now + options_.lockout;
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(options_.lockout).count();
    // This call is an ordinary failure; the lockout starts with the next. Always logged: once per lockout.
    v.warning = address + " failed authentication " + std::to_string(e.failures) + " times: its calls without "
                "the right secret are refused for " + std::to_string(seconds) + " s (" + options_.callers +
                " presenting it are not affected)";
    return v;
  }
  v.warning = Warn(address + ": " + why, now);
  return v;
}

std::size_t AuthLockout::addresses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void AuthLockout::MakeRoom(Clock::time_point now) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    const bool over = now - it->second.window_start > options_.window && it->second.locked_until <= now;
    it = over ? entries_.erase(it) : std::next(it);
  }
  while (entries_.size() >= options_.max_addresses) {
    entries_.erase(std::min_element(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
      return a.second.last_failure < b.second.last_failure;
    }));
  }
}

std::string AuthLockout::Warn(const std::string& message, Clock::time_point now) {
  if (warned_ && now - last_warning_ < options_.warn_interval) {
    ++unwarned_;
    return "";
  }
  std::string out = "refused a call of " + options_.callers + ": " + message;
  if (unwarned_ > 0) out += " (and " + std::to_string(unwarned_) + " more authentication failures not logged)";
  warned_ = true;
  last_warning_ = now;
  unwarned_ = 0;
  return out;
}

}  // namespace namm
