// namm-api's HTTP side: an OpenAI-compatible server (HTTP/1.1 from Boost.Beast, optionally TLS) in front of the
// CompletionScheduler. Endpoints:
//   POST /v1/completions, POST /v1/chat/completions   (openai_protocol.h; "stream": true answers server-sent events)
//   GET  /v1/models, /v1/models/{id}
//   GET  /health    200 {"status": "ok", ...}, 503 while draining
//   GET  /metrics   Prometheus text exposition
// With API keys, every /v1/ request needs "Authorization: Bearer KEY" (the scheme in any case; 401 otherwise,
// answered on the headers, before any body or 100 Continue; 429 for a minute to an address with 20 failures in a
// minute); /health and /metrics stay open, as scrapers and load balancers expect.
//
// Limits, each answered with an OpenAI error object: a body over max_body_bytes (413), a prompt over
// max_prompt_tokens or max_tokens over its limit or the context (400 naming the limit), a full queue (429 with
// Retry-After), connections over max_connections or max_connections_per_address (the oldest idle one under the
// limit closed; 503 when all are busy), a request over the scheduler's time limit (408). A client that
// disconnects frees its row at the next step once that shows: a stream's at its next write, any request's once
// its connection resets (a closed socket's FIN alone looks like a client that only stopped sending, which still
// gets its answer: docs/serving.md). Connections wait for requests on one thread
// (Asio's asynchronous reads: an idle connection holds no thread); each request being answered has a thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "namm/server/completion_scheduler.h"
#include "namm/status.h"
#include "namm/worker/chat_template.h"

namespace namm::server {

struct ApiServerOptions {
  std::string listen = "127.0.0.1:8000";  // HOST:PORT, or a port alone (loopback); port 0 picks a free one
  std::string model_name;                 // what /v1/models lists and requests must name
  std::string default_policy = "full";    // a policy spec (worker/policy_spec.h)
  // What a request's namm_policy may name besides the server's own: policy families ("full", "h2o", ...) or "any"
  // baseline. Empty: the policies that hold a bounded cache (a token budget or a share of the prompt), and the
  // full cache only when it is the server's own: a client cannot make the server hold more than its operator chose.
  // NAMM files and the oracle never (a client must not make the server read files).
  std::vector<std::string> allowed_policies;
  std::string tls_cert, tls_key, tls_client_ca;  // PEM files; a cert and key enable TLS, a CA requires client certs
  std::string api_keys_file;              // one key per line ('#' comments); empty: no authentication
  std::size_t max_body_bytes = 1 << 20;
  int64_t max_prompt_tokens = 0;  // 0: the model's context
  int64_t max_tokens = 0;         // most new tokens a request may ask for; 0: the model's context
  // Open connections at once, and from one client address (0: no limit of its own). When one is full, the
  // oldest idle connection (waiting for a request) under it is closed for the new one; a 503 only when none is.
  std::size_t max_connections = 256;
  std::size_t max_connections_per_address = 64;
  double idle_timeout_seconds = 60;  // a connection with no request (or a stalled read or write) this long is closed
  SchedulerOptions scheduler;
};

class ApiServer {
 public:
  // Binds and starts serving. The model and tokenizer must outlive the server. `chat`: the model's chat template;
  // null for the plain one ("role: content" lines, then "assistant:"), for models without one.
  static Result<std::unique_ptr<ApiServer>> Start(const worker::LlamaModel& model, const worker::Tokenizer& tokenizer,
                                                  const worker::LoadedChatTemplate* chat, ApiServerOptions options);
  ~ApiServer();  // Drain(0)
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  int port() const;
  // http(s)://HOST:PORT
  const std::string& url() const;
  // Stops accepting connections and answers new requests with 503; waits up to `timeout` for the requests in
  // flight to finish, then ends the rest (503) and closes every connection. Idempotent.
  void Drain(std::chrono::milliseconds timeout);

 private:
  struct Impl;
  explicit ApiServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The keys of an API keys file: one per line, surrounding blanks trimmed, blank lines and '#' comments skipped.
// An error names the file when it cannot be read or holds no key.
Result<std::vector<std::string>> read_api_keys(const std::string& path);

}  // namespace namm::server
