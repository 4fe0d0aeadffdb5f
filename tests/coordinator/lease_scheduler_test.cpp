#include "namm/coordinator/lease_scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>

namespace namm::coordinator {
namespace {

using Clock = LeaseScheduler::Clock;
using std::chrono::milliseconds;

std::vector<ScheduledUnit> Units(int64_t candidates, int64_t prompts, double (*cost)(int64_t) = nullptr) {
  std::vector<ScheduledUnit> out;
  for (int64_t c = 0; c < candidates; ++c) {
    for (int64_t p = 0; p < prompts; ++p) {
      out.push_back({UnitKey{UnitKind::kCandidate, c, "t", p}, cost ? cost(p) : 1.0});
    }
  }
  return out;
}

// Fixed lease sizes, so that tests of expiry, copies and draining know what each lease holds.
SchedulerOptions Options(int64_t per_lease = 4, int timeout_ms = 1000) {
  SchedulerOptions o;
  o.max_prompts_per_lease = per_lease;
  o.guided_sizes = false;
  o.lease_timeout = milliseconds(timeout_ms);
  return o;
}

void CompleteAll(LeaseScheduler& s, const std::string& worker, const LeaseGrant& g) {
  for (int64_t p : g.prompts) {
    ASSERT_TRUE(s.Check(worker, g.id, p).ok());
    s.Complete(g.id, p);
  }
}

TEST(LeaseScheduler, PacksByCandidateAndTaskLongestFirstAndBalanced) {
  LeaseScheduler s(Options(2));
  // Costs 8, 7, 2, 1 for one candidate: balanced pairs are {8, 1} and {7, 2}.
  s.StartPhase(Units(1, 4, [](int64_t p) { return std::vector<double>{8, 2, 7, 1}[static_cast<std::size_t>(p)]; }));
  s.AddWorker("w", 4);
  const Clock::time_point t0;
  auto a = s.Acquire("w", t0), b = s.Acquire("w", t0);
  ASSERT_TRUE(a && b);
  EXPECT_FALSE(s.Acquire("w", t0));
  EXPECT_EQ(a->prompts, (std::vector<int64_t>{0, 3}));  // cost 9, handed first, longest prompt first
  EXPECT_EQ(b->prompts, (std::vector<int64_t>{2, 1}));  // cost 9
  // Leases never mix candidates or tasks.
  LeaseScheduler mixed(Options(4));
  auto units = Units(2, 3);
  units.push_back({UnitKey{UnitKind::kReference, 0, "t", 0}, 1});
  mixed.StartPhase(units);
  mixed.AddWorker("w", 8);
  std::map<std::pair<int, int64_t>, int> groups;
  while (auto g = mixed.Acquire("w", t0)) groups[{static_cast<int>(g->kind), g->candidate}] += static_cast<int>(g->prompts.size());
  EXPECT_EQ(groups.size(), 3u);
  EXPECT_EQ((groups[{0, 0}]), 3);
  EXPECT_EQ((groups[{1, 0}]), 1);
}

TEST(LeaseScheduler, LeasesShrinkToSinglePromptsAtThePhasesEnd) {
  SchedulerOptions guided = Options(4);
  guided.guided_sizes = true;
  LeaseScheduler s(guided);
  s.StartPhase(Units(16, 4));  // 64 equal prompts, 4 workers with one slot each
  for (const char* w : {"a", "b", "c", "d"}) s.AddWorker(w, 1);
  const Clock::time_point t0;
  std::vector<std::size_t> sizes;
  while (!s.Done()) {
    for (const char* w : {"a", "b", "c", "d"}) {
      if (auto g = s.Acquire(w, t0)) {
        sizes.push_back(g->prompts.size());
        CompleteAll(s, w, *g);
      }
    }
  }
  // ceil(queued / 4 slots), at most 4: full leases while 13 or more prompts wait, single prompts at the end.
  ASSERT_GE(sizes.size(), 8u);
  EXPECT_EQ(sizes.front(), 4u);
  for (std::size_t i = sizes.size() - 4; i < sizes.size(); ++i) EXPECT_EQ(sizes[i], 1u) << "lease " << i;
  EXPECT_EQ(std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}), 64u);
  EXPECT_EQ(s.counters().results_accepted, 64);
}

