#include "namm/metrics_endpoint.h"

#include "namm/listen_address.h"

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <list>
#include <memory>
#include <thread>

namespace namm {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::ip::tcp;

namespace {

constexpr std::size_t kMaxRequestBytes = 8192;
// A scraper sends its request at once: a connection that has not within this is idle, and closed.
constexpr auto kIdleTimeout = std::chrono::seconds(2);
constexpr auto kWriteTimeout = std::chrono::seconds(10);
// Connections at once. At the cap a new connection closes the oldest one still waiting for its request, so idle
// sockets cannot keep scrapers out (nor use up the process's descriptors).
constexpr std::size_t kMaxConnections = 64;
constexpr auto kAcceptRetry = std::chrono::milliseconds(200);

// One request (HTTP parsed by Boost.Beast): read it, answer, close. The stream's deadline closes connections that
// stay idle or stall.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, prometheus::Registry& registry) : stream_(std::move(socket)), registry_(registry) {
    parser_.header_limit(kMaxRequestBytes);
    parser_.body_limit(kMaxRequestBytes);
  }

  void Start() {
    stream_.expires_after(kIdleTimeout);
    http::async_read(stream_, buffer_, parser_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      self->Answer(ec);
    });
  }
  bool waiting() const { return waiting_; }
  void Close() {
    beast::error_code ignored;
    stream_.socket().close(ignored);
  }

 private:
  void Answer(beast::error_code ec) {
    waiting_ = false;
    if (ec) return Close();  // closed, idle too long, or not an HTTP request within the limits
    const http::request<http::empty_body>& request = parser_.get();
    const beast::string_view target = request.target();
    const beast::string_view path = target.substr(0, target.find('?'));
    response_.version(11);
    response_.keep_alive(false);
    response_.set(http::field::content_type, "text/plain");
    if (request.method() != http::verb::get && request.method() != http::verb::head) {
      response_.result(http::status::method_not_allowed);
      response_.body() = "only GET\n";
    } else if (path == "/metrics") {
      try {
        response_.result(http::status::ok);
        response_.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
        response_.body() = prometheus::TextSerializer().Serialize(registry_.Collect());
      } catch (const std::exception& e) {
        response_.result(http::status::internal_server_error);
        response_.body() = std::string(e.what()) + "\n";
      }
    } else {
      response_.result(http::status::not_found);
      response_.body() = "metrics are at /metrics\n";
    }
    response_.prepare_payload();
    if (request.method() == http::verb::head) response_.body().clear();  // keeps the GET's Content-Length
    stream_.expires_after(kWriteTimeout);
    if (request.method() == http::verb::head) {
      head_serializer_ = std::make_unique<http::response_serializer<http::string_body>>(response_);
      http::async_write_header(stream_, *head_serializer_, [self = shared_from_this()](beast::error_code, std::size_t) {
        self->Finish();
      });
      return;
    }
    http::async_write(stream_, response_, [self = shared_from_this()](beast::error_code, std::size_t) { self->Finish(); });
  }
  void Finish() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{kMaxRequestBytes};
  http::request_parser<http::empty_body> parser_;
  http::response<http::string_body> response_;
  std::unique_ptr<http::response_serializer<http::string_body>> head_serializer_;
  prometheus::Registry& registry_;
  bool waiting_ = true;  // for its request
};

}  // namespace

struct MetricsEndpoint::Impl {
  // Declared before io: connections still queued in io when it is destroyed refer to them.
  prometheus::Registry registry;
  std::list<std::weak_ptr<Connection>> connections;  // in the order they came (the endpoint's one thread)
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer retry{io};
  std::thread thread;
  int port = 0;
  std::string url;

  void Accept() {
    acceptor.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {  // e.g. out of descriptors: try again a little later rather than spin
        retry.expires_after(kAcceptRetry);
        retry.async_wait([this](const boost::system::error_code& e) {
          if (!e) Accept();
        });
        return;
      }
      connections.remove_if([](const std::weak_ptr<Connection>& c) { return c.expired(); });
      if (connections.size() >= kMaxConnections) {
        // Room for the newcomer: the oldest connection still waiting for its request goes.
        const auto idle = std::find_if(connections.begin(), connections.end(), [](const std::weak_ptr<Connection>& c) {
          const auto live = c.lock();
          return live && live->waiting();
        });
        if (idle != connections.end()) {
          if (const auto live = idle->lock()) live->Close();
          connections.erase(idle);
        }
      }
      if (connections.size() < kMaxConnections) {
        auto connection = std::make_shared<Connection>(std::move(socket), registry);
        connections.push_back(connection);
        connection->Start();
      } else {
        boost::system::error_code ignored;
        socket.close(ignored);
      }
      Accept();
    });
  }

  // The endpoint's thread: a handler's exception (e.g. out of memory while serializing) must not end the process.
  void Serve() {
    while (true) {
      try {
        io.run();
        return;  // stopped
      } catch (const std::exception&) {
      }
    }
  }
};

const char* namm_version() { return NAMM_VERSION; }

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& requested) {
  NAMM_ASSIGN_OR_RETURN(const ListenAddress address, parse_listen_address(requested, "--metrics-listen"));
  auto impl = std::make_unique<Impl>();
  NAMM_RETURN_IF_ERROR(listen_on(impl->acceptor, address, "--metrics-listen"));
  impl->port = impl->acceptor.local_endpoint().port();
  impl->url = "http://" + (address.host.find(':') != std::string::npos ? "[" + address.host + "]" : address.host) + ":" + std::to_string(impl->port) + "/metrics";
  impl->Accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Serve(); });
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::move(impl)));
}

MetricsEndpoint::MetricsEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsEndpoint::~MetricsEndpoint() {
  impl_->io.stop();
  impl_->thread.join();
}

prometheus::Registry& MetricsEndpoint::registry() { return impl_->registry; }
int MetricsEndpoint::port() const { return impl_->port; }
const std::string& MetricsEndpoint::url() const { return impl_->url; }

}  // namespace namm
