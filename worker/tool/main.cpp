// namm-worker: runs a Llama-family model with a NAMM (or a baseline memory policy).
#include <iostream>

#include "commands.h"
#include "namm/worker/llama_model.h"

namespace namm::worker::cli {
int Fail(const std::string& message) {
  std::cerr << "namm-worker: error: " << message << "\n";
  return 1;
}
}  // namespace namm::worker::cli

int main(int argc, char** argv) {
  CLI::App app{"namm-worker: NAMM-augmented inference for Llama-family models (Hugging Face or llama2.c)."};
  app.require_subcommand(1);
  namm::worker::cli::Action run;
  namm::worker::cli::AddGenerateCommand(app, run);
  namm::worker::cli::AddRunTaskCommand(app, run);
  namm::worker::cli::AddEvalCommand(app, run);
  namm::worker::cli::AddBuildSyntheticCommand(app, run);
  namm::worker::cli::AddServeCommand(app, run);
  CLI11_PARSE(app, argc, argv);
  try {
    return run();
  } catch (const std::exception& e) {
    // One line, said to be out of memory when it is (libtorch's own message ends in a backtrace of its frames).
    return namm::worker::cli::Fail(namm::worker::failure_status(e).message());
  }
}
