#include "namm/metrics_endpoint.h"

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <thread>

namespace namm {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

constexpr std::size_t kMaxRequestBytes = 8192;
constexpr auto kRequestTimeout = std::chrono::seconds(10);
// Connections at once; more are closed at once, so idle clients cannot use up the process's descriptors.
constexpr int kMaxConnections = 64;
constexpr auto kAcceptRetry = std::chrono::milliseconds(200);

// HOST:PORT (HOST a name, an IPv4 address or a bracketed IPv6 address; PORT 0..65535) into its parts.
bool SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const std::size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (port->empty() || port->size() > 5 || port->find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(*port) > 65535) {
    return false;
  }
  if (host->front() == '[') {
    if (host->size() < 3 || host->back() != ']') return false;
    *host = host->substr(1, host->size() - 2);
    return host->find_first_not_of("0123456789abcdefABCDEF:.") == std::string::npos;
  }
  return host->find_first_of(":[] \t") == std::string::npos;
}

std::string Response(const std::string& status, const std::string& content_type, const std::string& body) {
  return "HTTP/1.1 " + status + "\r\nContent-Type: " + content_type + "\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
}

// One request: read the head, answer, close. The timer closes connections that never finish their request.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // `open` counts live connections (on the endpoint's one thread).
  Connection(tcp::socket socket, prometheus::Registry& registry, int& open)
      : socket_(std::move(socket)), timer_(socket_.get_executor()), buffer_(kMaxRequestBytes), registry_(registry),
        open_(open) {
    ++open_;
  }
  ~Connection() { --open_; }

  void Start() {
    auto self = shared_from_this();
    timer_.expires_after(kRequestTimeout);
    timer_.async_wait([self](const boost::system::error_code& ec) {
      boost::system::error_code ignored;
      if (!ec) self->socket_.close(ignored);
    });
    asio::async_read_until(socket_, buffer_, "\r\n\r\n", [self](const boost::system::error_code& ec, std::size_t) {
      self->Answer(ec);
    });
  }

 private:
  void Answer(const boost::system::error_code& ec) {
    if (ec) {
      timer_.cancel();
      return;  // closed, timed out, or a request head over kMaxRequestBytes
    }
    std::istream head(&buffer_);
    std::string method, target;
    head >> method >> target;
    const std::string path = target.substr(0, target.find('?'));
    if (method != "GET" && method != "HEAD") {
      reply_ = Response("405 Method Not Allowed", "text/plain", "only GET\n");
    } else if (path == "/metrics") {
      try {
        reply_ = Response("200 OK", "text/plain; version=0.0.4; charset=utf-8",
                          prometheus::TextSerializer().Serialize(registry_.Collect()));
      } catch (const std::exception& e) {
        reply_ = Response("500 Internal Server Error", "text/plain", std::string(e.what()) + "\n");
      }
      if (method == "HEAD") reply_.resize(reply_.find("\r\n\r\n") + 4);
    } else {
      reply_ = Response("404 Not Found", "text/plain", "metrics are at /metrics\n");
    }
    auto self = shared_from_this();
    asio::async_write(socket_, asio::buffer(reply_), [self](const boost::system::error_code&, std::size_t) {
      boost::system::error_code ignored;
      self->socket_.shutdown(tcp::socket::shutdown_both, ignored);
      self->timer_.cancel();
    });
  }

  tcp::socket socket_;
  asio::steady_timer timer_;
  asio::streambuf buffer_;
  prometheus::Registry& registry_;
  int& open_;
  std::string reply_;
};

}  // namespace

struct MetricsEndpoint::Impl {
  // Declared before io: connections still queued in io when it is destroyed refer to them.
  prometheus::Registry registry;
  int open = 0;
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
      if (open < kMaxConnections) {
        std::make_shared<Connection>(std::move(socket), registry, open)->Start();
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
  // A bare port (":9100" or "9100") binds loopback only: metrics reach other hosts only when asked for.
  const std::string digits = !requested.empty() && requested[0] == ':' ? requested.substr(1) : requested;
  const bool bare_port = !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
  const std::string listen = bare_port ? "127.0.0.1:" + digits : requested;
  std::string host, port;
  if (!SplitAddress(listen, &host, &port)) {
    return Status::InvalidArgument("--metrics-listen must be HOST:PORT (e.g. 0.0.0.0:9100; port 0 for a free one) or a "
                                   "port alone (loopback), got '" + requested + "'");
  }
  auto impl = std::make_unique<Impl>();
  boost::system::error_code ec;
  tcp::resolver resolver(impl->io);
  const auto endpoints = resolver.resolve(host, port, tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    return Status::InvalidArgument("--metrics-listen " + listen + ": cannot resolve '" + host + "': " + ec.message());
  }
  const tcp::endpoint endpoint = *endpoints.begin();
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::FailedPrecondition("cannot serve metrics on " + listen + ": " + ec.message());
  impl->port = impl->acceptor.local_endpoint().port();
  impl->url = "http://" + listen.substr(0, listen.rfind(':')) + ":" + std::to_string(impl->port) + "/metrics";
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
