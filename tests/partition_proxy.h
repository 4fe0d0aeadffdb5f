// A network partition without privileges: a TCP forwarder between clients and a port on this machine that can stop
// forwarding. While cut, no byte moves in either direction and no connection is closed or reset, as when a link
// goes down: the peers' writes fill their socket buffers and their reads wait. Connections made while cut are
// accepted and held the same way. Heal resumes forwarding what was waiting. One thread, poll(2).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <list>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace namm::testing {

class PartitionProxy {
 public:
  explicit PartitionProxy(int upstream_port) : upstream_port_(upstream_port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = Loopback(0);
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listen_fd_, 64) != 0) {
      throw std::runtime_error("partition proxy: cannot listen");
    }
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { Loop(); });
  }
  ~PartitionProxy() {
    stop_.store(true);
    thread_.join();
    for (Link& l : links_) l.Close();
    ::close(listen_fd_);
  }
  PartitionProxy(const PartitionProxy&) = delete;
  PartitionProxy& operator=(const PartitionProxy&) = delete;

  // Where clients connect: 127.0.0.1:port().
  int port() const { return port_; }
  void Cut() { cut_.store(true); }
  void Heal() { cut_.store(false); }

 private:
  // One direction's bytes read and not yet written.
  struct Pending {
    std::string bytes;
    std::size_t sent = 0;
  };
  struct Link {
    int fd[2] = {-1, -1};  // the client's side, the upstream side
    Pending toward[2];     // bytes for fd[k]
    void Close() {
      for (int& f : fd) {
        if (f >= 0) ::close(f);
        f = -1;
      }
    }
  };

  static sockaddr_in Loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
  }

  void Accept() {
    const int client = ::accept(listen_fd_, nullptr, nullptr);
    if (client < 0) return;
    const int upstream = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = Loopback(upstream_port_);
    if (upstream < 0 || ::connect(upstream, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(client);  // nothing listens upstream: the client sees the connection end, as it would directly
      if (upstream >= 0) ::close(upstream);
      return;
    }
    Link l;
    l.fd[0] = client;
    l.fd[1] = upstream;
    links_.push_back(l);
  }

  // Moves what is readable and writable on one link; false once either side has closed or failed.
  static bool Pump(Link& l, const pollfd* p) {
    for (int k = 0; k < 2; ++k) {
      if (p[k].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buffer[65536];
        const ssize_t n = ::recv(l.fd[k], buffer, sizeof buffer, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return false;
        if (n > 0) l.toward[1 - k].bytes.append(buffer, static_cast<std::size_t>(n));
      }
      Pending& out = l.toward[k];
      if (out.sent < out.bytes.size() && (p[k].revents & POLLOUT)) {
        const ssize_t n = ::send(l.fd[k], out.bytes.data() + out.sent, out.bytes.size() - out.sent,
                                 MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
        if (n > 0) out.sent += static_cast<std::size_t>(n);
        if (out.sent == out.bytes.size()) out = Pending{};
      }
    }
    return true;
  }

  void Loop() {
    while (!stop_.load()) {
      const bool cut = cut_.load();
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
      if (!cut) {
        for (const Link& l : links_) {
          for (int k = 0; k < 2; ++k) {
            const bool pending = l.toward[k].sent < l.toward[k].bytes.size();
            fds.push_back({l.fd[k], static_cast<short>(POLLIN | (pending ? POLLOUT : 0)), 0});
          }
        }
      }
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      // The links polled are the first ones (Accept appends).
      auto it = links_.begin();
      for (std::size_t j = 0; j < (fds.size() - 1) / 2; ++j) {
        if (Pump(*it, &fds[1 + 2 * j])) {
          ++it;
        } else {
          it->Close();
          it = links_.erase(it);
        }
      }
      if (fds[0].revents & POLLIN) Accept();
    }
  }

  int upstream_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> cut_{false}, stop_{false};
  std::list<Link> links_;  // the loop's thread only (and the destructor, after it)
  std::thread thread_;
};

}  // namespace namm::testing
