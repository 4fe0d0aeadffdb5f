#include "namm/coordinator/lease_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "namm/tasks/task_variant.h"

namespace namm::coordinator {

namespace {

auto GroupOf(const UnitKey& k) { return std::tie(k.kind, k.candidate, k.task); }

// Leases kept for the workers of a restarted coordinator until they register: held by a stand-in worker that
// takes no new leases (real worker ids start with "w-").
const std::string kReservedPrefix = "reserved/";
bool IsReserved(const std::string& worker) { return worker.rfind(kReservedPrefix, 0) == 0; }

}  // namespace

LeaseScheduler::LeaseScheduler(SchedulerOptions options) : options_(options) {
  options_.max_prompts_per_lease = std::max<int64_t>(1, options_.max_prompts_per_lease);
  options_.max_copies = std::max(1, options_.max_copies);
  next_lease_ = phase_first_lease_ = std::max<uint64_t>(1, options_.first_lease_id);
}

void LeaseScheduler::StartPhase(const std::vector<ScheduledUnit>& units) {
  for (auto& [id, lease] : active_) {
    Cancel(lease.worker, id);
    ended_.push_back(id);
  }
  for (auto& [name, w] : workers_) {
    w.leases.clear();
    w.ran.clear();
  }
  active_.clear();
  retired_.clear();
  queue_.clear();
  queued_units_ = 0;
  abandoned_.clear();
  units_.clear();
  index_.clear();
  done_count_ = 0;
  phase_first_lease_ = next_lease_;
  for (const ScheduledUnit& u : units) {
    Unit unit;
    unit.scheduled = u;
    index_[{u.key.kind, u.key.candidate, u.key.task, u.key.prompt}] = static_cast<int64_t>(units_.size());
    units_.push_back(std::move(unit));
  }
  // Stand-ins of the previous phase's reservations go; their leases were cancelled above.
  for (auto it = workers_.begin(); it != workers_.end();) it = IsReserved(it->first) ? workers_.erase(it) : std::next(it);

  // Group by (kind, candidate, task), pack each group, then hand out the longest leases first.
  std::vector<int64_t> order(units_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return GroupOf(units_[a].scheduled.key) < GroupOf(units_[b].scheduled.key);
  });
  std::vector<Pending> leases;
  for (std::size_t begin = 0; begin < order.size();) {
    std::size_t end = begin;
    while (end < order.size() &&
           GroupOf(units_[order[end]].scheduled.key) == GroupOf(units_[order[begin]].scheduled.key)) {
      ++end;
    }
    std::vector<Pending> group = Pack({order.begin() + static_cast<std::ptrdiff_t>(begin),
                                       order.begin() + static_cast<std::ptrdiff_t>(end)});
    leases.insert(leases.end(), group.begin(), group.end());
    begin = end;
  }
  std::stable_sort(leases.begin(), leases.end(), [](const Pending& a, const Pending& b) { return a.cost > b.cost; });
  queue_.assign(leases.begin(), leases.end());
  queued_units_ = static_cast<int64_t>(units_.size());
  queued_cost_ = 0;
  for (const Pending& p : queue_) queued_cost_ += p.cost;
}

double LeaseScheduler::MeanSpeed() const { return known_slots_ > 0 ? known_speed_sum_ / known_slots_ : 0; }

double LeaseScheduler::RelativeSpeed(const Worker& w) const {
  const double mean = MeanSpeed();
  return mean > 0 && w.Speed() > 0 ? w.Speed() / mean : 1;
}

double LeaseScheduler::RelativeSpeed(const std::string& worker) const {
  const auto it = workers_.find(worker);
  return it == workers_.end() ? 1 : RelativeSpeed(it->second);
}

void LeaseScheduler::CountSpeed(const Worker& w, double sign) {
  if (w.draining || w.Speed() <= 0) return;
  known_speed_sum_ += sign * w.Speed() * w.slots;
  known_slots_ += sign * w.slots;
}

