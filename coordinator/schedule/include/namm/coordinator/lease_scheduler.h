// Handing a phase's units of work to workers as leases (no network, no clock of its own: callers pass `now`).
//
//  - Units (one prompt of one candidate, or of the base model) are grouped into leases of at most
//    `max_prompts_per_lease` prompts of the same candidate and task, balanced by cost (prompt tokens), and
//    handed out longest first: the longest-processing-time rule keeps the generation's tail short.
//  - Lease sizes are guided: a lease holds at most ceil(queued prompts × relative speed / (2 × worker slots))
//    prompts (half the guided self-scheduling share, as in factoring), so leases are full-size while there is
//    plenty of work and shrink to single prompts at the generation's end, where a
//    coarse lease would leave other workers idle.
//  - Workers' speeds are learned from the seconds they report per prompt (cost per second, decayed so a
//    worker that slows down is noticed within a few dozen prompts) and compared with the mean of the leasing
//    workers' speeds: a worker at half the mean gets leases of half the guided size; at the phase's end, when
//    the longest queued lease would finish on it later than the queue is expected to drain, it gets the
//    longest one that would not (or the shortest there is); and straggler copies go to the lease expected to
//    finish last. Until its speed is known, a worker counts as average.
//  - Among the equally long leases at the front of the queue, a worker gets one of a candidate it already ran
//    this phase: it has that candidate's parameters and needs no new ones.
//  - A worker holds at most `slots` leases. A lease lives until `lease_timeout` after its last heartbeat; then
//    its unfinished units go back to the front of the queue.
//  - When the queue is empty, an idle worker gets a copy of the oldest running lease (straggler duplication, at
//    most `max_copies` holders per unit). The first result for a unit wins; the other copies are cancelled.
//  - Results are idempotent: a result for a unit that already has one is a duplicate; a result on an expired or
//    returned lease is still accepted ("late") while its unit has none.
//  - Failures are classified. A prompt whose lease expired or whose worker crashed, disconnected or drained is
//    lost, not failed: it goes back to the queue and keeps its attempts (a dead worker says nothing about the
//    prompt). A prompt a worker reports as failed goes back too, to a worker it has not failed on while one
//    is leasing; after it failed on `max_attempts` different workers it is abandoned, and the run decides (Drop() takes it out of the phase for every candidate). A
//    worker whose prompts fail `quarantine_after` times in a row gets no more leases.
//  - Re-attaching: a worker whose connection broke keeps running its leases and names them when it registers
//    again; Reattach() gives it back those whose units are still open. A restarted coordinator Reserve()s the
//    leases its predecessor handed out (from the store) for their holders' names, for one lease timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "namm/status.h"

namespace namm::coordinator {

enum class UnitKind {
  kCandidate,  // a NAMM candidate (or the mean) of the current generation
  kReference,  // the base model with the full cache: a reference score
};

struct UnitKey {
  UnitKind kind = UnitKind::kCandidate;
  int64_t candidate = 0;  // kCandidate only
  std::string task;
  int64_t prompt = 0;
};

struct ScheduledUnit {
  UnitKey key;
  double cost = 1;  // relative running time, e.g. prompt tokens
};

struct LeaseGrant {
  uint64_t id = 0;
  UnitKind kind = UnitKind::kCandidate;
  int64_t candidate = 0;
  std::string task;
  std::vector<int64_t> prompts;  // longest first
  bool duplicate = false;        // a copy of a straggling lease
};

enum class ResultOutcome {
  kAccepted,   // the unit's first result
  kLate,       // the first result, on a lease that had expired or been returned
  kDuplicate,  // the unit already had a result: ignored
};

// A lease's units as a worker (re-attaching) or the store (a restarted coordinator) names them.
struct HeldLease {
  uint64_t id = 0;
  UnitKind kind = UnitKind::kCandidate;
  int64_t candidate = 0;
  std::string task;
  std::vector<int64_t> prompts;
};

struct SchedulerOptions {
  int64_t max_prompts_per_lease = 4;
  std::chrono::milliseconds lease_timeout{30000};
  int max_copies = 2;  // workers running one unit at once, straggler copies included
  bool guided_sizes = true;  // shrink leases at the phase's end (else always max_prompts_per_lease)
  int max_attempts = 5;      // different workers a prompt may fail on before it is abandoned
  int quarantine_after = 3;  // failures in a row that end a worker's leasing
  uint64_t first_lease_id = 1;  // ids count up from here (each coordinator start takes a fresh range)
};

// A unit that failed on max_attempts different workers.
struct AbandonedUnit {
  UnitKey key;
  int attempts = 0;
  std::string last_error;
};

struct SchedulerCounters {
  int64_t leases_issued = 0;
  int64_t units_leased = 0;       // prompts in leases_issued
  int64_t leases_duplicated = 0;  // straggler copies among leases_issued
  int64_t leases_expired = 0;
  int64_t leases_returned = 0;    // drained or disconnected workers
  int64_t results_accepted = 0;   // late ones included
  int64_t results_late = 0;
  int64_t results_duplicate = 0;
  int64_t prompts_failed = 0;     // reported by workers as failed
  int64_t units_lost = 0;         // back to the queue from expired leases and vanished workers (no attempt used)
  int64_t units_dropped = 0;      // taken out of the phase by Drop()
  int64_t leases_reattached = 0;  // kept for a worker that registered again (Reattach)
  int64_t leases_reserved = 0;    // kept for a restarted coordinator's workers (Reserve)
};

class LeaseScheduler {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LeaseScheduler(SchedulerOptions options);