TEST(LeaseScheduler, AWorkerKeepsToCandidatesItAlreadyRan) {
  LeaseScheduler s(Options(2));
  // Per candidate the leases {10, 1} (cost 11) and {9.95, 1} (10.95): in longest-first order the four
  // candidates' first leases come before any second one.
  s.StartPhase(Units(4, 4, [](int64_t p) { return std::vector<double>{10, 9.95, 1, 1}[static_cast<std::size_t>(p)]; }));
  s.AddWorker("a", 1);
  s.AddWorker("b", 1);
  const Clock::time_point t0;
  auto a1 = s.Acquire("a", t0), b1 = s.Acquire("b", t0);
  ASSERT_TRUE(a1 && b1);
  EXPECT_EQ(a1->candidate, 0);
  EXPECT_EQ(b1->candidate, 1);
  CompleteAll(s, "a", *a1);
  CompleteAll(s, "b", *b1);
  // Candidates 2 and 3 are next in line, but the second leases of 0 and 1 are as long (within 1%).
  auto a2 = s.Acquire("a", t0), b2 = s.Acquire("b", t0);
  ASSERT_TRUE(a2 && b2);
  EXPECT_EQ(a2->candidate, 0) << "a has these parameters already";
  EXPECT_EQ(b2->candidate, 1);
  auto a3 = s.Acquire("a", t0);
  EXPECT_FALSE(a3) << "one slot";
  CompleteAll(s, "a", *a2);
  a3 = s.Acquire("a", t0);
  ASSERT_TRUE(a3);
  EXPECT_EQ(a3->candidate, 2) << "nothing of candidate 0 is left: the front of the queue";
}

TEST(LeaseScheduler, SlotsLimitLeasesAndEveryUnitCountsOnce) {
  LeaseScheduler s(Options(3));
  s.StartPhase(Units(4, 6));
  s.AddWorker("a", 1);
  s.AddWorker("b", 2);
  const Clock::time_point t0;
  auto a1 = s.Acquire("a", t0);
  ASSERT_TRUE(a1);
  EXPECT_FALSE(s.HasWorkFor("a"));
  EXPECT_FALSE(s.Acquire("a", t0));
  CompleteAll(s, "a", *a1);
  EXPECT_TRUE(s.HasWorkFor("a"));
  // Finishing everything from both workers: each unit is accepted exactly once.
  while (!s.Done()) {
    for (const char* w : {"a", "b"}) {
      if (auto g = s.Acquire(w, t0)) CompleteAll(s, w, *g);
    }
  }
  EXPECT_EQ(s.counters().results_accepted, 24);
  EXPECT_EQ(s.counters().results_duplicate, 0);
  EXPECT_EQ(s.units_done(), 24);
}

TEST(LeaseScheduler, ExpiredLeasesAreReissuedAndLateResultsStillCountOnce) {
  LeaseScheduler s(Options(2, 100));
  s.StartPhase(Units(1, 2));
  s.AddWorker("slow", 1);
  s.AddWorker("fast", 1);
  const Clock::time_point t0;
  auto g = s.Acquire("slow", t0);
  ASSERT_TRUE(g);
  // A heartbeat extends the lease; without one it expires.
  EXPECT_TRUE(s.Heartbeat("slow", {g->id}, t0 + milliseconds(80)).empty());
  EXPECT_EQ(s.ExpireLeases(t0 + milliseconds(150)), 0);
  EXPECT_EQ(s.ExpireLeases(t0 + milliseconds(181)), 1);
  EXPECT_EQ(s.TakeCancelled("slow"), std::vector<uint64_t>{g->id});
  EXPECT_EQ(s.Heartbeat("slow", {g->id}, t0 + milliseconds(190)), std::vector<uint64_t>{g->id});
  auto again = s.Acquire("fast", t0 + milliseconds(200));
  ASSERT_TRUE(again);
  EXPECT_FALSE(again->duplicate);
  EXPECT_EQ(again->prompts, g->prompts);
  // The slow worker's late result for prompt 0 wins; the re-issued lease's copy is a duplicate.
  ASSERT_TRUE(s.Check("slow", g->id, g->prompts[0]).ok());
  EXPECT_EQ(s.Complete(g->id, g->prompts[0]), ResultOutcome::kLate);
  EXPECT_EQ(s.Complete(again->id, g->prompts[0]), ResultOutcome::kDuplicate);
  EXPECT_EQ(s.Complete(again->id, g->prompts[1]), ResultOutcome::kAccepted);
  EXPECT_TRUE(s.Done());
  EXPECT_EQ(s.counters().results_accepted, 2);
  EXPECT_EQ(s.counters().results_late, 1);
  EXPECT_EQ(s.counters().results_duplicate, 1);
  EXPECT_EQ(s.counters().leases_expired, 1);
}

