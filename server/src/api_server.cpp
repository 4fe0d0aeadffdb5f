#include "namm/server/api_server.h"

#include <openssl/crypto.h>
#include <poll.h>
#include <sys/socket.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <ctime>
#include <list>
#include <memory>
#include <map>
#include <optional>
#include <thread>

#include "api_metrics.h"
#include "namm/auth_lockout.h"
#include "namm/file_util.h"
#include "namm/listen_address.h"
#include "namm/worker/chat_encoding.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/policy_spec.h"
#include "namm/worker/tokenizer.h"

namespace namm::server {

namespace asio = boost::asio;
namespace ssl = asio::ssl;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using Request = http::request<http::string_body>;

namespace {

constexpr std::size_t kMaxHeaderBytes = 16 * 1024;
constexpr auto kPollSlice = std::chrono::milliseconds(50);  // how often a waiting connection looks at its client
// The chat template of models without one: each turn on its own line, then the assistant's cue.
constexpr const char* kPlainChatTemplate =
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}";

// A connected socket read and written with deadlines: each operation waits (in slices, so that a stop is seen)
// for the socket to become ready, and fails with timed_out after `timeout` or operation_aborted once `stop` is
// set. The socket is non-blocking, so no call blocks past its deadline. Beast's HTTP reads and writes and the TLS
// layer run over it: its synchronous operations on a request's answering thread, its asynchronous ones (the
// socket's own, their deadline a timer's) on the io thread while the connection waits for a request.
class TimedSocket {
 public:
  using lowest_layer_type = tcp::socket::lowest_layer_type;
  using executor_type = tcp::socket::executor_type;

  TimedSocket(tcp::socket& socket, std::chrono::milliseconds timeout, const std::atomic<bool>& stop)
      : socket_(&socket), timeout_(timeout), stop_(&stop) {}

  // A deadline for every operation until the next call, beside each operation's own timeout: a whole request's
  // headers and body, or a TLS handshake, must arrive in time, however slowly their bytes trickle.
  void set_deadline(Clock::time_point deadline) { deadline_ = deadline; }

  executor_type get_executor() { return socket_->get_executor(); }
  lowest_layer_type& lowest_layer() { return socket_->lowest_layer(); }
  const lowest_layer_type& lowest_layer() const { return socket_->lowest_layer(); }

  template <class Buffers>
  std::size_t read_some(const Buffers& buffers, beast::error_code& ec) {
    return Io(POLLIN, ec, [&] { return socket_->read_some(buffers, ec); });
  }
  template <class Buffers>
  std::size_t read_some(const Buffers& buffers) {
    beast::error_code ec;
    const std::size_t n = read_some(buffers, ec);
    if (ec) throw beast::system_error(ec);
    return n;
  }
  template <class Buffers>
  std::size_t write_some(const Buffers& buffers, beast::error_code& ec) {
    return Io(POLLOUT, ec, [&] { return socket_->write_some(buffers, ec); });
  }
  template <class Buffers>
  std::size_t write_some(const Buffers& buffers) {
    beast::error_code ec;
    const std::size_t n = write_some(buffers, ec);
    if (ec) throw beast::system_error(ec);
    return n;
  }

  template <class Buffers, class Handler>
  auto async_read_some(const Buffers& buffers, Handler&& handler) {
    return socket_->async_read_some(buffers, std::forward<Handler>(handler));
  }
  template <class Buffers, class Handler>
  auto async_write_some(const Buffers& buffers, Handler&& handler) {
    return socket_->async_write_some(buffers, std::forward<Handler>(handler));
  }

 private:
  template <class Op>
  std::size_t Io(short events, beast::error_code& ec, Op op) {
    const auto deadline = std::min(Clock::now() + timeout_, deadline_);
    while (true) {
      ec = {};
      const std::size_t n = op();
      if (ec != asio::error::would_block && ec != asio::error::try_again) return n;
      if (stop_->load()) {
        ec = asio::error::operation_aborted;
        return 0;
      }
      if (Clock::now() >= deadline) {
        ec = asio::error::timed_out;
        return 0;
      }
      pollfd p{socket_->native_handle(), events, 0};
      ::poll(&p, 1, static_cast<int>(kPollSlice.count()));
    }
  }

  tcp::socket* socket_;
  std::chrono::milliseconds timeout_;
  const std::atomic<bool>* stop_;
  Clock::time_point deadline_ = Clock::time_point::max();
};

// Whether the connection broke (reset, or closed both ways): checked while a request waits. A client that only
// shut down its sending side after its request (shutdown(SHUT_WR), `nc -N`) still reads: it gets its response.
// One that closed entirely is noticed when the stream's next write fails, or once its reset arrives.
bool PeerGone(int fd) {
  pollfd p{fd, 0, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR)) != 0;
}

// The same key, compared in time independent of where they differ.
bool SameKey(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// What responses report of a policy: the spec, with a NAMM file's directory left out (the server's paths are
// nobody else's business).
std::string PolicyLabel(const std::string& spec) {
  if (spec.rfind("namm:", 0) != 0) return spec;
  Result<worker::NammSpec> namm = worker::parse_namm_spec(spec);
  if (!namm.ok()) return spec;
  const std::size_t slash = namm->path.find_last_of('/');
  if (slash != std::string::npos) namm->path = namm->path.substr(slash + 1);
  return namm->ToString();
}

// OpenAI's error type for a status.
ApiError Error(int status, std::string message, std::string param = "", std::string code = "") {
  const char* type = status == 429 ? "rate_limit_exceeded" : status >= 500 ? "server_error" : "invalid_request_error";
  return ApiError{status, std::move(message), type, std::move(param), std::move(code)};
}

}  // namespace

