// namm-coordinator subcommands. Each Add*Command registers its options on `app` and sets `run` to the action.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <memory>
#include <string>

#include "namm/coordinator/cma_es.h"
#include "namm/coordinator/run_spec.h"
#include "namm/coordinator/store.h"

namespace namm::coordinator::cli {

// The action of the chosen subcommand; returns the process exit code.
using Action = std::function<int()>;

void AddStatusCommand(CLI::App& app, Action& run);
void AddExportCommand(CLI::App& app, Action& run);
void AddImportReferenceCommand(CLI::App& app, Action& run);
void AddImportCheckpointCommand(CLI::App& app, Action& run);
void AddReportCommand(CLI::App& app, Action& run);
// serve and run.
void AddServeCommands(CLI::App& app, Action& run);

// A run id (or another count that starts at 1) as the user wrote it: 1 to 10^18 in decimal digits. CLI11 alone
// clamps what overflows int64 (--run 18446744073709551617 was run 9223372036854775807).
CLI::Validator RunIdNumber();

// Prints "namm-coordinator: error: <message>" to stderr and returns 1.
int Fail(const std::string& message);

// The run `run_id`, or the database's newest run when run_id is 0; with its spec and optimizer parameters.
struct OpenedRun {
  RunRecord run;
  RunSpec spec;
  CmaesParams params;
};
Result<OpenedRun> OpenRun(const Store& store, int64_t run_id);

}  // namespace namm::coordinator::cli
