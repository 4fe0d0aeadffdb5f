// Running the project's binaries as real processes in tests.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

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

// A child process started without a shell, so that signals reach the program itself.
struct Child {
  pid_t pid = -1;
  int out = -1;  // the child's stdout, when not sent to a log file
};

// Starts args[0] with `args`. With `log`, stdout and stderr go to that file (appended); else stdout is a pipe.
inline Child Spawn(const std::vector<std::string>& args, const std::string& log = "") {
  int fds[2] = {-1, -1};
  if (log.empty()) {
    EXPECT_EQ(::pipe(fds), 0);
  }
  Child c;
  c.pid = ::fork();
  if (c.pid == 0) {
    if (log.empty()) {
      ::dup2(fds[1], STDOUT_FILENO);
      ::close(fds[0]);
    } else {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  if (log.empty()) {
    ::close(fds[1]);
    c.out = fds[0];
  }
  return c;
}

// A line of the child's stdout (without the newline).
inline std::string ReadLine(int fd) {
  std::string line;
  char ch;
  while (::read(fd, &ch, 1) == 1 && ch != '\n') line += ch;
  return line;
}

// Waits for the child; its exit code, or -1 when a signal ended it.
inline int Wait(Child& c) {
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  if (c.out >= 0) ::close(c.out);
  c.out = -1;
  c.pid = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline void KillAndReap(Child& c) {
  ::kill(c.pid, SIGKILL);
  Wait(c);
}

}  // namespace namm::testing