  // Replaces the work with a new phase. Leases of the previous phase are forgotten (their holders are told to
  // cancel them) and results for them count as duplicates.
  void StartPhase(const std::vector<ScheduledUnit>& units);

  // Workers. `name` (default: the id) identifies the worker across reconnections when failures are counted.
  // RemoveWorker returns the worker's leases to the queue.
  void AddWorker(const std::string& worker, int slots, const std::string& name = "");
  void RemoveWorker(const std::string& worker);
  // No new leases for the worker; `returned` of its leases go back to the queue (unknown ids are ignored).
  void Drain(const std::string& worker, const std::vector<uint64_t>& returned);
  bool IsDraining(const std::string& worker) const;
  // Too many failures in a row: no more leases for the worker.
  bool IsQuarantined(const std::string& worker) const;
  // Leases the worker holds.
  std::vector<uint64_t> LeasesOf(const std::string& worker) const;

  // Keeps `lease`'s open units that no lease holds (a lease the store had when the coordinator restarted) under
  // the same id for the worker named `worker_name`, until one lease timeout from `now`. Returns whether any was.
  bool Reserve(const std::string& worker_name, const HeldLease& lease, Clock::time_point now);
  // Of `held`, what a worker named `worker_name` cannot hold, with the reason: a lease id this coordinator never
  // issued (beyond the last one issued; 0) or a lease of this phase issued to another name. Reattach() keeps
  // none of those (nor ids of earlier coordinators and phases that are not kept for the name).
  std::vector<std::pair<uint64_t, std::string>> CheckHeld(const std::string& worker_name,
                                                          const std::vector<HeldLease>& held) const;
  // `worker` (just registered) held `held` before: it keeps a lease of this phase issued to its name (reserved for
  // it after a restart, still held by its previous session, or ended since), with the prompts of it that are
  // still open and unheld; units of a kept lease it no longer has go back to the queue. Returns the kept leases
  // with their prompts.
  std::vector<HeldLease> Reattach(const std::string& worker, const std::vector<HeldLease>& held,
                                  Clock::time_point now);
  // `worker` is done with its `lease`: the lease's units without a result go back to the queue (no attempt
  // used). Ignored for a lease the worker does not hold. Returns whether any unit went back to the queue.
  bool Release(const std::string& worker, uint64_t lease);
  // Leases that ended since the last call (for the lease journal).
  std::vector<uint64_t> TakeEnded();

  // Whether Acquire(worker) would return a lease.
  bool HasWorkFor(const std::string& worker) const;
  // The next lease for `worker`, or none when it has no free slot or nothing is left that it could run.
  std::optional<LeaseGrant> Acquire(const std::string& worker, Clock::time_point now);