Result<std::vector<std::string>> read_api_keys(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(const std::string text, read_file(path));
  std::vector<std::string> keys;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    const std::size_t first = line.find_first_not_of(" \t\r");
    const std::size_t last = line.find_last_not_of(" \t\r");
    line = first == std::string::npos ? "" : line.substr(first, last - first + 1);
    if (!line.empty() && line[0] != '#') keys.push_back(line);
    start = end + 1;
  }
  if (keys.empty()) return Status::InvalidArgument("the API keys file " + path + " holds no key (one per line)");
  return keys;
}

struct ApiServer::Impl {
  Impl(const worker::LlamaModel& m, const worker::Tokenizer& t, ApiServerOptions o)
      : model(m), tokenizer(t), options(std::move(o)) {}

  const worker::LlamaModel& model;
  const worker::Tokenizer& tokenizer;
  const ApiServerOptions options;
  std::optional<worker::ChatTemplate> chat_template;
  nlohmann::ordered_json chat_variables = nlohmann::ordered_json::object();
  bool template_writes_bos = false;  // a model's own template does; the plain one does not
  std::vector<std::string> api_keys;
  int64_t context = 0, max_prompt_tokens = 0, max_tokens = 0;
  std::chrono::milliseconds idle_timeout{0};  // --idle-timeout
  int64_t created = std::time(nullptr);
  std::unique_ptr<ApiMetrics> metrics;
  std::unique_ptr<CompletionScheduler> scheduler;

  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::optional<ssl::context> tls;
  int port = 0;
  std::string url;

  // Addresses that keep presenting wrong API keys: 429 for a minute after 20 in a minute (a valid key still passes).
  AuthLockout lockout{[] {
    AuthLockout::Options o;
    o.callers = "API clients";
    return o;
  }()};

  std::atomic<bool> draining{false};  // no new connections; new requests get 503
  std::atomic<bool> stopping{false};  // every socket operation ends
  std::atomic<int64_t> in_flight{0};  // completion requests being answered
  std::atomic<uint64_t> responses{0};
  std::mutex drain_mutex;  // one Drain at a time

  // ---- connections -------------------------------------------------------------------------------------------------
  // A connection waits on the io thread: its TLS handshake, a request's headers and body are Asio's asynchronous
  // reads with a timer for their deadline, so an idle connection costs a socket, a timer and its buffer, not a
  // thread. A request read whole (or refused on its headers) gets a thread of its own for its answer, which waits
  // on the scheduler and writes with deadlines (TimedSocket); the thread then hands the connection back to the io
  // thread for its next request. Threads are bounded by the connections busy with a request. Everything below
  // (counts, the idle lists) belongs to the io thread: no locks.
  struct Session {
    Session(Impl& impl, tcp::socket s, std::string p)
        : socket(std::move(s)), timed(socket, impl.idle_timeout, impl.stopping), timer(impl.io), peer(std::move(p)) {}

    // Calls f(stream, timed socket under it): the TLS stream, or the socket itself.
    template <class F>
    void With(F&& f) {
      if (tls) {
        f(*tls, tls->next_layer());
      } else {
        f(timed, timed);
      }
    }

    tcp::socket socket;
    TimedSocket timed;
    std::optional<ssl::stream<TimedSocket>> tls;
    asio::steady_timer timer;  // the deadline of what it waits for
    uint64_t wait = 0;         // which wait the timer is for: one that fired as its wait ended leaves the next alone
    std::string peer;          // the client's address
    beast::flat_buffer buffer;
    std::optional<http::request_parser<http::string_body>> parser;
    http::response<http::empty_body> go_on{http::status::continue_, 11};
    enum class Read { kRequest, kBodyTooLarge, kHeadersTooLarge, kUnauthorized, kMalformed } read = Read::kRequest;
    std::string malformed;  // with kMalformed: what the HTTP parser said
    std::thread answer;     // while a request is answered
    bool counted = true;    // in the open counts (false once closed, or closed to make room)
    bool idle = false;      // waiting for a request: what a full server closes first, oldest first
    bool waiting = false;   // an operation of the io thread outstanding (in `waiting_sessions`)
    std::list<Session*>::iterator in_idle, in_peer_idle, in_waiting;
  };
  struct Peer {
    std::size_t open = 0;
    std::list<Session*> idle;  // oldest first
  };

  std::thread io_thread;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> keep_running;
  asio::steady_timer accept_retry{io};
  std::size_t open = 0;                  // counted connections
  std::map<std::string, Peer> peers;     // by address, while it has a connection
  std::list<Session*> idle_sessions;     // oldest first
  std::list<Session*> waiting_sessions;  // closed at once when the server stops

