// namm-coordinator: the training run's coordinator (CMA-ES, stage schedule, SQLite store).
#include <algorithm>
#include <iostream>

#include "commands.h"

namespace namm::coordinator::cli {

int Fail(const std::string& message) {
  std::cerr << "namm-coordinator: error: " << message << "\n";
  return 1;
}

CLI::Validator RunIdNumber() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const bool digits = !text.empty() && text.size() <= 18 &&
                            std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (!digits || std::stoll(text) < 1) return "'" + text + "' is not a run id (a whole number from 1)";
        return std::string();
      },
      "RUN");
}

Result<OpenedRun> OpenRun(const Store& store, int64_t run_id) {
  OpenedRun opened;
  if (run_id == 0) {
    NAMM_ASSIGN_OR_RETURN(std::vector<RunRecord> runs, store.ListRuns());
    if (runs.empty()) return Status::NotFound(store.path() + " holds no run yet");
    opened.run = runs.back();
  } else {
    NAMM_ASSIGN_OR_RETURN(opened.run, store.GetRun(run_id));
  }
  const std::string what = "the spec of run " + std::to_string(opened.run.id);
  NAMM_ASSIGN_OR_RETURN(opened.spec, parse_run_spec(opened.run.spec_yaml, what));
  NAMM_ASSIGN_OR_RETURN(opened.params, make_cmaes_params(opened.spec.architecture.param_count(), opened.spec.cmaes));
  return opened;
}

}  // namespace namm::coordinator::cli

int main(int argc, char** argv) {
  CLI::App app{
      "namm-coordinator: trains Neural Attention Memory Models with CMA-ES over an incremental task schedule.\n"
      "A run lives in one SQLite database: its spec, every generation and evaluation, checkpoints of the\n"
      "optimizer, and the base model's reference scores."};
  app.require_subcommand(1);
  namm::coordinator::cli::Action run;
  namm::coordinator::cli::AddStatusCommand(app, run);
  namm::coordinator::cli::AddExportCommand(app, run);
  namm::coordinator::cli::AddImportReferenceCommand(app, run);
  namm::coordinator::cli::AddImportCheckpointCommand(app, run);
  namm::coordinator::cli::AddReportCommand(app, run);
  namm::coordinator::cli::AddServeCommands(app, run);
  CLI11_PARSE(app, argc, argv);
  try {
    return run();
  } catch (const std::exception& e) {
    return namm::coordinator::cli::Fail(e.what());
  }
}
