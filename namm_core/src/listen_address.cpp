#include "namm/listen_address.h"

namespace namm {

namespace {

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

}  // namespace

Result<ListenAddress> parse_listen_address(const std::string& text, const std::string& option) {
  const std::string digits = !text.empty() && text[0] == ':' ? text.substr(1) : text;
  const bool bare_port = !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
  ListenAddress address;
  if (!SplitAddress(bare_port ? "127.0.0.1:" + digits : text, &address.host, &address.port)) {
    return Status::InvalidArgument(option + " must be HOST:PORT (e.g. 0.0.0.0:9100; port 0 for a free one) or a "
                                   "port alone (loopback), got '" + text + "'");
  }
  return address;
}

Status listen_on(boost::asio::ip::tcp::acceptor& acceptor, const ListenAddress& address, const std::string& option) {
  using boost::asio::ip::tcp;
  const std::string shown = address.host + ":" + address.port;
  boost::system::error_code ec;
  tcp::resolver resolver(acceptor.get_executor());
  const auto endpoints =
      resolver.resolve(address.host, address.port, tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    return Status::InvalidArgument(option + " " + shown + ": cannot resolve '" + address.host + "': " + ec.message());
  }
  const tcp::endpoint endpoint = *endpoints.begin();
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(boost::asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::FailedPrecondition("cannot listen on " + shown + " (" + option + "): " + ec.message());
  return Status::Ok();
}

}  // namespace namm
