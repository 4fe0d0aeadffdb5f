// namm-api: an OpenAI-compatible HTTP server for one model and its memory policy (an evolved NAMM or a
// baseline), with continuous batching. Not to be confused with `namm-worker serve`, the training daemon.
#include <csignal>
#include <cstdint>
#include <iostream>
#include <optional>
#include <random>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "namm/file_util.h"
#include "namm/server/api_server.h"
#include "setup.h"

namespace {

namespace cli = namm::worker::cli;

struct Options {
  cli::ModelOptions model;
  cli::PolicyOptions policy;
  cli::InferenceOptions inference;
  namm::server::ApiServerOptions server;
  std::string chat_template, log_level = "info";
  double drain_seconds = 30;
  cli::KvMemoryOptions kv;
};

int Fail(const std::string& message) {
  std::cerr << "namm-api: error: " << message << "\n";
  return 1;
}

// The model's chat template: --chat-template FILE, else the tokenizer directory's (chat_template.jinja or
// tokenizer_config.json), else none (the server's plain template).
namm::Result<std::optional<namm::worker::LoadedChatTemplate>> LoadChat(const Options& o) {
  if (!o.chat_template.empty()) {
    NAMM_ASSIGN_OR_RETURN(const std::string source, namm::read_file(o.chat_template));
    NAMM_ASSIGN_OR_RETURN(namm::worker::ChatTemplate parsed, namm::worker::ChatTemplate::Parse(source));
    return std::optional<namm::worker::LoadedChatTemplate>(
        namm::worker::LoadedChatTemplate{std::move(parsed), nlohmann::ordered_json::object()});
  }
  const std::string tokenizer = o.model.tokenizer.empty() ? o.model.model : o.model.tokenizer;
  const std::string dir = namm::is_directory(tokenizer) ? tokenizer : namm::parent_directory(tokenizer);
  namm::Result<namm::worker::LoadedChatTemplate> loaded = namm::worker::load_chat_template(dir);
  if (loaded.ok()) return std::optional<namm::worker::LoadedChatTemplate>(std::move(*loaded));
  if (loaded.status().code() == namm::Status::Code::kNotFound) return std::optional<namm::worker::LoadedChatTemplate>();
  return loaded.status();
}

int Run(Options& o) {
  if (o.model.chat) {
    return Fail("--chat does not apply to namm-api: /v1/chat/completions formats messages with the chat template, "
                "/v1/completions sends the prompt as it is");
  }
  const auto level = spdlog::level::from_str(o.log_level);
  if (level == spdlog::level::off && o.log_level != "off") return Fail("--log-level must be trace, debug, info, warn, error or off");
  spdlog::set_level(level);
  // Signals are taken by sigwait below: blocked here, before any thread starts, so that every thread inherits it.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  cli::ApplyThreads(o.inference);
  auto loaded = cli::LoadModelAndTokenizer(o.model);
  if (!loaded.ok()) return Fail(loaded.status().message());
  auto chat = LoadChat(o);
  if (!chat.ok()) return Fail(chat.status().message());
  namm::server::ApiServerOptions& s = o.server;
  s.default_policy = o.policy.Spec();
  if (s.model_name.empty()) {  // the model directory's name, or the model file's without its extension
    std::string path = o.model.model;
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    s.model_name = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
    const std::size_t dot = s.model_name.rfind('.');
    if (!namm::is_directory(o.model.model) && dot != std::string::npos && dot > 0) s.model_name.resize(dot);
  }
  if (o.inference.chunk_size > 0) s.scheduler.chunk_size = o.inference.chunk_size;
  if (o.inference.update_interval > 0) s.scheduler.update_interval = o.inference.update_interval;
  s.scheduler.max_context = o.inference.max_context;
  const namm::Result<int64_t> kv_budget = cli::ApplyKvMemory(*loaded->model, o.kv);  // 0 when unknown: no limit
  if (!kv_budget.ok()) return Fail(kv_budget.status().message());
  s.scheduler.max_kv_bytes = *kv_budget;
  auto server = namm::server::ApiServer::Start(*loaded->model, *loaded->tokenizer, chat->has_value() ? &**chat : nullptr, s);
  if (!server.ok()) return Fail(server.status().message());
  std::cout << "namm-api: serving " << s.model_name << " with " << s.default_policy << " on " << (*server)->url()
            << (chat->has_value() ? " (the model's chat template)" : " (plain chat template)") << "; KV caches up to "
            << (s.scheduler.max_kv_bytes > 0 ? std::to_string(s.scheduler.max_kv_bytes >> 20) + " MiB together"
                                             : std::string("any size (no --max-kv-bytes)"))
            << (o.kv.kv_block_tokens > 0 ? ", in blocks of " + std::to_string(o.kv.kv_block_tokens) + " tokens" : std::string())
            << "; requests without a seed draw theirs from --seed " << s.scheduler.seed << std::endl;
  int signal = 0;
  sigwait(&signals, &signal);
  std::cout << "namm-api: " << (signal == SIGTERM ? "SIGTERM" : "SIGINT") << ": draining (up to " << o.drain_seconds
            << " s)" << std::endl;
  (*server)->Drain(std::chrono::milliseconds(static_cast<int64_t>(o.drain_seconds * 1000)));
  std::cout << "namm-api: stopped" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"namm-api: an OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming) for a "
               "Llama-family model with a NAMM or a baseline memory policy, with continuous batching."};
  Options o;
  cli::AddModelOptions(&app, o.model);
  cli::AddPolicyOptions(&app, o.policy);
  cli::AddInferenceOptions(&app, o.inference);
  namm::server::ApiServerOptions& s = o.server;
  app.add_option("--listen", s.listen, "HOST:PORT to serve on, or a port alone for loopback (default 127.0.0.1:8000)");
  app.add_option("--served-model-name", s.model_name, "The model's name in the API (default: the model file's name)");
  app.add_option("--chat-template", o.chat_template,
                 "A Jinja chat template file (default: the tokenizer directory's, else 'role: content' lines)")
      ->check(CLI::ExistingFile);
  app.add_option("--api-keys", s.api_keys_file, "File of API keys, one per line: /v1/ requests need 'Authorization: Bearer KEY'")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-cert", s.tls_cert, "PEM certificate chain (enables TLS)");
  app.add_option("--tls-key", s.tls_key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", s.tls_client_ca, "PEM CA that client certificates must chain to (mutual TLS)");
  app.add_option("--max-body-bytes", s.max_body_bytes, "Largest request body (default 1 MiB; larger: 413)")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-prompt-tokens", s.max_prompt_tokens, "Longest prompt in tokens (default: the context)")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-tokens", s.max_tokens, "Most new tokens a request may ask for (default: the context)")
      ->check(CLI::PositiveNumber);
  app.add_option("--step-tokens", s.scheduler.step_tokens,
                 "Tokens a forward pass takes at most: every decoding request's next token first, then prompt chunks "
                 "in arrival order (at least one chunk a pass); 0: every request's chunk each pass (default 512)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-running", s.scheduler.max_running, "Requests in the running batch at once (default 8)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--max-queue", s.scheduler.max_queue, "Requests waiting for a place in the batch; more get 429 (default 64)");
  app.add_option("--max-connections", s.max_connections,
                 "Open connections at once; when full, the oldest idle one is closed for a new one, and only when "
                 "none is idle a new one gets 503 (default 256)")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-connections-per-address", s.max_connections_per_address,
                 "Open connections from one client address; when full, that address's oldest idle one is closed "
                 "for its new one (default 64; 0: only --max-connections)");
  cli::AddKvMemoryOptions(&app, o.kv,
                          "a request joins the batch when what it holds fits beside the others' (it waits meanwhile), "
                          "the youngest are preempted when the running ones outgrow it, one that never could fit gets 400");
  app.add_option("--request-timeout", s.scheduler.request_timeout_seconds,
                 "Seconds a request may take from arrival to its last token (default 600; then 408)")
      ->check(CLI::PositiveNumber);
  app.add_option("--idle-timeout", s.idle_timeout_seconds,
                 "Seconds a connection may wait for a request, or a read or write may stall (default 60)")
      ->check(CLI::PositiveNumber);
  app.add_option("--drain-timeout", o.drain_seconds,
                 "On SIGTERM or SIGINT: seconds to let running requests finish before ending them (default 30)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--allow-policies", s.allowed_policies,
                 "Policy families a request's namm_policy may name besides the server's own (e.g. full,h2o), or 'any' "
                 "(default: those with a token budget or a share of the prompt, except FastGen, whose heads may keep "
                 "every token; the full cache and FastGen only if they are the server's)")
      ->delimiter(',');
  CLI::Option* seed = app.add_option("--seed", s.scheduler.seed,
                                     "Seed of the sampling seeds drawn for requests that give none (default: drawn "
                                     "from the OS at start and printed, so that restarts and replicas differ)");
  app.add_option("--log-level", o.log_level, "trace, debug, info (default), warn, error or off");
  CLI11_PARSE(app, argc, argv);
  if (seed->count() == 0) {
    std::random_device entropy;
    s.scheduler.seed = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
  }
  try {
    return Run(o);
  } catch (const std::exception& e) {
    return Fail(e.what());
  }
}
