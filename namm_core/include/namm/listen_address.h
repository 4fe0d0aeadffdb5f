// Where a server listens: HOST:PORT (a name, an IPv4 address or a bracketed IPv6 address; port 0 picks a free
// one), or a port alone (":9100" or "9100"), which binds loopback only, so that nothing reaches other hosts
// unless asked. Shared by the /metrics endpoint and namm-api.
#pragma once

#include <boost/asio/ip/tcp.hpp>

#include <string>

#include "namm/status.h"

namespace namm {

struct ListenAddress {
  std::string host, port;
};

// Parses `text`; the error names `option` (e.g. "--metrics-listen") and what was given.
Result<ListenAddress> parse_listen_address(const std::string& text, const std::string& option);

// Opens, binds (reusing the address) and listens; the error names the address and why (taken, unresolvable).
Status listen_on(boost::asio::ip::tcp::acceptor& acceptor, const ListenAddress& address, const std::string& option);

}  // namespace namm
