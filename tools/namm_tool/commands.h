// namm-tool subcommands. Each Add*Command registers its options on `app` and sets `run` to the action.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace namm::tool {

// The action of the chosen subcommand; returns the process exit code.
using Action = std::function<int()>;

void AddInitCommand(CLI::App& app, Action& run);
void AddInfoCommand(CLI::App& app, Action& run);
void AddScoreCommand(CLI::App& app, Action& run);
void AddMetricCommand(CLI::App& app, Action& run);

// Prints "namm-tool: error: <message>" to stderr and returns the exit code for failures (1).
int Fail(const std::string& message);

}  // namespace namm::tool
