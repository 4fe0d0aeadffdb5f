// A separate process for the crash tests: runs (or resumes) the synthetic training run in a database, and with
// --pause-in-commit G stops inside generation G's commit transaction, announces it on stdout and waits to be
// killed. --long runs 70 generations instead of 5, decomposing every few (snapshots, rebuilds on resume).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "synthetic_run.h"

using namespace namm::coordinator;

int main(int argc, char** argv) {
  int64_t pause_at = -1;
  bool long_run = false;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--pause-in-commit" && i + 1 < argc) {
      pause_at = std::atoll(argv[++i]);
    } else if (arg == "--long") {
      long_run = true;
    } else {
      std::fprintf(stderr, "usage: %s DB [--long] [--pause-in-commit GENERATION]\n", argv[0]);
      return 2;
    }
  }
  if (argc < 2) return 2;
  Trainer* trainer = nullptr;
  StoreOptions options;
  options.before_commit = [&] {
    if (trainer != nullptr && trainer->plan().generation == pause_at) {
      std::printf("IN_COMMIT %lld\n", static_cast<long long>(pause_at));
      std::fflush(stdout);
      for (;;) pause();
    }
  };
  auto store = Store::Open(argv[1], OpenMode::kCreate, options);
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    return 1;
  }
  auto runs = (*store)->ListRuns();
  namm::Result<std::unique_ptr<Trainer>> t = namm::Status::Internal("unset");
  if (runs.ok() && runs->empty()) {
    const RunSpec spec = parse_run_spec(long_run ? testing::SyntheticSpecYaml("synthetic", 40, 30, testing::kFrequentDecompositions) : testing::SyntheticSpecYaml(), "spec").value();
    auto imported = (*store)->ImportReferenceScores(
        "synthetic-model", testing::SyntheticReference(spec.architecture.param_count()), "test", false);
    if (!imported.ok()) return 1;
    t = Trainer::Create(**store, spec, testing::SyntheticTaskRows());
  } else {
    t = Trainer::Resume(**store, 1, testing::SyntheticTaskRows());
  }
  if (!t.ok()) {
    std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
    return 1;
  }
  trainer = t->get();
  const namm::Status st = testing::DriveRun(*trainer);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("FINISHED\n");
  return 0;
}