  void Accept() {
    acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
      if (draining.load() || !acceptor.is_open()) return;
      if (ec) {  // out of descriptors (EMFILE) and the like: wait rather than spin
        accept_retry.expires_after(kPollSlice);
        accept_retry.async_wait([this](beast::error_code e) {
          if (!e) Accept();
        });
        return;
      }
      try {
        Admit(std::move(socket));
      } catch (const std::exception& e) {  // (out of memory): this connection is lost, not the listener
        spdlog::error("namm-api: cannot take a connection: {}", e.what());
      }
      Accept();
    });
  }

  void Admit(tcp::socket socket) {
    beast::error_code ec;
    const tcp::endpoint remote = socket.remote_endpoint(ec);
    const std::string peer = ec ? std::string("unknown") : remote.address().to_string();
    if (!MakeRoom(peer)) return RefuseConnection(socket, peer);
    socket.non_blocking(true, ec);
    socket.set_option(tcp::no_delay(true), ec);
    auto s = std::make_shared<Session>(*this, std::move(socket), peer);
    ++open;
    ++peers[peer].open;
    SetIdle(*s, true);
    if (!tls) return ReadHeader(s);
    s->tls.emplace(s->timed, *tls);
    StartWait(s);
    s->tls->async_handshake(ssl::stream_base::server, [this, s](beast::error_code e) {
      if (e) return Close(*s);  // not TLS, a certificate refused, or too slow
      ReadHeader(s);
    });
  }

  // Whether a connection from `peer` may open: over --max-connections-per-address its address's oldest idle
  // connection is closed, over --max-connections the oldest idle one of all; false when there is none to close
  // (every connection is busy with a request).
  bool MakeRoom(const std::string& peer) {
    const auto it = peers.find(peer);
    const bool peer_full = options.max_connections_per_address > 0 && it != peers.end() &&
                           it->second.open >= options.max_connections_per_address;
    if (!peer_full && open < options.max_connections) return true;
    const std::list<Session*>& candidates = peer_full ? it->second.idle : idle_sessions;
    if (candidates.empty()) return false;
    Session& oldest = *candidates.front();
    Uncount(oldest);  // (no longer idle)
    CloseSocket(oldest);  // its pending read ends with an error, which releases it
    if (metrics) metrics->ConnectionClosedForRoom(peer_full);
    return true;
  }

  void SetIdle(Session& s, bool idle) {
    if (s.idle == idle || (idle && !s.counted)) return;
    Peer& peer = peers[s.peer];
    if (idle) {
      s.in_idle = idle_sessions.insert(idle_sessions.end(), &s);
      s.in_peer_idle = peer.idle.insert(peer.idle.end(), &s);
    } else {
      idle_sessions.erase(s.in_idle);
      peer.idle.erase(s.in_peer_idle);
    }
    s.idle = idle;
    CountConnections();
  }

  void Uncount(Session& s) {
    if (!s.counted) return;
    SetIdle(s, false);
    s.counted = false;
    --open;
    const auto it = peers.find(s.peer);
    if (--it->second.open == 0) peers.erase(it);
    CountConnections();
  }

  void CountConnections() {
    if (metrics) metrics->Connections(static_cast<int64_t>(idle_sessions.size()), static_cast<int64_t>(open - idle_sessions.size()));
  }

  // The deadline of a TLS handshake, or of a request's headers and body however slowly they trickle.
  void StartWait(const std::shared_ptr<Session>& s) {
    if (!s->waiting) s->in_waiting = waiting_sessions.insert(waiting_sessions.end(), s.get());
    s->waiting = true;
    s->timer.expires_after(idle_timeout);
    s->timer.async_wait([this, s, wait = ++s->wait](beast::error_code ec) {
      if (!ec && wait == s->wait) CloseSocket(*s);  // its pending operation ends with an error
    });
  }

  void EndWait(Session& s) {
    ++s.wait;
    s.timer.cancel();
    if (s.waiting) waiting_sessions.erase(s.in_waiting);
    s.waiting = false;
  }

  static void CloseSocket(Session& s) {
    beast::error_code ec;
    s.socket.shutdown(tcp::socket::shutdown_both, ec);
    s.socket.close(ec);
  }

  // The end of a connection on the io thread.
  void Close(Session& s) {
    EndWait(s);
    Uncount(s);
    CloseSocket(s);
  }

  void ReadHeader(const std::shared_ptr<Session>& s) {
    if (stopping.load()) return Close(*s);
    s->parser.emplace();
    s->parser->header_limit(kMaxHeaderBytes);
    s->parser->body_limit(options.max_body_bytes);
    SetIdle(*s, true);
    StartWait(s);
    auto on_header = [this, s](beast::error_code ec, std::size_t) {
      if (ec == http::error::body_limit) return Answer(s, Session::Read::kBodyTooLarge);
      if (ec == http::error::header_limit) return Answer(s, Session::Read::kHeadersTooLarge);
      if (Malformed(*s, ec)) return Answer(s, Session::Read::kMalformed);
      if (ec) return Close(*s);  // closed, or idle too long
      // The key is checked on the headers: a client without one is answered before a 100 Continue or any of its
      // body is read (the connection then closes, the body unread).
      const Request& request = s->parser->get();
      if (!Authorized(request)) return Answer(s, Session::Read::kUnauthorized);
      if (request.version() == 11 && beast::iequals(request[http::field::expect], "100-continue")) {
        return s->With([&](auto& stream, TimedSocket&) {
          http::async_write(stream, s->go_on, [this, s](beast::error_code e, std::size_t) {
            if (e) return Close(*s);
            ReadBody(s);
          });
        });
      }
      ReadBody(s);
    };
    s->With([&](auto& stream, TimedSocket&) { http::async_read_header(stream, s->buffer, *s->parser, on_header); });
  }

  void ReadBody(const std::shared_ptr<Session>& s) {
    s->With([&](auto& stream, TimedSocket&) {
      http::async_read(stream, s->buffer, *s->parser, [this, s](beast::error_code ec, std::size_t) {
        if (ec == http::error::body_limit) return Answer(s, Session::Read::kBodyTooLarge);
        if (Malformed(*s, ec)) return Answer(s, Session::Read::kMalformed);
        if (ec) return Close(*s);
        Answer(s, Session::Read::kRequest);
      });
    });
  }

  // Whether `ec` is the HTTP parser refusing what was sent (not HTTP, a bad Content-Length, a bad chunk), which is
  // answered with a 400 rather than a silent close; a connection that closed, mid-request or not, is not.
  static bool Malformed(Session& s, const beast::error_code& ec) {
    if (!ec || ec.category() != http::make_error_code(http::error::bad_version).category() ||
        ec == http::error::end_of_stream || ec == http::error::partial_message) {
      return false;
    }
    s.malformed = ec.message();
    return true;
  }

  // Gives the request a thread for its answer; the connection comes back to the io thread after it.
  void Answer(const std::shared_ptr<Session>& s, Session::Read read) {
    // A request read whole: not closed to make room until it is answered. Until then (its headers in, its body
    // still coming) it may be: four slow bodies kept every other client out for the idle timeout before.
    SetIdle(*s, false);
    EndWait(*s);
    s->read = read;
    try {
      s->answer = std::thread([this, s, work = asio::make_work_guard(io)]() mutable {
        bool keep = false;
        try {
          keep = Respond(*s);
        } catch (const std::exception& e) {
          spdlog::warn("namm-api: connection ended: {}", e.what());
        }
        if (!keep) CloseGracefully(s->socket);
        asio::post(io, [this, s, keep] { Answered(s, keep); });
      });
    } catch (const std::exception& e) {  // no thread to be had: the connection closes
      spdlog::error("namm-api: cannot start a thread to answer a request: {}", e.what());
      Close(*s);
    }
  }

  void Answered(const std::shared_ptr<Session>& s, bool keep) {
    if (s->answer.joinable()) s->answer.join();
    if (!keep) return Close(*s);
    ReadHeader(s);  // the next request on this connection (closes it when the server stops)
  }

  // On the answering thread: the reply to what was read; whether the connection stays open for another request.
  bool Respond(Session& s) {
    bool keep = false;
    s.With([&](auto& stream, TimedSocket& timed) {
      timed.set_deadline(Clock::time_point::max());  // the answer: each write has its own timeout
      const Request& request = s.parser->get();
      switch (s.read) {
        case Session::Read::kBodyTooLarge:
          return TooLarge(stream, request);
        case Session::Read::kHeadersTooLarge:
          (void)Reply(stream, request, "other", Error(431, "the request's headers exceed 16 KiB"), false);
          return;
        case Session::Read::kUnauthorized:
          return RefuseKey(stream, request, s.peer);
        case Session::Read::kMalformed:
          (void)Reply(stream, request, "other", Error(400, "malformed HTTP request: " + s.malformed), false);
          return;
        case Session::Read::kRequest:
          keep = Handle(stream, s.socket.native_handle(), request);
          return;
      }
    });
    return keep;
  }

  // Closes a connection without resetting it: stop sending, then read and drop what the client still sends (a
  // body we refused, with 413) until it closes, for up to a second, so that it reads our last response first.
  // On the answering thread.
  void CloseGracefully(tcp::socket& socket) {
    beast::error_code ec;
    socket.shutdown(tcp::socket::shutdown_send, ec);
    const auto until = Clock::now() + std::chrono::seconds(1);
    std::array<char, 4096> sink;
    std::size_t drained = 0;
    while (!ec && Clock::now() < until && drained < (1u << 20) && !stopping.load()) {
      pollfd p{socket.native_handle(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(kPollSlice.count())) <= 0) continue;
      drained += socket.read_some(asio::buffer(sink), ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) ec = {};
    }
    socket.close(ec);
  }

  // No room (every connection busy): a 503 in plain HTTP (a TLS client sees a failed handshake), then close.
  void RefuseConnection(tcp::socket& socket, const std::string& peer) {
    beast::error_code ec;
    socket.non_blocking(true, ec);
    const ApiError error = Error(503, "the server has no room for another connection from " + peer +
                                          " (--max-connections " + std::to_string(options.max_connections) +
                                          ", --max-connections-per-address " +
                                          std::to_string(options.max_connections_per_address) +
                                          ", none of them idle); retry later");
    const std::string body = error.ToJson();
    const std::string response = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                                 "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    socket.write_some(asio::buffer(response), ec);  // best effort: whatever fits in the socket's buffer
    socket.close(ec);
    if (metrics) metrics->Request("connection", 503);
  }

  // Runs the io thread until Drain lets it end; a handler's exception is logged and the loop goes on.
  void RunIo() {
    while (true) {
      try {
        io.run();
        return;
      } catch (const std::exception& e) {
        spdlog::error("namm-api: a connection's handler failed: {}", e.what());
      }
    }
  }

  // ---- one request -------------------------------------------------------------------------------------------------

  template <class Stream>
  void TooLarge(Stream& stream, const Request& request) {
    (void)Reply(stream, request, "other",
                Error(413, "the request body exceeds the server's limit of " + std::to_string(options.max_body_bytes) +
                               " bytes (--max-body-bytes)"),
                false);
  }

  // Answers one request; false when the connection must close.
  template <class Stream>
  bool Handle(Stream& stream, int fd, const Request& request) {
    const std::string target(request.target());
    const std::string path = target.substr(0, target.find('?'));
    const bool get = request.method() == http::verb::get;
    const bool post = request.method() == http::verb::post;
    if (path == "/health") {
      if (!get) return Reply(stream, request, "health", Error(405, "use GET /health"), request.keep_alive(), {{"Allow", "GET"}});
      nlohmann::ordered_json health = {{"status", draining ? "draining" : "ok"}, {"model", options.model_name},
                                       {"running", scheduler->running()}, {"queued", scheduler->queued()}};
      return Send(stream, request, "health", draining ? 503 : 200,
                  health.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace), "application/json", {},
                  request.keep_alive());
    }
    if (path == "/metrics") {
      if (!get) return Reply(stream, request, "metrics", Error(405, "use GET /metrics"), request.keep_alive(), {{"Allow", "GET"}});
      return Send(stream, request, "metrics", 200, metrics->Exposition(), "text/plain; version=0.0.4; charset=utf-8", {},
                  request.keep_alive());
    }
    if (path.rfind("/v1/", 0) != 0) {
      return Reply(stream, request, "other", Error(404, "no such endpoint: " + path), request.keep_alive());
    }
    if (path == "/v1/models" || path.rfind("/v1/models/", 0) == 0) {
      if (!get) return Reply(stream, request, "models", Error(405, "use GET " + path), request.keep_alive(), {{"Allow", "GET"}});
      if (path == "/v1/models") {
        return Send(stream, request, "models", 200, model_list(options.model_name, created), "application/json", {},
                    request.keep_alive());
      }
      const std::string id = path.substr(std::string("/v1/models/").size());
      if (id != options.model_name) {
        return Reply(stream, request, "models", Error(404, "The model '" + id + "' does not exist", "model", "model_not_found"),
                     request.keep_alive());
      }
      return Send(stream, request, "models", 200, model_object(id, created), "application/json", {}, request.keep_alive());
    }
    const bool completions = path == "/v1/completions";
    if (!completions && path != "/v1/chat/completions") {
      return Reply(stream, request, "other", Error(404, "no such endpoint: " + path), request.keep_alive());
    }
    const std::string endpoint = completions ? "completions" : "chat_completions";
    if (!post) return Reply(stream, request, endpoint, Error(405, "use POST " + path), request.keep_alive(), {{"Allow", "POST"}});
    if (draining) {
      return Reply(stream, request, endpoint, Error(503, "the server is shutting down; retry on another instance"), false);
    }
    return Complete(stream, fd, request, completions ? Endpoint::kCompletions : Endpoint::kChatCompletions, endpoint);
  }

  // Whether the request may go on: /health and /metrics need no key; /v1/ needs one of --api-keys (if any) as
  // "Authorization: Bearer KEY", the scheme in any case (RFC 9110: case-insensitive).
  bool Authorized(const Request& request) const {
    if (api_keys.empty() || request.target().substr(0, 4) != "/v1/") return true;
    const beast::string_view header = request[http::field::authorization];
    const std::size_t space = header.find(' ');
    if (space == beast::string_view::npos || !beast::iequals(header.substr(0, space), "bearer")) return false;
    const std::size_t start = header.find_first_not_of(' ', space);
    if (start == beast::string_view::npos) return false;
    const std::string key(header.substr(start));
    bool match = false;
    for (const std::string& k : api_keys) match = SameKey(k, key) || match;  // every key compared
    return match;
  }

  // A request without a valid key: 401, or 429 once its address failed 20 times within a minute (for a minute;
  // AuthLockout). The connection closes: its body, if any, was not read.
  template <class Stream>
  void RefuseKey(Stream& stream, const Request& request, const std::string& peer) {
    const bool missing = request[http::field::authorization].empty();
    const AuthLockout::Verdict v =
        lockout.Failed(peer, missing ? "no API key" : "a wrong API key", AuthLockout::Clock::now());
    if (!v.warning.empty()) spdlog::warn("namm-api: {}", v.warning);
    if (v.locked_out) {
      (void)Reply(stream, request, "auth",
                  Error(429, "too many requests without a valid API key from " + peer + "; refused for a minute", "",
                        "rate_limit_exceeded"),
                  false, {{"Retry-After", "60"}});
      return;
    }
    (void)Reply(stream, request, "auth",
                Error(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'", "",
                      "invalid_api_key"),
                false);
  }

  // Whether the operator's --allow-policies names the spec, its family or any.
  bool AllowedByOperator(const std::string& spec, const std::string& family) const {
    return std::any_of(options.allowed_policies.begin(), options.allowed_policies.end(),
                       [&](const std::string& a) { return a == "any" || a == family || a == spec; });
  }

  // Whether a request may name `spec` (of `family`) besides the server's own (ApiServerOptions::allowed_policies).
  bool Allowed(const std::string& spec, const std::string& family) const {
    if (!options.allowed_policies.empty()) return AllowedByOperator(spec, family);
    const Result<std::string> own = worker::policy_family(options.default_policy);
    if (family == "full") return own.ok() && *own == "full";
    // A token budget or a share of the prompt bounds what the cache holds; FastGen's does not (a head whose
    // attention needs it keeps every token).
    return family != "fastgen" &&
           (spec.find("budget=") != std::string::npos || spec.find("ratio=") != std::string::npos);
  }

  // The job of a parsed request, or the error to answer.
  std::variant<CompletionJob, ApiError> MakeJob(const CompletionRequest& r) {
    if (r.model != options.model_name) {
      return Error(404, "The model '" + r.model + "' does not exist; this server serves '" + options.model_name + "'",
                   "model", "model_not_found");
    }
    CompletionJob job;
    if (r.policy.empty() || r.policy == "default") {
      job.policy = options.default_policy;
    } else if (r.policy.rfind("default,", 0) == 0) {
      // The server's own policy with a cache setting: "default,budget=32" (a NAMM or a baseline's knob). A budget
      // or a ratio bounds what it holds, so it is allowed, as is heads=own (it holds less); a NAMM's threshold= may
      // keep more, and prompt=keep holds the whole prompt (a budget or not), so those only where the operator
      // allows NAMMs (--allow-policies namm).
      const std::string setting = r.policy.substr(std::string("default,").size());
      // The spec and its family; checked on the policy's label first, so that an error names the NAMM's file and
      // not where it lies.
      const auto compose = [&setting](const std::string& spec) -> Result<std::pair<std::string, std::string>> {
        NAMM_ASSIGN_OR_RETURN(std::string with, worker::with_cache_setting(spec, setting));
        NAMM_ASSIGN_OR_RETURN(std::string family, worker::policy_family(with));
        return std::make_pair(std::move(with), std::move(family));
      };
      Result<std::pair<std::string, std::string>> composed = compose(PolicyLabel(options.default_policy));
      if (composed.ok()) composed = compose(options.default_policy);
      if (!composed.ok()) return Error(400, "namm_policy: " + composed.status().message(), "namm_policy");
      const std::string& with = composed->first;
      const std::string& family = composed->second;
      bool may_hold_more = false;
      if (family == "namm") {
        const Result<worker::NammSpec> asked = worker::parse_namm_spec(with);
        const Result<worker::NammSpec> own = worker::parse_namm_spec(options.default_policy);
        may_hold_more = !asked.ok() || !own.ok() || (asked->knob.threshold && asked->setting != own->setting) ||
                        (asked->keep_prompt && !own->keep_prompt);
      }
      if (may_hold_more && !AllowedByOperator(with, family)) {
        return Error(400, "namm_policy '" + r.policy + "' may hold more than this server's " +
                              PolicyLabel(options.default_policy) +
                              ": ask for 'default,budget=N' or 'default,ratio=R', or have the operator allow it "
                              "(--allow-policies namm)",
                     "namm_policy");
      }
      job.policy = with;
    } else {
      Result<std::string> family = worker::policy_family(r.policy);
      if (!family.ok()) return Error(400, "namm_policy: " + family.status().message(), "namm_policy");
      if ((*family == "namm" || *family == "oracle") && r.policy != options.default_policy) {
        return Error(400, "namm_policy '" + r.policy + "' is not available per request: ask for 'default' (the server's " +
                              PolicyLabel(options.default_policy) + ") or a baseline (full, h2o:budget=N, ...)",
                     "namm_policy");
      }
      if (r.policy != options.default_policy && !Allowed(r.policy, *family)) {
        return Error(400, "namm_policy '" + r.policy + "' may hold more than this server's " +
                              PolicyLabel(options.default_policy) +
                              ": ask for 'default' or a bounded baseline (h2o:budget=N, streaming:ratio=R, ...), or have "
                              "the operator allow it (--allow-policies)",
                     "namm_policy");
      }
      job.policy = r.policy;
    }
    job.policy_label = PolicyLabel(job.policy);
    const std::string param = r.endpoint == Endpoint::kCompletions ? "prompt" : "messages";
    if (r.endpoint == Endpoint::kCompletions && r.prompt_is_ids) {
      for (int64_t id : r.prompt_ids) {
        if (id >= tokenizer.vocab_size()) {
          return Error(400, "prompt token id " + std::to_string(id) + " is outside the vocabulary of " +
                                std::to_string(tokenizer.vocab_size()), "prompt");
        }
      }
      job.prompt_ids = r.prompt_ids;
    } else {
      Result<std::vector<int64_t>> ids = Encode(r);
      if (!ids.ok()) return Error(400, ids.status().message(), param);
      job.prompt_ids = std::move(*ids);
    }
    const auto prompt = static_cast<int64_t>(job.prompt_ids.size());
    if (prompt == 0) return Error(400, "the prompt is empty", param);
    if (prompt > max_prompt_tokens) {
      return Error(400, "the prompt has " + std::to_string(prompt) + " tokens, over the server's limit of " +
                            std::to_string(max_prompt_tokens) + " (--max-prompt-tokens)", param, "prompt_too_long");
    }
    const int64_t room = context - prompt;
    // Unasked, OpenAI's defaults (16 for a completion, the room left for a chat) within the server's limit.
    job.max_tokens = r.max_tokens ? *r.max_tokens
                                  : std::min(max_tokens, r.endpoint == Endpoint::kCompletions
                                                             ? std::min<int64_t>(16, std::max<int64_t>(room, 0))
                                                             : room);
    if (job.max_tokens > room || room <= 0) {
      const uint64_t requested = static_cast<uint64_t>(prompt) + static_cast<uint64_t>(job.max_tokens);  // 2^63 - 1 fits
      return Error(400, "This model's maximum context length is " + std::to_string(context) + " tokens. However, you requested " +
                            std::to_string(requested) + " tokens (" + std::to_string(prompt) + " in the " +
                            param + ", " + std::to_string(job.max_tokens) + " in the completion). Please reduce the length.",
                   param, "context_length_exceeded");
    }
    if (job.max_tokens > max_tokens) {
      return Error(400, r.max_tokens_field + " is " + std::to_string(job.max_tokens) + ", over the server's limit of " +
                            std::to_string(max_tokens) + " (--max-tokens)", r.max_tokens_field);
    }
    job.temperature = r.temperature;
    job.seed = r.seed;
    job.stop = r.stop;
    job.text_continues_prompt = r.endpoint == Endpoint::kCompletions;
    job.max_tokens_field = r.max_tokens_field;
    job.ignore_eos = r.ignore_eos;
    job.stream = r.stream;
    return job;
  }

  Result<std::vector<int64_t>> Encode(const CompletionRequest& r) const {
    if (r.endpoint == Endpoint::kCompletions) return tokenizer.EncodeForModel(r.prompt);
    // Contents stay text: a message cannot write the template's control tokens (encode_chat).
    return worker::encode_chat(tokenizer, *chat_template, r.messages, true, chat_variables, !template_writes_bos);
  }

  template <class Stream>
  bool Complete(Stream& stream, int fd, const Request& http_request, Endpoint which, const std::string& endpoint) {
    auto parsed = parse_completion_request(which, http_request.body());
    if (auto* error = std::get_if<ApiError>(&parsed)) return Reply(stream, http_request, endpoint, *error, http_request.keep_alive());
    const CompletionRequest& request = std::get<CompletionRequest>(parsed);
    auto job = MakeJob(request);
    if (auto* error = std::get_if<ApiError>(&job)) return Reply(stream, http_request, endpoint, *error, http_request.keep_alive());
    in_flight.fetch_add(1);
    struct Done {
      std::atomic<int64_t>& n;
      ~Done() { n.fetch_sub(1); }
    } done{in_flight};
    bool shutting_down = false;
    std::shared_ptr<CompletionHandle> handle = scheduler->Submit(std::move(std::get<CompletionJob>(job)), &shutting_down);
    if (!handle && shutting_down) {
      return Reply(stream, http_request, endpoint, Error(503, "the server is shutting down; retry on another instance"), false);
    }
    if (!handle) {
      const int64_t retry = scheduler->retry_after_seconds();
      return Reply(stream, http_request, endpoint,
                   Error(429, "the server is busy: " + std::to_string(options.scheduler.max_queue) +
                                  " requests are waiting (--max-queue); retry after " + std::to_string(retry) + " s",
                         "", "rate_limit_exceeded"),
                   http_request.keep_alive(), {{"Retry-After", std::to_string(retry)}});
    }
    char id[40];
    std::snprintf(id, sizeof id, "%s-%llx%06llx", which == Endpoint::kCompletions ? "cmpl" : "chatcmpl",
                  static_cast<unsigned long long>(created), static_cast<unsigned long long>(responses.fetch_add(1)));
    const ResponseHeader header{id, std::time(nullptr), options.model_name};
    return request.stream ? StreamEvents(stream, fd, http_request, request, header, *handle, endpoint)
                          : Whole(stream, fd, http_request, request, header, *handle, endpoint);
  }

  // The first update with news `wanted` takes, or nullopt once the client left or the server stops (the request
  // then cancelled, counted as 499).
  template <class Wanted>
  std::optional<CompletionUpdate> WaitFor(CompletionHandle& handle, int fd, const std::string& endpoint, Wanted wanted) {
    while (true) {
      CompletionUpdate update = handle.Wait(kPollSlice);
      if (wanted(update)) return update;
      if (PeerGone(fd) || stopping.load()) {
        handle.Cancel();
        if (metrics) metrics->Request(endpoint, 499);
        return std::nullopt;
      }
    }
  }

  // Waits for the end (cancelling the request if its client leaves), then answers.
  template <class S>
  bool Whole(S& stream, int fd, const Request& http_request, const CompletionRequest& request,
             const ResponseHeader& header, CompletionHandle& handle, const std::string& endpoint) {
    std::optional<CompletionUpdate> update =
        WaitFor(handle, fd, endpoint, [](const CompletionUpdate& u) { return u.finished; });
    if (!update) return false;
    if (update->error) return Reply(stream, http_request, endpoint, *update->error, http_request.keep_alive());
    return Send(stream, http_request, endpoint, 200, completion_response(request, header, update->outcome),
                "application/json", {}, http_request.keep_alive());
  }

  // Server-sent events, one per piece of text, as it is generated; then the finish reason, the usage if asked,
  // and [DONE]. A write that fails (the client left) cancels the request.
  template <class S>
  bool StreamEvents(S& stream, int fd, const Request& http_request, const CompletionRequest& request,
              const ResponseHeader& header, CompletionHandle& handle, const std::string& endpoint) {
    // The head goes with the first text: a request refused once queued (its KV over --max-kv-bytes, a policy's
    // options) is answered with its status, as without stream, and not with 200 and an error event.
    std::optional<CompletionUpdate> first =
        WaitFor(handle, fd, endpoint, [](const CompletionUpdate& u) { return !u.text.empty() || u.finished; });
    if (!first) return false;
    if (first->error) return Reply(stream, http_request, endpoint, *first->error, http_request.keep_alive());
    // HTTP/1.1 streams in chunks and may keep the connection; HTTP/1.0 has no chunks: the stream ends with the
    // connection.
    const bool chunked = http_request.version() >= 11;
    http::response<http::empty_body> head{http::status::ok, http_request.version()};
    head.set(http::field::content_type, "text/event-stream");
    head.set(http::field::cache_control, "no-cache");
    head.keep_alive(chunked && http_request.keep_alive());
    head.chunked(chunked);
    http::response_serializer<http::empty_body> serializer{head};
    beast::error_code ec;
    http::write_header(stream, serializer, ec);
    const auto event = [&](const std::string& data) {
      const std::string text = "data: " + data + "\n\n";
      if (chunked) {
        asio::write(stream, http::make_chunk(asio::buffer(text)), ec);
      } else {
        asio::write(stream, asio::buffer(text), ec);
      }
      return !ec;
    };
    bool ok = !ec;
    if (ok && request.endpoint == Endpoint::kChatCompletions) ok = event(stream_text_chunk(request, header, "", true));
    int status = 200;
    for (bool first_update = true; ok; first_update = false) {
      CompletionUpdate update = first_update ? std::move(*first) : handle.Wait(kPollSlice);
      if (!update.text.empty()) ok = event(stream_text_chunk(request, header, update.text, false));
      if (ok && update.finished) {
        if (update.error) {
          status = update.error->http_status;
          ok = event(update.error->ToJson());
        } else {
          for (const std::string& chunk : stream_final_chunks(request, header, update.outcome)) ok = ok && event(chunk);
        }
        ok = ok && event("[DONE]");
        if (ok && chunked) asio::write(stream, http::make_chunk_last(), ec);
        if (metrics) metrics->Request(endpoint, status);
        return ok && !ec && head.keep_alive();
      }
      if (ok && update.text.empty() && (PeerGone(fd) || stopping.load())) ok = false;
    }
    handle.Cancel();
    if (metrics) metrics->Request(endpoint, 499);
    return false;
  }

  template <class S>
  bool Reply(S& stream, const Request& request, const std::string& endpoint, const ApiError& error, bool keep_alive,
             const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    return Send(stream, request, endpoint, error.http_status, error.ToJson(), "application/json", headers, keep_alive);
  }

  template <class S>
  bool Send(S& stream, const Request& request, const std::string& endpoint, int status, std::string body,
            const std::string& content_type, const std::vector<std::pair<std::string, std::string>>& headers,
            bool keep_alive) {
    http::response<http::string_body> response{static_cast<http::status>(status), request.version() ? request.version() : 11};
    response.set(http::field::content_type, content_type);
    for (const auto& [name, value] : headers) response.set(name, value);
    response.keep_alive(keep_alive && !draining.load());
    response.body() = std::move(body);
    response.prepare_payload();
    beast::error_code ec;
    if (request.method() == http::verb::head) {  // the head alone: a body would be read as the next response
      http::response_serializer<http::string_body> serializer{response};
      http::write_header(stream, serializer, ec);
    } else {
      http::write(stream, response, ec);
    }
    if (metrics) metrics->Request(endpoint, status);
    return !ec && response.keep_alive();
  }
};