TEST(LeaseScheduler, StragglersAreDuplicatedOnIdleWorkersAndTheLoserIsCancelled) {
  LeaseScheduler s(Options(2));
  s.StartPhase(Units(1, 4));
  s.AddWorker("a", 1);
  s.AddWorker("b", 1);
  s.AddWorker("c", 1);
  const Clock::time_point t0;
  auto ga = s.Acquire("a", t0);
  auto gb = s.Acquire("b", t0 + milliseconds(1));
  ASSERT_TRUE(ga && gb);
  // The queue is empty: c copies the oldest running lease (a's).
  auto gc = s.Acquire("c", t0 + milliseconds(2));
  ASSERT_TRUE(gc);
  EXPECT_TRUE(gc->duplicate);
  EXPECT_EQ(gc->prompts, ga->prompts);
  EXPECT_EQ(s.counters().leases_duplicated, 1);
  // At most two holders per unit: a and c both hold a's units, so c's next copy comes from b.
  CompleteAll(s, "c", *gc);
  EXPECT_EQ(s.TakeCancelled("a"), std::vector<uint64_t>{ga->id});
  EXPECT_TRUE(s.LeasesOf("a").empty());
  // a's late results are duplicates, never counted twice.
  ASSERT_TRUE(s.Check("a", ga->id, ga->prompts[0]).ok());
  EXPECT_EQ(s.Complete(ga->id, ga->prompts[0]), ResultOutcome::kDuplicate);
  CompleteAll(s, "b", *gb);
  EXPECT_TRUE(s.Done());
  EXPECT_EQ(s.counters().results_accepted, 4);
}

TEST(LeaseScheduler, DisconnectAndDrainReturnLeases) {
  LeaseScheduler s(Options(4));
  s.StartPhase(Units(2, 4));
  s.AddWorker("a", 2);
  s.AddWorker("b", 1);
  const Clock::time_point t0;
  auto g1 = s.Acquire("a", t0), g2 = s.Acquire("a", t0);
  ASSERT_TRUE(g1 && g2);
  s.Drain("a", {g2->id});
  EXPECT_FALSE(s.HasWorkFor("a"));
  auto gb = s.Acquire("b", t0);
  ASSERT_TRUE(gb);
  EXPECT_EQ(gb->prompts, g2->prompts);  // the returned lease is next in line
  s.RemoveWorker("a");
  EXPECT_EQ(s.counters().leases_returned, 2);
  CompleteAll(s, "b", *gb);
  auto again = s.Acquire("b", t0);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->prompts, g1->prompts);
  CompleteAll(s, "b", *again);
  EXPECT_TRUE(s.Done());
}

TEST(LeaseScheduler, FailedPromptsGoBackAndAreAbandonedAfterFailingOnEnoughWorkers) {
  SchedulerOptions o = Options(2);
  o.max_attempts = 2;
  LeaseScheduler s(o);
  s.StartPhase(Units(1, 2));
  s.AddWorker("a", 1, "host-a");
  s.AddWorker("b", 1, "host-b");
  const Clock::time_point t0;
  auto ga = s.Acquire("a", t0);
  ASSERT_TRUE(ga);
  ASSERT_EQ(ga->prompts.size(), 2u);
  // a runs one prompt and fails the other: the failed one leaves the lease and goes back to the queue.
  ASSERT_TRUE(s.Check("a", ga->id, ga->prompts[0]).ok());
  s.Fail(ga->id, ga->prompts[0], "out of memory");
  EXPECT_EQ(s.Complete(ga->id, ga->prompts[1]), ResultOutcome::kAccepted);
  EXPECT_TRUE(s.LeasesOf("a").empty());
  EXPECT_EQ(s.counters().prompts_failed, 1);
  auto gb = s.Acquire("b", t0);
  ASSERT_TRUE(gb);
  EXPECT_EQ(gb->prompts, std::vector<int64_t>{ga->prompts[0]});
  // Failing on a second worker abandons it, with the last error.
  s.Fail(gb->id, gb->prompts[0], "out of memory again");
  ASSERT_EQ(s.abandoned().size(), 1u);
  EXPECT_EQ(s.abandoned()[0].key.prompt, ga->prompts[0]);
  EXPECT_EQ(s.abandoned()[0].attempts, 2);
  EXPECT_EQ(s.abandoned()[0].last_error, "out of memory again");
  EXPECT_FALSE(s.Done());
  EXPECT_FALSE(s.Acquire("a", t0)) << "an abandoned prompt is not leased again";
}