std::vector<LeaseScheduler::Pending> LeaseScheduler::Pack(const std::vector<int64_t>& unit_indices) const {
  std::vector<int64_t> by_cost = unit_indices;
  std::stable_sort(by_cost.begin(), by_cost.end(),
                   [&](int64_t a, int64_t b) { return units_[a].scheduled.cost > units_[b].scheduled.cost; });
  const auto count = static_cast<int64_t>(by_cost.size());
  const int64_t bins = (count + options_.max_prompts_per_lease - 1) / options_.max_prompts_per_lease;
  std::vector<Pending> out(static_cast<std::size_t>(bins));
  // Longest first onto the least loaded lease that still has room.
  for (int64_t u : by_cost) {
    Pending* best = nullptr;
    for (Pending& p : out) {
      if (static_cast<int64_t>(p.units.size()) >= options_.max_prompts_per_lease) continue;
      if (best == nullptr || p.cost < best->cost) best = &p;
    }
    best->units.push_back(u);
    best->cost += units_[u].scheduled.cost;
  }
  return out;
}

void LeaseScheduler::AddWorker(const std::string& worker, int slots, const std::string& name) {
  const auto [it, added] = workers_.try_emplace(worker);
  Worker& w = it->second;
  if (!added) StopLeasing(w);
  w.name = name.empty() ? worker : name;
  w.slots = std::max(1, slots);
  w.draining = false;
  leasing_slots_ += w.slots;
  ++leasing_workers_;
  CountSpeed(w, +1);
}

void LeaseScheduler::StopLeasing(Worker& w) {
  CountSpeed(w, -1);
  if (!w.draining) {
    leasing_slots_ -= w.slots;
    --leasing_workers_;
  }
  w.draining = true;
}

void LeaseScheduler::Cancel(const std::string& worker, uint64_t lease) {
  workers_[worker].cancelled.push_back(lease);
  cancel_notices_.push_back(worker);
}

std::vector<std::string> LeaseScheduler::TakeCancelNotices() {
  std::vector<std::string> out;
  out.swap(cancel_notices_);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void LeaseScheduler::RemoveWorker(const std::string& worker) {
  const auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  const std::set<uint64_t> leases = it->second.leases;
  for (uint64_t id : leases) {
    Requeue(id, /*lost=*/true);
    ++counters_.leases_returned;
  }
  StopLeasing(it->second);
  workers_.erase(worker);
}

void LeaseScheduler::Drain(const std::string& worker, const std::vector<uint64_t>& returned) {
  const auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  StopLeasing(it->second);
  for (uint64_t id : returned) {
    const auto a = active_.find(id);
    if (a == active_.end() || a->second.worker != worker) continue;
    Requeue(id, /*lost=*/false);
    ++counters_.leases_returned;
  }
}

bool LeaseScheduler::IsDraining(const std::string& worker) const {
  const auto it = workers_.find(worker);
  return it != workers_.end() && it->second.draining;
}

bool LeaseScheduler::IsQuarantined(const std::string& worker) const {
  const auto it = workers_.find(worker);
  return it != workers_.end() && it->second.quarantined;
}

std::vector<uint64_t> LeaseScheduler::LeasesOf(const std::string& worker) const {
  const auto it = workers_.find(worker);
  if (it == workers_.end()) return {};
  return {it->second.leases.begin(), it->second.leases.end()};
}

bool LeaseScheduler::HasWorkFor(const std::string& worker) const {
  const auto it = workers_.find(worker);
  if (it == workers_.end() || !FreeSlot(it->second)) return false;
  for (const Pending& p : queue_) {
    if (!LeasableTo(it->second, p)) continue;
    for (int64_t u : p.units) {
      if (!units_[u].done) return true;
    }
  }
  return StragglerFor(worker).has_value();
}

std::optional<uint64_t> LeaseScheduler::StragglerFor(const std::string& worker) const {
  // The lease expected to finish last: started + its cost at its holder's measured speed (the mean speed for
  // a holder not measured yet; with no speed known, the oldest lease).
  std::optional<uint64_t> best;
  Clock::time_point best_end;
  for (const auto& [id, lease] : active_) {
    if (lease.worker == worker) continue;
    double cost = 0;
    bool copyable = false;
    for (int64_t u : lease.units) {
      cost += units_[u].scheduled.cost;
      copyable = copyable || (!units_[u].done && static_cast<int>(units_[u].holders.size()) < options_.max_copies);
    }
    if (!copyable) continue;
    const auto holder = workers_.find(lease.worker);
    const double speed = holder != workers_.end() && holder->second.Speed() > 0 ? holder->second.Speed() : MeanSpeed();
    const Clock::time_point end =
        speed > 0 ? lease.started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cost / speed))
                  : lease.started;
    if (!best || (speed > 0 ? end > best_end : end < best_end)) {
      best = id;
      best_end = end;
    }
  }
  return best;
}