ApiServer::ApiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ApiServer::~ApiServer() { Drain(std::chrono::milliseconds(0)); }

Result<std::unique_ptr<ApiServer>> ApiServer::Start(const worker::LlamaModel& model, const worker::Tokenizer& tokenizer,
                                                    const worker::LoadedChatTemplate* chat, ApiServerOptions options) {
  if (options.model_name.empty()) return Status::InvalidArgument("the server needs a model name (--served-model-name)");
  if (options.max_body_bytes == 0) return Status::InvalidArgument("--max-body-bytes must be positive");
  if (options.max_connections == 0) return Status::InvalidArgument("--max-connections must be positive");
  if (!(options.idle_timeout_seconds > 0)) return Status::InvalidArgument("--idle-timeout must be positive");
  if ((options.tls_cert.empty()) != (options.tls_key.empty())) {
    return Status::InvalidArgument("TLS needs both --tls-cert and --tls-key");
  }
  if (!options.tls_client_ca.empty() && options.tls_cert.empty()) {
    return Status::InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key");
  }
  auto impl = std::make_unique<Impl>(model, tokenizer, std::move(options));
  const ApiServerOptions& o = impl->options;
  impl->context = o.scheduler.max_context > 0 ? o.scheduler.max_context : model.config().context_length();
  impl->max_prompt_tokens = o.max_prompt_tokens > 0 ? std::min(o.max_prompt_tokens, impl->context) : impl->context;
  impl->idle_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.idle_timeout_seconds * 1000));
  impl->max_tokens = o.max_tokens > 0 ? std::min(o.max_tokens, impl->context) : impl->context;
  if (chat != nullptr) {
    impl->chat_template = chat->chat_template;
    impl->chat_variables = chat->variables;
    impl->template_writes_bos = true;
  } else {
    NAMM_ASSIGN_OR_RETURN(worker::ChatTemplate plain, worker::ChatTemplate::Parse(kPlainChatTemplate));
    impl->chat_template = std::move(plain);
  }
  if (!o.api_keys_file.empty()) {
    NAMM_ASSIGN_OR_RETURN(impl->api_keys, read_api_keys(o.api_keys_file));
  }
  if (!o.tls_cert.empty()) {
    try {
      impl->tls.emplace(ssl::context::tls_server);
      impl->tls->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                             ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
      impl->tls->use_certificate_chain_file(o.tls_cert);
      impl->tls->use_private_key_file(o.tls_key, ssl::context::pem);
      if (!o.tls_client_ca.empty()) {
        impl->tls->load_verify_file(o.tls_client_ca);
        impl->tls->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
      }
    } catch (const std::exception& e) {
      return Status::InvalidArgument("TLS: cannot use --tls-cert " + o.tls_cert + " / --tls-key " + o.tls_key +
                                     (o.tls_client_ca.empty() ? "" : " / --tls-client-ca " + o.tls_client_ca) + ": " +
                                     e.what());
    }
  }
  NAMM_ASSIGN_OR_RETURN(const ListenAddress address, parse_listen_address(o.listen, "--listen"));
  NAMM_RETURN_IF_ERROR(listen_on(impl->acceptor, address, "--listen"));
  boost::system::error_code ec;
  impl->acceptor.non_blocking(true, ec);  // a connection reset between poll and accept must not block the loop
  impl->port = impl->acceptor.local_endpoint().port();
  const std::string host = address.host.find(':') != std::string::npos ? "[" + address.host + "]" : address.host;
  impl->url = (impl->tls ? "https://" : "http://") + host + ":" + std::to_string(impl->port);
  impl->metrics = std::make_unique<ApiMetrics>(o.model_name, PolicyLabel(o.default_policy));
  NAMM_ASSIGN_OR_RETURN(impl->scheduler, CompletionScheduler::Start(model, tokenizer, o.default_policy, o.scheduler,
                                                                    impl->metrics.get()));
  Impl* raw = impl.get();
  impl->keep_running.emplace(asio::make_work_guard(impl->io));
  asio::post(impl->io, [raw] { raw->Accept(); });
  impl->io_thread = std::thread([raw] { raw->RunIo(); });
  return std::unique_ptr<ApiServer>(new ApiServer(std::move(impl)));
}