// A failure reported for a lease whose worker has since gone (its stream ended; it registered again under a new
// id) counts on that worker's name: one host cannot use up a prompt's attempts alone by reconnecting (the old
// id, gone from the workers, counted as another worker, and the prompt was abandoned on one host).
TEST(LeaseScheduler, AFailureUnderAGoneWorkersIdCountsOnItsName) {
  SchedulerOptions o = Options(1);
  o.max_attempts = 2;
  LeaseScheduler s(o);
  s.StartPhase(Units(1, 1));
  const Clock::time_point t0;
  s.AddWorker("w-1", 1, "host-a");
  const auto first = s.Acquire("w-1", t0);
  ASSERT_TRUE(first);
  s.RemoveWorker("w-1");
  s.Fail(first->id, first->prompts[0], "out of memory");
  s.AddWorker("w-2", 1, "host-a");
  const auto second = s.Acquire("w-2", t0);
  ASSERT_TRUE(second);
  s.Fail(second->id, second->prompts[0], "out of memory");
  EXPECT_TRUE(s.abandoned().empty()) << "abandoned after failing on one host only";
  s.AddWorker("b", 1, "host-b");
  const auto third = s.Acquire("b", t0);
  ASSERT_TRUE(third);
  s.Fail(third->id, third->prompts[0], "out of memory");
  ASSERT_EQ(s.abandoned().size(), 1u);
  EXPECT_EQ(s.abandoned()[0].attempts, 2);
}

TEST(LeaseScheduler, LostLeasesAndDrainsUseNoAttempts) {
  SchedulerOptions o = Options(1, 100);
  o.max_attempts = 2;
  LeaseScheduler s(o);
  s.StartPhase(Units(1, 1));
  const Clock::time_point t0;
  // Returned by a draining worker, expired on b, lost with c's connection: none of it says anything about the
  // prompt, so it is never abandoned and the next worker runs it.
  s.AddWorker("a", 1, "host-a");
  auto g = s.Acquire("a", t0);
  ASSERT_TRUE(g);
  s.Drain("a", {g->id});
  s.AddWorker("b", 1, "host-b");
  g = s.Acquire("b", t0);
  ASSERT_TRUE(g);
  s.ExpireLeases(t0 + milliseconds(200));
  s.AddWorker("c", 1, "host-c");
  g = s.Acquire("c", t0);
  ASSERT_TRUE(g);
  s.RemoveWorker("c");
  EXPECT_TRUE(s.abandoned().empty());
  EXPECT_EQ(s.counters().units_lost, 2) << "the expiry and the lost connection; the drain returned its lease";
  s.AddWorker("d", 1, "host-d");
  g = s.Acquire("d", t0);
  ASSERT_TRUE(g);
  CompleteAll(s, "d", *g);
  EXPECT_TRUE(s.Done());
}

TEST(LeaseScheduler, ADroppedPromptLeavesThePhaseForEveryCandidate) {
  LeaseScheduler s(Options(2));
  s.StartPhase(Units(3, 2));  // candidates 0..2 x prompts 0..1
  s.AddWorker("a", 8);
  const Clock::time_point t0;
  auto g0 = s.Acquire("a", t0);  // one candidate's two prompts
  ASSERT_TRUE(g0);
  s.Drop("t", 1);
  EXPECT_EQ(s.units_done(), 3) << "prompt 1 of each of the three candidates";
  EXPECT_EQ(s.counters().units_dropped, 3);
  // The running lease keeps its other prompt; results for the dropped one are duplicates.
  EXPECT_EQ(s.Complete(g0->id, 1), ResultOutcome::kDuplicate);
  EXPECT_EQ(s.Complete(g0->id, 0), ResultOutcome::kAccepted);
  std::vector<int64_t> leased;
  while (auto g = s.Acquire("a", t0)) {
    leased.insert(leased.end(), g->prompts.begin(), g->prompts.end());
    CompleteAll(s, "a", *g);
  }
  EXPECT_EQ(leased, (std::vector<int64_t>{0, 0})) << "only prompt 0 of the two other candidates is left";
  EXPECT_TRUE(s.Done());
}

