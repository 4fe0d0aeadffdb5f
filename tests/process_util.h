// Running the project's binaries as real processes in tests.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace namm::testing {

struct ProcessResult {
  int exit_code;
  std::string output;  // stdout and stderr, interleaved
};

// Runs `command` through the shell and collects its output.
inline ProcessResult RunProcess(const std::string& command) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  std::string output;
  char buffer[4096];
  while (std::size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

}  // namespace namm::testing