  // The unit that a result for `prompt` on lease `lease` from `worker` (named `name`: "" for the worker's own) is
  // about. NotFound for an unknown lease (or one of an earlier phase: `stale` is then set and the result counts
  // as a duplicate), InvalidArgument for a lease of another worker or a prompt the lease does not hold. A lease
  // held by another session of the same name is this worker's: a report sent before it registered again.
  Result<UnitKey> Check(const std::string& worker, uint64_t lease, int64_t prompt, bool* stale = nullptr,
                        const std::string& name = "") const;
  // Whether the unit of `prompt` on `lease` (which Check() accepted) has its result already.
  bool HasResult(uint64_t lease, int64_t prompt) const { return units_[static_cast<std::size_t>(UnitOf(lease, prompt))].done; }
  // Records a result that Check() accepted; `seconds` > 0, the time the worker took for it, teaches the
  // scheduler the worker's speed.
  ResultOutcome Complete(uint64_t lease, int64_t prompt, double seconds = 0);
  // The worker's measured speed relative to the mean at the phase's start (1 until known).
  double RelativeSpeed(const std::string& worker) const;
  // Records that the worker of `lease` could not run `prompt` (Check() accepted the pair): the prompt leaves the
  // lease and goes back to the queue, or is abandoned.
  void Fail(uint64_t lease, int64_t prompt, const std::string& error);
  // Takes every unit of (task, prompt), of any candidate or kind and of every variant of the task's base task (as
  // Trainer::Drop), out of the phase: they count as done, their leases are cancelled, and results for them are
  // duplicates. For a prompt the run gave up on (abandoned()).
  void Drop(const std::string& task, int64_t prompt);
  // Counts a result for a lease of an earlier phase.
  void CountStale() { ++counters_.results_duplicate; }

  // Extends the worker's leases among `ids`; returns the ids it no longer holds.
  std::vector<uint64_t> Heartbeat(const std::string& worker, const std::vector<uint64_t>& ids, Clock::time_point now);
  // Leases past their deadline go back to the queue. Returns how many expired.
  int64_t ExpireLeases(Clock::time_point now);
  // Leases of `worker` cancelled since the last call (finished by a copy, or of an ended phase).
  std::vector<uint64_t> TakeCancelled(const std::string& worker);
  bool HasCancelled(const std::string& worker) const;
  // Workers that got a cancellation since the last call, each once: only they need waking.
  std::vector<std::string> TakeCancelNotices();

