// Running the project's binaries as real processes in tests, and talking to them on loopback.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
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
// vfork, not fork: fork runs the atfork handlers, and OpenBLAS's (blas_thread_shutdown_) can hang forever joining
// a BLAS thread of a process that has run BLAS work (seen in the store crash test); the child only calls
// syscalls before exec, with everything it needs prepared here.
inline Child Spawn(const std::vector<std::string>& args, const std::string& log = "") {
  int fds[2] = {-1, -1};
  if (log.empty()) {
    EXPECT_EQ(::pipe(fds), 0);
  }
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const char* log_path = log.c_str();
  Child c;
  c.pid = ::vfork();
  if (c.pid == 0) {
    // A test that fails or is killed by ctest's timeout takes its children with it: an orphan holding ctest's
    // output pipe, or a port, would otherwise stall the rest of the suite.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (fds[1] >= 0) {
      ::dup2(fds[1], STDOUT_FILENO);
      ::close(fds[0]);
    } else {
      const int fd = ::open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
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

// Waits for the child; its exit code, or -1 when a signal ended it. A child still running after `limit` is a
// failure of the test (a hang), not of the suite: it is reported, killed and reaped.
inline int Wait(Child& c, std::chrono::seconds limit = std::chrono::seconds(300)) {
  int status = 0;
  const auto end = std::chrono::steady_clock::now() + limit;
  while (::waitpid(c.pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() >= end) {
      ADD_FAILURE() << "process " << c.pid << " still running after " << limit.count() << " s; killed";
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (c.out >= 0) ::close(c.out);
  c.out = -1;
  c.pid = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline void KillAndReap(Child& c) {
  ::kill(c.pid, SIGKILL);
  Wait(c);
}

// A loopback port that was free a moment ago.
inline int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

inline void WriteText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// The file's text, or "" when it cannot be read (yet).
inline std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

inline bool WaitUntil(const std::function<bool()>& done, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

// The whole response (head and body) to `request` sent to 127.0.0.1:port ("" when nothing answers).
inline std::string HttpExchange(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    char buffer[65536];
    ssize_t n;
    while ((n = ::recv(fd, buffer, sizeof buffer, 0)) > 0) response.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return response;
}

// GET http://127.0.0.1:port/target: the response's body, or "" when there is no 200 answer.
inline std::string HttpGet(int port, const std::string& target) {
  const std::string response = HttpExchange(port, "GET " + target + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  const std::size_t body = response.find("\r\n\r\n");
  if (response.compare(0, 12, "HTTP/1.1 200") != 0 && response.compare(0, 12, "HTTP/1.0 200") != 0) return "";
  return body == std::string::npos ? "" : response.substr(body + 4);
}

}  // namespace namm::testing