bool LeaseScheduler::LeasableTo(const Worker& worker, const Pending& p) const {
  const Unit& u = units_[p.units.front()];
  return u.failed_on.count(worker.name) == 0 || static_cast<int64_t>(u.failed_on.size()) >= leasing_workers_;
}

std::optional<std::size_t> LeaseScheduler::PickQueued(const Worker& worker, double relative_speed) const {
  std::vector<std::size_t> open;  // queue positions the worker may take, in queue order
  for (std::size_t i = 0; i < queue_.size(); ++i) {
    if (LeasableTo(worker, queue_[i])) open.push_back(i);
  }
  if (open.empty()) return std::nullopt;
  const Pending& front = queue_[open.front()];
  if (relative_speed < 1 && leasing_slots_ > 0) {
    // Seconds until the queue is expected to drain at the mean speed, against the extra seconds a lease takes
    // on this worker over an average one. Far from the end every lease fits and the front is taken.
    const double speed = worker.Speed(), mean = MeanSpeed();
    const double horizon = queued_cost_ / (mean * static_cast<double>(leasing_slots_));
    const auto late_by = [&](const Pending& p) { return p.cost / speed - p.cost / mean; };
    if (late_by(front) > horizon) {
      for (std::size_t i : open) {
        if (late_by(queue_[i]) <= horizon) return i;
      }
      return open.back();  // none fits: the shortest (the queue is longest first, requeued leases aside)
    }
  }
  const auto ran = [&](const Pending& p) {
    const UnitKey& key = units_[p.units.front()].scheduled.key;
    return worker.ran.count({key.kind, key.candidate}) > 0;
  };
  if (static_cast<double>(queued_units_) < static_cast<double>(options_.max_prompts_per_lease * leasing_slots_)) {
    // The phase's end, where leases are cut to a prompt or two: the longest prompt first, wherever it is queued
    // (leases are ordered by their total, and cut leases put their shorter rest at the front); among equally
    // long ones (the same prompt of other candidates), one of a candidate the worker ran.
    const auto first_cost = [&](std::size_t i) { return units_[queue_[i].units.front()].scheduled.cost; };
    std::size_t longest = open.front();
    for (std::size_t i : open) {
      if (first_cost(i) > first_cost(longest)) longest = i;
    }
    for (std::size_t i : open) {
      if (first_cost(i) >= 0.99 * first_cost(longest) && ran(queue_[i])) return i;
    }
    return longest;
  }
  // Affinity: an equally long lease (within 1%) of a candidate the worker already ran, among the next few.
  constexpr std::size_t kAffinityWindow = 64;
  for (std::size_t k = 0; k < std::min(open.size(), kAffinityWindow); ++k) {
    if (queue_[open[k]].cost < 0.99 * front.cost) break;
    if (ran(queue_[open[k]])) return open[k];
  }
  return open.front();
}

std::optional<std::vector<int64_t>> LeaseScheduler::TakeQueued(const Worker& worker) {
  const double relative_speed = RelativeSpeed(worker);
  while (true) {
    const std::optional<std::size_t> pick = PickQueued(worker, relative_speed);
    if (!pick) return std::nullopt;
    Pending p = std::move(queue_[*pick]);
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(*pick));
    queued_units_ -= static_cast<int64_t>(p.units.size());
    queued_cost_ -= p.cost;
    std::vector<int64_t> units;
    for (int64_t u : p.units) {
      if (!units_[u].done && units_[u].holders.empty()) units.push_back(u);
    }
    if (units.empty()) continue;  // finished meanwhile by a late result, or re-attached to its old holder
    // Guided size: ceil(queued prompts / (2 x slots)), so the end of the phase is handed out prompt by prompt;
    // a worker's share scales with its relative speed.
    const int64_t queued = queued_units_ + static_cast<int64_t>(units.size());
    const auto guided = static_cast<int64_t>(
        std::ceil(static_cast<double>(queued) * relative_speed / (2.0 * static_cast<double>(std::max<int64_t>(1, leasing_slots_)))));
    const auto size = static_cast<std::size_t>(
        options_.guided_sizes ? std::clamp<int64_t>(guided, 1, options_.max_prompts_per_lease) : options_.max_prompts_per_lease);
    if (units.size() > size) {
      Pending rest;
      rest.units.assign(units.begin() + static_cast<std::ptrdiff_t>(size), units.end());
      for (int64_t u : rest.units) rest.cost += units_[u].scheduled.cost;
      PushFront(std::move(rest));
      units.resize(size);
    }
    return units;
  }
  return std::nullopt;
}

