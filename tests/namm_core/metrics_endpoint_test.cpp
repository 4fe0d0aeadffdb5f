// The /metrics HTTP endpoint: what it serves, what it refuses, and the addresses it will not take.
#include "namm/metrics_endpoint.h"

#include <gtest/gtest.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include "../process_util.h"

namespace namm {
namespace {

using testing::HttpExchange;

TEST(MetricsEndpoint, ServesTheRegistryAsPrometheusText) {
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0");
  ASSERT_TRUE(endpoint.ok()) << endpoint.status().ToString();
  MetricsEndpoint& e = **endpoint;
  ASSERT_GT(e.port(), 0);
  EXPECT_EQ(e.url(), "http://127.0.0.1:" + std::to_string(e.port()) + "/metrics");
  auto& counter = prometheus::BuildCounter().Name("namm_test_total").Help("A test counter").Register(e.registry()).Add({});
  counter.Increment(3);

  const std::string response = HttpExchange(e.port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response;
  EXPECT_NE(response.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << response;
  EXPECT_NE(response.find("# TYPE namm_test_total counter\nnamm_test_total 3"), std::string::npos) << response;
  // Every scrape sees the current value, from many clients at once.
  counter.Increment();
  std::vector<std::thread> clients;
  std::vector<std::string> bodies(16);
  for (std::size_t i = 0; i < bodies.size(); ++i) {
    clients.emplace_back([&, i] { bodies[i] = testing::HttpGet(e.port(), "/metrics?x=1"); });
  }
  for (std::thread& t : clients) t.join();
  for (const std::string& body : bodies) EXPECT_NE(body.find("namm_test_total 4"), std::string::npos) << body;
}

TEST(MetricsEndpoint, AnswersOtherRequestsWithoutMetrics) {
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0");
  ASSERT_TRUE(endpoint.ok()) << endpoint.status().ToString();
  const int port = (*endpoint)->port();
  EXPECT_EQ(HttpExchange(port, "GET / HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404 Not Found\r\n", 0), 0u);
  EXPECT_EQ(HttpExchange(port, "POST /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405 ", 0), 0u);
  // HEAD: the head of the GET answer, without its body.
  const std::string head = HttpExchange(port, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << head;
  EXPECT_EQ(head.substr(head.size() - 4), "\r\n\r\n") << head;
  // A request head larger than the endpoint reads is dropped without an answer, and the endpoint lives on.
  EXPECT_EQ(HttpExchange(port, std::string(20000, 'a')).find("HTTP/1.1 200"), std::string::npos);
  EXPECT_EQ(HttpExchange(port, "GET /metrics HTTP/1.0\r\n\r\n").rfind("HTTP/1.1 200 OK\r\n", 0), 0u);
}

// A connection opened to 127.0.0.1:port that sends nothing (-1 when none could be made).
int IdleConnection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Idle sockets can neither keep scrapes out (at the connection cap the oldest idle one goes) nor stay open long
// (2 s without a request). Earlier, 64 idle sockets held every slot for 10 s.
TEST(MetricsEndpoint, IdleConnectionsNeitherKeepScrapesOutNorStay) {
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0");
  ASSERT_TRUE(endpoint.ok()) << endpoint.status().ToString();
  const int port = (*endpoint)->port();
  prometheus::BuildCounter().Name("namm_test_total").Help("A test counter").Register((*endpoint)->registry()).Add({});
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(IdleConnection(port));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NE(testing::HttpGet(port, "/metrics").find("namm_test_total 0"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1)) << "no wait for an idle slot";
  // The newest idle socket is closed by the endpoint within its idle timeout.
  timeval timeout{5, 0};
  ::setsockopt(idle.back(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  char byte = 0;
  const auto read_start = std::chrono::steady_clock::now();
  EXPECT_EQ(::recv(idle.back(), &byte, 1, 0), 0) << "closed by the endpoint";
  EXPECT_LT(std::chrono::steady_clock::now() - read_start, std::chrono::seconds(4));
  for (int fd : idle) ::close(fd);
}

TEST(MetricsEndpoint, APortAloneBindsLoopbackOnly) {
  for (const char* port : {"0", ":0"}) {
    auto e = MetricsEndpoint::Start(port);
    ASSERT_TRUE(e.ok()) << port << ": " << e.status().ToString();
    EXPECT_EQ((*e)->url(), "http://127.0.0.1:" + std::to_string((*e)->port()) + "/metrics");
  }
}

TEST(MetricsEndpoint, RefusesMalformedAndTakenAddresses) {
  for (const char* bad : {"99999", "127.0.0.1", "127.0.0.1:", ":", "127.0.0.1:99999", "127.0.0.1:port", "a b:1",
                          "[::1:0", "[zz]:0", "[]:0"}) {
    const auto e = MetricsEndpoint::Start(bad);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.status().message().find("--metrics-listen must be HOST:PORT"), std::string::npos)
        << bad << ": " << e.status().ToString();
  }
  auto first = MetricsEndpoint::Start("127.0.0.1:0");
  ASSERT_TRUE(first.ok());
  const std::string taken = "127.0.0.1:" + std::to_string((*first)->port());
  const auto second = MetricsEndpoint::Start(taken);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cannot listen on " + taken), std::string::npos)
      << second.status().ToString();
}

}  // namespace
}  // namespace namm
