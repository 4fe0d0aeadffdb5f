// namm-tool: create, inspect and run NAMM files from the command line.
#include <iostream>

#include "commands.h"

namespace namm::tool {
int Fail(const std::string& message) {
  std::cerr << "namm-tool: error: " << message << "\n";
  return 1;
}
}  // namespace namm::tool

int main(int argc, char** argv) {
  CLI::App app{
      "namm-tool: create, inspect and run Neural Attention Memory Model (NAMM) files.\n"
      "A NAMM file (.safetensors) holds the architecture, the flat parameter vector and the feature\n"
      "normalization statistics of a NAMM. `metric` scores predictions with the benchmarks' metrics."};
  app.require_subcommand(1);
  namm::tool::Action run;
  namm::tool::AddInitCommand(app, run);
  namm::tool::AddInfoCommand(app, run);
  namm::tool::AddScoreCommand(app, run);
  namm::tool::AddMetricCommand(app, run);
  CLI11_PARSE(app, argc, argv);
  try {
    return run();
  } catch (const std::exception& e) {
    return namm::tool::Fail(e.what());
  }
}