void LeaseScheduler::PushFront(Pending p) {
  queued_units_ += static_cast<int64_t>(p.units.size());
  queued_cost_ += p.cost;
  queue_.push_front(std::move(p));
}

std::optional<LeaseGrant> LeaseScheduler::Acquire(const std::string& worker, Clock::time_point now) {
  const auto it = workers_.find(worker);
  if (it == workers_.end() || !FreeSlot(it->second)) return std::nullopt;
  LeaseGrant grant;
  if (std::optional<std::vector<int64_t>> units = TakeQueued(it->second)) {
    Issue(worker, std::move(*units), false, now, &grant);
    return grant;
  }
  const std::optional<uint64_t> straggler = StragglerFor(worker);
  if (!straggler) return std::nullopt;
  std::vector<int64_t> units;
  for (int64_t u : active_.at(*straggler).units) {
    if (!units_[u].done && static_cast<int>(units_[u].holders.size()) < options_.max_copies) units.push_back(u);
  }
  Issue(worker, std::move(units), true, now, &grant);
  ++counters_.leases_duplicated;
  return grant;
}

uint64_t LeaseScheduler::Issue(const std::string& worker, std::vector<int64_t> units, bool duplicate,
                               Clock::time_point now, LeaseGrant* grant) {
  const uint64_t id = next_lease_++;
  const UnitKey& first = units_[units.front()].scheduled.key;
  grant->id = id;
  grant->kind = first.kind;
  grant->candidate = first.candidate;
  grant->task = first.task;
  grant->duplicate = duplicate;
  grant->prompts.clear();
  for (int64_t u : units) grant->prompts.push_back(units_[u].scheduled.key.prompt);
  Activate(id, worker, std::move(units), now);
  ++counters_.leases_issued;
  counters_.units_leased += static_cast<int64_t>(grant->prompts.size());
  return id;
}

void LeaseScheduler::Activate(uint64_t id, const std::string& worker, std::vector<int64_t> units,
                              Clock::time_point now) {
  const UnitKey& first = units_[units.front()].scheduled.key;
  for (int64_t u : units) units_[u].holders.insert(id);
  retired_.erase(id);
  workers_[worker].leases.insert(id);
  workers_[worker].ran.insert({first.kind, first.candidate});
  active_[id] = Active{worker, workers_[worker].name, std::move(units), now, now + options_.lease_timeout};
}

std::vector<int64_t> LeaseScheduler::OpenUnits(const HeldLease& lease, std::optional<uint64_t> holder) const {
  std::vector<int64_t> out;
  for (int64_t prompt : lease.prompts) {
    const auto it = index_.find({lease.kind, lease.candidate, lease.task, prompt});
    if (it == index_.end()) continue;
    const Unit& u = units_[it->second];
    const bool free = u.holders.empty() || (holder && u.holders.size() == 1 && u.holders.count(*holder) > 0);
    if (!u.done && !u.abandoned && free && std::find(out.begin(), out.end(), it->second) == out.end()) {
      out.push_back(it->second);
    }
  }
  return out;
}

bool LeaseScheduler::Reserve(const std::string& worker_name, const HeldLease& lease, Clock::time_point now) {
  if (active_.count(lease.id) > 0) return false;
  std::vector<int64_t> units = OpenUnits(lease);
  if (units.empty()) return false;
  const std::string holder = kReservedPrefix + worker_name;
  Worker& w = workers_[holder];
  w.name = worker_name;
  w.slots = 0;
  w.draining = true;
  Activate(lease.id, holder, std::move(units), now);
  ++counters_.leases_reserved;
  return true;
}

std::vector<std::pair<uint64_t, std::string>> LeaseScheduler::CheckHeld(const std::string& worker_name,
                                                                         const std::vector<HeldLease>& held) const {
  std::vector<std::pair<uint64_t, std::string>> refused;
  for (const HeldLease& h : held) {
    // Earlier coordinators of the run numbered theirs below first_lease_id; this one has issued up to next_lease_.
    if (h.id == 0 || h.id >= next_lease_) {
      refused.emplace_back(h.id, "this coordinator never issued it");
      continue;
    }
    const Active* a = nullptr;
    if (const auto it = active_.find(h.id); it != active_.end()) a = &it->second;
    if (const auto it = retired_.find(h.id); it != retired_.end()) a = &it->second;
    if (a != nullptr && a->name != worker_name) refused.emplace_back(h.id, "it was issued to another worker");
  }
  return refused;
}

