// namm-worker subcommands. Each Add*Command registers its options on `app` and sets `run` to the action.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace namm::worker::cli {

using Action = std::function<int()>;

void AddGenerateCommand(CLI::App& app, Action& run);
void AddRunTaskCommand(CLI::App& app, Action& run);
void AddEvalCommand(CLI::App& app, Action& run);
void AddBuildSyntheticCommand(CLI::App& app, Action& run);
// serve and fingerprint.
void AddServeCommand(CLI::App& app, Action& run);

// Prints "namm-worker: error: <message>" to stderr and returns 1.
int Fail(const std::string& message);

}  // namespace namm::worker::cli