// A run over budgets: the reference unit of a prompt is named by its base task ("t"), its candidates' units by
// the variants; dropping the prompt under either name takes every one of them out, and no other task's.
TEST(LeaseScheduler, ADroppedPromptLeavesEveryVariantOfItsTask) {
  for (const char* named : {"t", "t@budget=8"}) {
    SCOPED_TRACE(named);
    LeaseScheduler s(Options(2));
    std::vector<ScheduledUnit> units;
    for (const char* task : {"t@budget=8", "t@budget=16", "u@budget=8"}) {
      for (int64_t p = 0; p < 2; ++p) units.push_back({UnitKey{UnitKind::kCandidate, 0, task, p}, 1.0});
    }
    units.push_back({UnitKey{UnitKind::kReference, 0, "t", 1}, 1.0});
    s.StartPhase(units);
    s.Drop(named, 1);
    EXPECT_EQ(s.units_done(), 3) << "t@budget=8 and t@budget=16's prompt 1, and its reference";
  }
}

TEST(LeaseScheduler, ARestartedCoordinatorKeepsLeasesForTheirHoldersUntilTheyComeBackOrTimeOut) {
  SchedulerOptions o = Options(2, 1000);
  o.first_lease_id = (uint64_t{7} << 32) + 1;
  LeaseScheduler s(o);
  s.StartPhase(Units(2, 4));  // candidates 0, 1 x prompts 0..3
  const Clock::time_point t0;
  // The previous coordinator had leased candidate 0's prompts 0, 1 to host-a and 2, 3 to host-b.
  EXPECT_TRUE(s.Reserve("host-a", HeldLease{11, UnitKind::kCandidate, 0, "t", {0, 1}}, t0));
  EXPECT_TRUE(s.Reserve("host-b", HeldLease{12, UnitKind::kCandidate, 0, "t", {2, 3}}, t0));
  EXPECT_FALSE(s.Reserve("host-c", HeldLease{13, UnitKind::kCandidate, 0, "t", {0}}, t0)) << "already reserved";
  // Another worker gets only what nobody holds; new ids come from this coordinator's range.
  s.AddWorker("w-c", 1, "host-c");
  auto g = s.Acquire("w-c", t0 + milliseconds(600));
  ASSERT_TRUE(g);
  EXPECT_EQ(g->candidate, 1);
  EXPECT_GT(g->id, uint64_t{7} << 32);
  // host-a comes back holding lease 11 (both prompts still unreported): it keeps them, and results on lease 11
  // are taken.
  s.AddWorker("w-a", 1, "host-a");
  const auto kept = s.Reattach("w-a", {HeldLease{11, UnitKind::kCandidate, 0, "t", {0, 1}}}, t0 + milliseconds(500));
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].prompts, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(s.LeasesOf("w-a"), std::vector<uint64_t>{11});
  ASSERT_TRUE(s.Check("w-a", 11, 1).ok());
  EXPECT_EQ(s.Complete(11, 1), ResultOutcome::kAccepted);
  // Another worker cannot claim host-b's lease 12.
  EXPECT_EQ(s.Complete(11, 0), ResultOutcome::kAccepted);
  s.AddWorker("w-x", 1, "host-x");
  EXPECT_TRUE(s.Reattach("w-x", {HeldLease{12, UnitKind::kCandidate, 0, "t", {2, 3}}}, t0).empty());
  // host-b never comes back: its reservation expires and its prompts are leased again, without using attempts.
  EXPECT_EQ(s.ExpireLeases(t0 + milliseconds(1001)), 1);
  EXPECT_TRUE(s.abandoned().empty());
  std::vector<int64_t> again;
  while (auto l = s.Acquire("w-x", t0 + milliseconds(1002))) {
    if (l->candidate == 0) again.insert(again.end(), l->prompts.begin(), l->prompts.end());
    CompleteAll(s, "w-x", *l);
  }
  std::sort(again.begin(), again.end());
  EXPECT_EQ(again, (std::vector<int64_t>{2, 3}));
  CompleteAll(s, "w-c", *g);
  EXPECT_TRUE(s.Done());
  EXPECT_EQ(s.counters().leases_reserved, 2);
  EXPECT_EQ(s.counters().leases_reattached, 1);
}