int ApiServer::port() const { return impl_->port; }

const std::string& ApiServer::url() const { return impl_->url; }

void ApiServer::Drain(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(impl_->drain_mutex);
  Impl& impl = *impl_;
  if (!impl.io_thread.joinable()) return;  // drained before
  impl.draining.store(true);
  asio::post(impl.io, [&impl] {
    beast::error_code ignored;
    impl.acceptor.close(ignored);
    impl.accept_retry.cancel();
  });
  const auto deadline = Clock::now() + timeout;
  while (impl.in_flight.load() > 0 && Clock::now() < deadline) std::this_thread::sleep_for(kPollSlice);
  impl.scheduler->Stop();  // what is still running ends with 503
  const auto grace = Clock::now() + std::chrono::seconds(1);  // for those answers to be written
  while (impl.in_flight.load() > 0 && Clock::now() < grace) std::this_thread::sleep_for(kPollSlice);
  impl.stopping.store(true);  // every socket operation ends: waiting connections close, answers end
  asio::post(impl.io, [&impl] {
    for (Impl::Session* s : impl.waiting_sessions) Impl::CloseSocket(*s);
  });
  impl.keep_running.reset();  // the io thread ends once every connection has (answers hold it until they post)
  impl.io_thread.join();
}

}  // namespace namm::server