std::vector<int64_t> LeaseScheduler::TakeOver(const HeldLease& h, const std::string& name) {
  const auto a = active_.find(h.id);
  if (a == active_.end() || a->second.name != name) return {};  // another's
  const std::string owner = a->second.worker;
  // The named units it still has stay; units of the lease it no longer has go back to the queue. Only the
  // lease's own: a claim naming other queued prompts must not pull them into it ahead of the queue.
  const std::vector<int64_t>& own = a->second.units;
  std::vector<int64_t> units;
  for (int64_t u : OpenUnits(h, h.id)) {
    if (std::find(own.begin(), own.end(), u) != own.end()) units.push_back(u);
  }
  if (units.empty()) {
    Requeue(h.id, /*lost=*/false);
    return {};
  }
  Pending back;
  for (int64_t u : a->second.units) {
    if (std::find(units.begin(), units.end(), u) != units.end()) continue;
    units_[u].holders.erase(h.id);
    if (!units_[u].done && units_[u].holders.empty()) {
      back.units.push_back(u);
      back.cost += units_[u].scheduled.cost;
    }
  }
  if (!back.units.empty()) PushFront(std::move(back));
  if (const auto o = workers_.find(owner); o != workers_.end()) {
    o->second.leases.erase(h.id);
    if (IsReserved(owner) && o->second.leases.empty()) workers_.erase(o);
  }
  active_.erase(a);
  return units;
}

std::vector<int64_t> LeaseScheduler::Readopt(const HeldLease& h, const std::string& name) const {
  const auto r = retired_.find(h.id);
  if (r == retired_.end() || r->second.name != name) return {};
  std::vector<int64_t> units;
  for (int64_t u : OpenUnits(h)) {
    if (std::find(r->second.units.begin(), r->second.units.end(), u) != r->second.units.end()) units.push_back(u);
  }
  return units;
}

std::vector<HeldLease> LeaseScheduler::Reattach(const std::string& worker, const std::vector<HeldLease>& held,
                                                Clock::time_point now) {
  std::vector<HeldLease> kept;
  const auto self = workers_.find(worker);
  if (self == workers_.end()) return kept;
  const std::string name = self->second.name;
  for (const HeldLease& h : held) {
    // Any other id (an earlier phase's or coordinator's, or one never issued) is not kept: adopting it could
    // collide with a lease this coordinator issues later.
    std::vector<int64_t> units = active_.count(h.id) > 0 ? TakeOver(h, name) : Readopt(h, name);
    if (units.empty()) continue;
    HeldLease k = h;
    k.prompts.clear();
    for (int64_t u : units) k.prompts.push_back(units_[u].scheduled.key.prompt);
    Activate(h.id, worker, std::move(units), now);
    ++counters_.leases_reattached;
    kept.push_back(std::move(k));
  }
  return kept;
}

bool LeaseScheduler::Release(const std::string& worker, uint64_t lease) {
  const auto a = active_.find(lease);
  if (a == active_.end() || a->second.worker != worker) return false;
  const int64_t queued = queued_units_;
  Requeue(lease, /*lost=*/false);
  return queued_units_ > queued;
}

std::vector<uint64_t> LeaseScheduler::TakeEnded() {
  std::vector<uint64_t> out;
  out.swap(ended_);
  return out;
}

Result<UnitKey> LeaseScheduler::Check(const std::string& worker, uint64_t lease, int64_t prompt, bool* stale,
                                      const std::string& name) const {
  if (stale != nullptr) *stale = false;
  const std::vector<int64_t>* units = nullptr;
  const auto mine = [&](const Active& a) { return a.worker == worker || (!name.empty() && a.name == name); };
  if (const auto a = active_.find(lease); a != active_.end()) {
    if (!mine(a->second)) return Status::InvalidArgument("lease " + std::to_string(lease) + " belongs to another worker");
    units = &a->second.units;
  } else if (const auto r = retired_.find(lease); r != retired_.end()) {
    if (!mine(r->second)) return Status::InvalidArgument("lease " + std::to_string(lease) + " belongs to another worker");
    units = &r->second.units;
  } else if (lease > 0 && lease < phase_first_lease_) {
    if (stale != nullptr) *stale = true;
    return Status::NotFound("lease " + std::to_string(lease) + " belongs to a finished phase");
  } else {
    return Status::NotFound("unknown lease " + std::to_string(lease));
  }
  for (int64_t u : *units) {
    if (units_[u].scheduled.key.prompt == prompt) return units_[u].scheduled.key;
  }
  return Status::InvalidArgument("prompt " + std::to_string(prompt) + " is not part of lease " + std::to_string(lease));
}