TEST(LeaseScheduler, AWorkerWhoseConnectionBrokeReadoptsWhatNobodyTookAndReleasesWhatItWillNotRun) {
  LeaseScheduler s(Options(4, 1000));
  s.StartPhase(Units(1, 4));
  const Clock::time_point t0;
  s.AddWorker("w-1", 1, "host-a");
  auto g = s.Acquire("w-1", t0);
  ASSERT_TRUE(g);
  ASSERT_EQ(g->prompts.size(), 4u);
  s.RemoveWorker("w-1");  // its stream broke: the lease's prompts are back in the queue
  // Before anyone took them, it registers again naming three of them (it no longer has the fourth).
  s.AddWorker("w-2", 1, "host-a");
  const std::vector<int64_t> named = {g->prompts[0], g->prompts[1], g->prompts[2]};
  const auto kept = s.Reattach("w-2", {HeldLease{g->id, UnitKind::kCandidate, 0, "t", named}}, t0);
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].prompts.size(), 3u);
  // The fourth prompt is the only one left to lease.
  s.AddWorker("w-3", 1, "host-b");
  auto rest = s.Acquire("w-3", t0);
  ASSERT_TRUE(rest);
  EXPECT_EQ(rest->prompts, std::vector<int64_t>{g->prompts[3]});
  // It runs one prompt and is done with the lease: the other two go back at once.
  ASSERT_TRUE(s.Check("w-2", g->id, named[0]).ok());
  s.Complete(g->id, named[0]);
  s.Release("w-3", g->id);  // not its lease: ignored
  EXPECT_EQ(s.LeasesOf("w-2"), std::vector<uint64_t>{g->id});
  s.Release("w-2", g->id);
  EXPECT_TRUE(s.LeasesOf("w-2").empty());
  EXPECT_EQ(s.units_queued(), 2);
  EXPECT_EQ(s.counters().units_lost, 4) << "the broken stream; the release is not a loss";
}

// A worker that registers again while its lease is still active keeps that lease's prompts, and no others:
// naming queued prompts (of its candidate or another's) in the claim must not move them into its lease.
TEST(LeaseScheduler, ATakenOverLeaseKeepsOnlyItsOwnPromptsWhateverTheClaimNames) {
  LeaseScheduler s(Options(2, 1000));
  s.StartPhase(Units(2, 4));  // candidates 0, 1 x prompts 0..3
  const Clock::time_point t0;
  s.AddWorker("w-1", 1, "host-a");
  auto g = s.Acquire("w-1", t0);
  ASSERT_TRUE(g);
  ASSERT_EQ(g->prompts.size(), 2u);
  std::vector<int64_t> claim = g->prompts;
  for (int64_t p = 0; p < 4; ++p) {
    if (std::find(claim.begin(), claim.end(), p) == claim.end()) claim.push_back(p);
  }
  const int64_t queued = s.units_queued();
  s.AddWorker("w-2", 1, "host-a");  // the same host again, its first stream not yet gone
  const auto kept = s.Reattach("w-2", {HeldLease{g->id, UnitKind::kCandidate, g->candidate, "t", claim}}, t0);
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].prompts, g->prompts);
  EXPECT_EQ(s.units_queued(), queued) << "the queue keeps the prompts the claim named beyond the lease";
  // A claim of the same lease id naming another candidate's prompts keeps nothing of them.
  s.AddWorker("w-3", 1, "host-a");
  EXPECT_TRUE(s.Reattach("w-3", {HeldLease{g->id, UnitKind::kCandidate, 1 - g->candidate, "t", {0, 1, 2, 3}}}, t0).empty());
  // Every unit is still leased once and completed.
  int64_t leased = 0;
  while (auto l = s.Acquire("w-3", t0)) {
    leased += static_cast<int64_t>(l->prompts.size());
    CompleteAll(s, "w-3", *l);
  }
  EXPECT_EQ(leased, 8);
  EXPECT_TRUE(s.Done());
}