  bool Done() const { return done_count_ == static_cast<int64_t>(units_.size()); }
  const std::vector<AbandonedUnit>& abandoned() const { return abandoned_; }
  int64_t units_total() const { return static_cast<int64_t>(units_.size()); }
  int64_t units_done() const { return done_count_; }
  int64_t leases_active() const { return static_cast<int64_t>(active_.size()); }
  // Units waiting in the queue (an estimate: a few may have been finished meanwhile by late results).
  int64_t units_queued() const { return queued_units_; }
  const SchedulerCounters& counters() const { return counters_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Unit {
    ScheduledUnit scheduled;
    bool done = false;
    bool abandoned = false;
    std::set<uint64_t> holders;         // active leases running it
    std::set<std::string> failed_on;    // workers it failed on (reported, expired or lost)
    std::string last_error;
  };
  struct Pending {  // a lease waiting in the queue: unit indices, longest first
    std::vector<int64_t> units;
    double cost = 0;
  };
  struct Active {
    std::string worker;
    std::string name;  // the worker's name (its id may be gone: leases are re-attached by name)
    std::vector<int64_t> units;
    Clock::time_point started, deadline;
  };
  struct Worker {
    std::string name;
    int slots = 1;
    bool draining = false;
    std::set<uint64_t> leases;
    std::vector<uint64_t> cancelled;
    std::set<std::pair<UnitKind, int64_t>> ran;  // (kind, candidate) of leases issued in this phase
    int failures_in_a_row = 0;
    bool quarantined = false;
    double cost_done = 0, seconds_done = 0;  // decayed sums of reported prompts: their ratio is the speed
    double Speed() const { return seconds_done > 0 ? cost_done / seconds_done : 0; }
  };

  // Pending leases of at most max_prompts_per_lease units of one (kind, candidate, task), balanced by cost.
  std::vector<Pending> Pack(const std::vector<int64_t>& unit_indices) const;
  // Takes the queued lease `worker` should run next (undone units only), cut to the guided size.
  std::optional<std::vector<int64_t>> TakeQueued(const Worker& worker);
  // Where in the queue `worker` should take from: a lease of a candidate it ran among the equally long ones at
  // the front, or for a slow worker at the phase's end the longest that it would finish in time.
  // None when every queued lease failed on this worker and another worker could take it.
  std::optional<std::size_t> PickQueued(const Worker& worker, double relative_speed) const;
  // A queued lease whose prompt failed on `worker` goes to a worker it has not failed on, while one leases.
  bool LeasableTo(const Worker& worker, const Pending& p) const;
  // Mean speed (cost per second) of the leasing workers whose speed is known; 0 when none is.
  double MeanSpeed() const;
  double RelativeSpeed(const Worker& w) const;
  // Adds (sign +1) or removes (-1) the worker's speed from the mean's sums.
  void CountSpeed(const Worker& w, double sign);
  void PushFront(Pending p);
  // The active lease whose still-unfinished units a copy for `worker` would run (oldest first), if any.
  std::optional<uint64_t> StragglerFor(const std::string& worker) const;
  // Undone units of `lease` that no other active lease runs.
  std::vector<int64_t> Orphans(uint64_t lease) const;
  uint64_t Issue(const std::string& worker, std::vector<int64_t> units, bool duplicate, Clock::time_point now,
                 LeaseGrant* grant);
  // Makes `units` lease `id` of `worker`, with a fresh deadline.
  void Activate(uint64_t id, const std::string& worker, std::vector<int64_t> units, Clock::time_point now);
  // The units `lease` names that are still open and held by no lease (with `holder`: or held by that lease only).
  std::vector<int64_t> OpenUnits(const HeldLease& lease, std::optional<uint64_t> holder = std::nullopt) const;
  // Reattach() of one lease to the worker named `name`. TakeOver: an active lease of that name (reserved for it
  // after a restart, or held by its previous session) leaves its holder, keeping those of its units that the
  // claim names and that are still open (its others go back to the queue; other prompts the claim names stay
  // queued). Readopt: a lease of that name that ended since its connection broke takes back those of its units
  // that are open and unheld. Either returns the units the new session keeps.
  std::vector<int64_t> TakeOver(const HeldLease& h, const std::string& name);
  std::vector<int64_t> Readopt(const HeldLease& h, const std::string& name) const;
  // Ends an active lease; results on it are still taken (as late results or duplicates).
  void EndLease(uint64_t lease, bool cancel);
  // Ends an active lease whose worker is not coming back for it: its orphaned units go back to the queue.
  // `lost`: the lease expired or its worker vanished (counted, but no attempt is used).
  void Requeue(uint64_t lease, bool lost);
  // Counts a failure of unit `u` on the worker named `worker_name`; false when the unit is now abandoned.
  bool CountFailure(int64_t u, const std::string& worker_name, const std::string& error);
  // The index of `prompt` among the units of an active or retired lease.
  int64_t UnitOf(uint64_t lease, int64_t prompt) const;
  // The worker takes no more leases (drained or quarantined).
  void StopLeasing(Worker& w);
  // `lease` of `worker` ends before its results: its holder is told.
  void Cancel(const std::string& worker, uint64_t lease);
  bool FreeSlot(const Worker& w) const { return !w.draining && static_cast<int>(w.leases.size()) < w.slots; }

  SchedulerOptions options_;
  std::vector<Unit> units_;
  std::map<std::tuple<UnitKind, int64_t, std::string, int64_t>, int64_t> index_;  // unit key -> units_ index
  int64_t done_count_ = 0;
  std::vector<uint64_t> ended_;  // since TakeEnded()
  std::deque<Pending> queue_;
  int64_t queued_units_ = 0;  // units in queue_ (a few may have been finished meanwhile by late results)
  std::map<uint64_t, Active> active_;
  std::map<uint64_t, Active> retired_;  // ended leases of this phase
  std::vector<AbandonedUnit> abandoned_;
  std::map<std::string, Worker> workers_;
  int64_t leasing_slots_ = 0;    // slots of workers that take leases (not draining)
  int64_t leasing_workers_ = 0;  // and those workers
  // Slot-weighted sum of the leasing workers' known speeds, and their slots: the mean speed.
  double known_speed_sum_ = 0, known_slots_ = 0;
  double queued_cost_ = 0;     // cost of the units in queue_
  std::vector<std::string> cancel_notices_;  // since TakeCancelNotices()
  uint64_t next_lease_ = 1;
  uint64_t phase_first_lease_ = 1;
  SchedulerCounters counters_;
};

}  // namespace namm::coordinator