int64_t LeaseScheduler::UnitOf(uint64_t lease, int64_t prompt) const {
  const auto a = active_.find(lease);
  const std::vector<int64_t>& units = a != active_.end() ? a->second.units : retired_.at(lease).units;
  return *std::find_if(units.begin(), units.end(), [&](int64_t i) { return units_[i].scheduled.key.prompt == prompt; });
}

ResultOutcome LeaseScheduler::Complete(uint64_t lease, int64_t prompt, double seconds) {
  const bool late = active_.count(lease) == 0;
  const int64_t u = UnitOf(lease, prompt);
  const auto worker = workers_.find(late ? retired_.at(lease).worker : active_.at(lease).worker);
  if (worker != workers_.end()) {
    Worker& w = worker->second;
    w.failures_in_a_row = 0;
    if (seconds > 0) {
      constexpr double kDecay = 0.95;  // about the last 20 prompts
      CountSpeed(w, -1);
      w.cost_done = kDecay * w.cost_done + units_[u].scheduled.cost;
      w.seconds_done = kDecay * w.seconds_done + seconds;
      CountSpeed(w, +1);
    }
  }
  if (units_[u].done) {
    ++counters_.results_duplicate;
    return ResultOutcome::kDuplicate;
  }
  if (units_[u].abandoned) {  // an earlier copy's result after the unit was given up: it counts after all
    units_[u].abandoned = false;
    abandoned_.erase(std::remove_if(abandoned_.begin(), abandoned_.end(),
                                    [&](const AbandonedUnit& a) {
                                      return std::tie(a.key.kind, a.key.candidate, a.key.task, a.key.prompt) ==
                                             std::tie(units_[u].scheduled.key.kind, units_[u].scheduled.key.candidate,
                                                      units_[u].scheduled.key.task, units_[u].scheduled.key.prompt);
                                    }),
                     abandoned_.end());
  }
  units_[u].done = true;
  ++done_count_;
  ++counters_.results_accepted;
  if (late) ++counters_.results_late;
  // Leases (this one or copies) with nothing left to do end; copies held by other workers are cancelled.
  const std::set<uint64_t> holders = units_[u].holders;
  for (uint64_t h : holders) {
    const Active& a = active_.at(h);
    if (std::all_of(a.units.begin(), a.units.end(), [&](int64_t i) { return units_[i].done; })) {
      EndLease(h, h != lease);
    }
  }
  return late ? ResultOutcome::kLate : ResultOutcome::kAccepted;
}

void LeaseScheduler::EndLease(uint64_t lease, bool cancel) {
  Active a = std::move(active_.at(lease));
  active_.erase(lease);
  for (int64_t u : a.units) units_[u].holders.erase(lease);
  Worker& w = workers_[a.worker];
  w.leases.erase(lease);
  if (cancel) Cancel(a.worker, lease);
  ended_.push_back(lease);
  const bool stand_in_done = IsReserved(a.worker) && w.leases.empty();
  const std::string stand_in = a.worker;
  retired_[lease] = std::move(a);
  if (stand_in_done) workers_.erase(stand_in);
}

bool LeaseScheduler::CountFailure(int64_t u, const std::string& worker_name, const std::string& error) {
  Unit& unit = units_[u];
  unit.failed_on.insert(worker_name);
  if (!error.empty()) unit.last_error = error;
  if (static_cast<int>(unit.failed_on.size()) < options_.max_attempts) return true;
  unit.abandoned = true;
  abandoned_.push_back({unit.scheduled.key, static_cast<int>(unit.failed_on.size()), unit.last_error});
  return false;
}