// A registration naming a lease id this coordinator never issued (or another worker's) must not activate it:
// the next lease issued would take the same id, and the units of the forged one would stay held forever.
TEST(LeaseScheduler, AForgedOrForeignHeldLeaseIsNotKeptAndNeverStrandsTheGeneration) {
  SchedulerOptions o = Options(2, 1000);
  o.first_lease_id = (uint64_t{3} << 32) + 1;
  LeaseScheduler s(o);
  s.StartPhase(Units(1, 4));
  const Clock::time_point t0;
  s.AddWorker("w-a", 1, "host-a");
  auto first = s.Acquire("w-a", t0);
  ASSERT_TRUE(first);
  const uint64_t next = first->id + 1;  // the id the next lease will get
  const HeldLease forged{next, UnitKind::kCandidate, 0, "t", {0, 1, 2, 3}};
  const HeldLease foreign{first->id, UnitKind::kCandidate, 0, "t", first->prompts};
  const HeldLease earlier{12, UnitKind::kCandidate, 0, "t", {2, 3}};  // an earlier coordinator's id
  using Refusals = std::vector<std::pair<uint64_t, std::string>>;
  EXPECT_EQ(s.CheckHeld("host-m", {forged, HeldLease{0, UnitKind::kCandidate, 0, "t", {0}}, foreign, earlier}),
            (Refusals{{next, "this coordinator never issued it"},
                      {0, "this coordinator never issued it"},
                      {first->id, "it was issued to another worker"}}));
  EXPECT_TRUE(s.CheckHeld("host-a", {foreign}).empty());
  // Reattach() adopts none of them: a forged id would collide with the next lease issued.
  s.AddWorker("w-m", 1, "host-m");
  EXPECT_TRUE(s.Reattach("w-m", {forged, foreign, earlier}, t0).empty());
  EXPECT_TRUE(s.LeasesOf("w-m").empty());
  // host-a's lease is retired for it when its stream breaks: host-m still cannot take it.
  s.RemoveWorker("w-a");
  EXPECT_EQ(s.CheckHeld("host-m", {foreign}).size(), 1u);
  EXPECT_TRUE(s.Reattach("w-m", {foreign}, t0).empty());
  // Every unit is leased and completed: nothing is stranded.
  while (auto l = s.Acquire("w-m", t0)) CompleteAll(s, "w-m", *l);
  EXPECT_TRUE(s.Done());
}

TEST(LeaseScheduler, AWorkerFailingPromptsInARowGetsNoMoreLeases) {
  LeaseScheduler s(Options(1));
  s.StartPhase(Units(1, 6));
  s.AddWorker("bad", 1);
  s.AddWorker("good", 1);
  const Clock::time_point t0;
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(s.IsQuarantined("bad"));
    auto g = s.Acquire("bad", t0);
    ASSERT_TRUE(g);
    s.Fail(g->id, g->prompts[0], "broken");
  }
  EXPECT_TRUE(s.IsQuarantined("bad"));
  EXPECT_FALSE(s.Acquire("bad", t0));
  while (auto g = s.Acquire("good", t0)) CompleteAll(s, "good", *g);
  EXPECT_TRUE(s.Done()) << "the good worker ran every prompt, the failed ones included";
  EXPECT_TRUE(s.abandoned().empty());
}

TEST(LeaseScheduler, ChecksNameTheProblemAndOldPhasesAreStale) {
  LeaseScheduler s(Options(2));
  s.StartPhase(Units(1, 2));
  s.AddWorker("a", 1);
  s.AddWorker("b", 1);
  auto g = s.Acquire("a", Clock::time_point());
  ASSERT_TRUE(g);
  EXPECT_NE(s.Check("b", g->id, 0).status().message().find("another worker"), std::string::npos);
  EXPECT_NE(s.Check("a", g->id, 9).status().message().find("prompt 9 is not part of lease"), std::string::npos);
  EXPECT_NE(s.Check("a", 999, 0).status().message().find("unknown lease 999"), std::string::npos);
  s.StartPhase(Units(1, 2));
  EXPECT_EQ(s.TakeCancelled("a"), std::vector<uint64_t>{g->id});
  bool stale = false;
  EXPECT_FALSE(s.Check("a", g->id, 0, &stale).ok());
  EXPECT_TRUE(stale);
  EXPECT_TRUE(s.HasWorkFor("a"));
  // An ended lease still takes late results, from its own worker only.
  auto h = s.Acquire("a", Clock::time_point());
  ASSERT_TRUE(h);
  s.Drain("a", {h->id});
  EXPECT_TRUE(s.Check("a", h->id, h->prompts[0]).ok());
  EXPECT_NE(s.Check("b", h->id, h->prompts[0]).status().message().find("another worker"), std::string::npos);
}