void LeaseScheduler::Fail(uint64_t lease, int64_t prompt, const std::string& error) {
  const int64_t u = UnitOf(lease, prompt);
  ++counters_.prompts_failed;
  const auto a = active_.find(lease);
  const Active& held = a != active_.end() ? a->second : retired_.at(lease);
  // By name: a worker that reconnected reports its old lease's failure under its old id, gone from workers_
  // (counting that id made the host a second worker, so it could fail the prompt alone past max_attempts).
  const std::string worker = held.worker, name = held.name;
  if (const auto w = workers_.find(worker); w != workers_.end() && ++w->second.failures_in_a_row >= options_.quarantine_after) {
    w->second.quarantined = true;
    StopLeasing(w->second);
  }
  if (units_[u].done || units_[u].abandoned) return;
  if (a == active_.end()) {
    // The lease already expired and its units went back to the queue: only the failure counts.
    CountFailure(u, name, error);
    return;
  }
  // The prompt leaves the lease; a lease with nothing left ends.
  std::vector<int64_t>& units = a->second.units;
  units.erase(std::find(units.begin(), units.end(), u));
  units_[u].holders.erase(lease);
  if (std::all_of(units.begin(), units.end(), [&](int64_t i) { return units_[i].done; })) EndLease(lease, false);
  if (CountFailure(u, name, error) && units_[u].holders.empty()) {
    PushFront(Pending{{u}, units_[u].scheduled.cost});
  }
}

std::vector<int64_t> LeaseScheduler::Orphans(uint64_t lease) const {
  std::vector<int64_t> out;
  for (int64_t u : active_.at(lease).units) {
    if (!units_[u].done && units_[u].holders.size() == 1) out.push_back(u);
  }
  return out;
}

void LeaseScheduler::Requeue(uint64_t lease, bool lost) {
  std::vector<int64_t> orphans = Orphans(lease);
  EndLease(lease, false);
  Pending p;
  for (int64_t u : orphans) {
    p.units.push_back(u);
    p.cost += units_[u].scheduled.cost;
  }
  if (lost) counters_.units_lost += static_cast<int64_t>(orphans.size());
  if (!p.units.empty()) PushFront(std::move(p));  // already late: next in line
}

void LeaseScheduler::Drop(const std::string& task, int64_t prompt) {
  const std::string base = tasks::base_task(task);
  const auto dropped = [&](const UnitKey& key) { return key.prompt == prompt && tasks::base_task(key.task) == base; };
  for (int64_t u = 0; u < static_cast<int64_t>(units_.size()); ++u) {
    Unit& unit = units_[u];
    if (unit.done || !dropped(unit.scheduled.key)) continue;
    unit.done = true;
    unit.abandoned = false;
    ++done_count_;
    ++counters_.units_dropped;
    const std::set<uint64_t> holders = unit.holders;
    for (uint64_t h : holders) {
      const Active& a = active_.at(h);
      if (std::all_of(a.units.begin(), a.units.end(), [&](int64_t i) { return units_[i].done; })) EndLease(h, true);
    }
  }
  abandoned_.erase(std::remove_if(abandoned_.begin(), abandoned_.end(), [&](const AbandonedUnit& a) { return dropped(a.key); }),
                   abandoned_.end());
}

std::vector<uint64_t> LeaseScheduler::Heartbeat(const std::string& worker, const std::vector<uint64_t>& ids,
                                                Clock::time_point now) {
  std::vector<uint64_t> gone;
  for (uint64_t id : ids) {
    const auto a = active_.find(id);
    if (a == active_.end() || a->second.worker != worker) {
      gone.push_back(id);
      continue;
    }
    a->second.deadline = now + options_.lease_timeout;
  }
  return gone;
}

int64_t LeaseScheduler::ExpireLeases(Clock::time_point now) {
  std::vector<uint64_t> expired;
  for (const auto& [id, a] : active_) {
    if (a.deadline <= now) expired.push_back(id);
  }
  for (uint64_t id : expired) {
    Cancel(active_.at(id).worker, id);
    Requeue(id, /*lost=*/true);
  }
  counters_.leases_expired += static_cast<int64_t>(expired.size());
  return static_cast<int64_t>(expired.size());
}

std::vector<uint64_t> LeaseScheduler::TakeCancelled(const std::string& worker) {
  const auto it = workers_.find(worker);
  if (it == workers_.end()) return {};
  std::vector<uint64_t> out;
  out.swap(it->second.cancelled);
  return out;
}

bool LeaseScheduler::HasCancelled(const std::string& worker) const {
  const auto it = workers_.find(worker);
  return it != workers_.end() && !it->second.cancelled.empty();
}

}  // namespace namm::coordinator