// Speeds come from the seconds workers report: a worker at half the mean speed gets a short lease where the
// longest would finish after the queue drains, and straggler copies go to the lease expected to finish last
// (the slow worker's), not to the oldest one.
TEST(LeaseScheduler, SlowWorkersGetShortWorkAtTheEndAndTheirLeasesAreCopiedFirst) {
  LeaseScheduler s(Options(1));
  s.AddWorker("fast", 1);
  s.AddWorker("slow", 1);
  s.StartPhase(Units(1, 8));  // unit costs 1: fast reports 1 s per prompt, slow 4 s
  const Clock::time_point t0;
  while (!s.Done()) {
    for (const auto& [worker, seconds] : std::map<std::string, double>{{"fast", 1.0}, {"slow", 4.0}}) {
      if (auto g = s.Acquire(worker, t0)) {
        for (int64_t p : g->prompts) s.Complete(g->id, p, seconds);
      }
    }
  }
  EXPECT_NEAR(s.RelativeSpeed("fast"), 1.6, 1e-9);  // speeds 1 and 0.25 cost/s, mean 0.625
  EXPECT_NEAR(s.RelativeSpeed("slow"), 0.4, 1e-9);
  EXPECT_EQ(s.RelativeSpeed("unknown"), 1.0);

  // Costs 10, 1, 1: on the slow worker the 10 would take 24 s more than on an average one, longer than the
  // queue's 9.6 s until it drains at the mean speed: it takes a 1, the fast one the 10.
  s.StartPhase(Units(1, 3, [](int64_t p) { return p == 0 ? 10.0 : 1.0; }));
  auto slow = s.Acquire("slow", t0);
  auto fast = s.Acquire("fast", t0);
  ASSERT_TRUE(slow && fast);
  EXPECT_EQ(slow->prompts, std::vector<int64_t>{1});
  EXPECT_EQ(fast->prompts, std::vector<int64_t>{0});

  // Two running leases of cost 4: the fast one's is older, the slow one's ends later (t0 + 1 + 16 s against
  // t0 + 4 s). A newcomer with nothing queued copies the slow one's.
  s.StartPhase(Units(1, 2, [](int64_t) { return 4.0; }));
  auto first = s.Acquire("fast", t0);
  auto second = s.Acquire("slow", t0 + std::chrono::seconds(1));
  ASSERT_TRUE(first && second);
  s.AddWorker("newcomer", 1);
  auto copy = s.Acquire("newcomer", t0 + std::chrono::seconds(2));
  ASSERT_TRUE(copy);
  EXPECT_TRUE(copy->duplicate);
  EXPECT_EQ(copy->prompts, second->prompts);
}

// A prompt a worker failed goes to another worker, even when the failing one asks first and the prompt is the
// longest queued one: it would otherwise fail there again and again without reaching max_attempts.
TEST(LeaseScheduler, AFailedPromptGoesToAWorkerItHasNotFailedOn) {
  SchedulerOptions o = Options(1);
  o.max_attempts = 2;
  o.max_copies = 1;  // no straggler copies: only the queue
  LeaseScheduler s(o);
  s.AddWorker("a", 1, "worker-a");
  s.AddWorker("b", 1, "worker-b");
  s.StartPhase(Units(1, 2, [](int64_t p) { return p == 0 ? 10.0 : 1.0; }));
  const Clock::time_point t0;
  auto first = s.Acquire("a", t0);
  auto second = s.Acquire("b", t0);
  ASSERT_TRUE(first && second);
  ASSERT_EQ(first->prompts, std::vector<int64_t>{0});
  s.Fail(first->id, 0, "boom");
  EXPECT_FALSE(s.HasWorkFor("a")) << "prompt 0 waits for worker b";
  EXPECT_FALSE(s.Acquire("a", t0));
  CompleteAll(s, "b", *second);
  auto retry = s.Acquire("b", t0);
  ASSERT_TRUE(retry);
  EXPECT_EQ(retry->prompts, std::vector<int64_t>{0});
  s.Fail(retry->id, 0, "boom again");
  ASSERT_EQ(s.abandoned().size(), 1u);
  EXPECT_EQ(s.abandoned()[0].attempts, 2);
  // With b gone, a may retry what only it could still run.
  s.StartPhase(Units(1, 1));
  auto again = s.Acquire("a", t0);
  ASSERT_TRUE(again);
  s.Fail(again->id, 0, "boom");
  s.RemoveWorker("b");
  EXPECT_TRUE(s.HasWorkFor("a"));
}

}  // namespace
}  // namespace namm::coordinator
