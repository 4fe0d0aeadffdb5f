// namm-api under load, measured in one run: a server in this process (the real HTTP server, scheduler and batched
// engine) and C client threads, each streaming R completions over HTTP at once (greedy, a prompt of P seeded random
// token ids, M new tokens, the usage in the last event), for C in --clients, for each policy (the full cache, and
// --namm's NAMM, StreamingLLM with --streaming-budget), each KV block size in --kv-block-tokens and each per-pass
// token budget in --step-tokens. Prints one table row per (policy, blocks, budget, C): the most requests running at
// once and those preempted for memory, generated tokens per second over the whole run, its ratio to one client,
// time to first token p50 / p99, time between tokens p50, the process's peak resident memory, the KV bytes each
// request held at its peak (namm.cache.peak_kv_bytes, mean over requests), its mean cache in tokens, and the FLOP rate of the run against a matrix-product peak
// measured in the same run on the same threads (bench/roofline.h: the model's products and attention over the keys
// each request reports, namm.cache.mean_kv_tokens; a NAMM's memory updates are not counted, its observation is).
// Options: kUsage below (--help).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "namm/cpu_threads.h"
#include "namm/server/api_server.h"
#include "namm/server/completion_scheduler.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/tokenizer.h"
#include "bench_args.h"
#include "random_model.h"
#include "roofline.h"

namespace namm::bench {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = std::string(NAMM_SHARED_DIR) + "/models/stories260K/stories260K.bin";
  std::string tokenizer = std::string(NAMM_SHARED_DIR) + "/models/stories260K/tok512.bin";
  std::string random_model, namm;
  std::vector<int64_t> clients = {1, 8, 64};
  std::vector<int64_t> step_tokens = {512};  // the server's per-pass token budget (0: every prompt each pass)
  int64_t requests = 2, prompt_tokens = 448, max_tokens = 64, max_running = 64, chunk = 32, update_interval = 64;
  int64_t threads = 2, context = 0;
  int64_t kv_budget = 0;  // the server's --max-kv-bytes (0: no limit)
  std::vector<int64_t> kv_block_tokens = {16};  // the server's --kv-block-tokens (0: rectangular caches)
  int64_t streaming_budget = 0;                 // > 0: StreamingLLM with this budget in the table too
  bool skip_full = false;                       // --skip-full 1: no full-cache rows (to profile the others)
  std::vector<std::string> namm_heads = {"equal"};  // the NAMM's heads= settings to compare (own: a ragged cache)
};

struct RequestStats {
  double first_token = 0;            // seconds from sending to the first text
  std::vector<double> between;       // seconds between text events
  int64_t tokens = 0, peak_kv_bytes = 0;
  double mean_kv_tokens = 0;         // namm.cache.mean_kv_tokens
  std::string error;
};

// One streamed completion over a fresh connection.
RequestStats Stream(int port, const std::string& body) {
  RequestStats stats;
  try {
    asio::io_context io;
    asio::ip::tcp::socket socket(io);
    socket.connect({asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)});
    http::request<http::string_body> request{http::verb::post, "/v1/completions", 11};
    request.set(http::field::host, "127.0.0.1");
    request.set(http::field::content_type, "application/json");
    request.body() = body;
    request.prepare_payload();
    const auto sent = Clock::now();
    http::write(socket, request);
    beast::flat_buffer buffer;
    http::response_parser<http::string_body> parser;
    parser.body_limit(1 << 30);
    std::size_t seen = 0;
    auto last = sent;
    while (!parser.is_done()) {
      http::read_some(socket, buffer, parser);
      const std::string& text = parser.get().body();
      for (std::size_t end; (end = text.find("\n\n", seen)) != std::string::npos; seen = end + 2) {
        const std::string event = text.substr(seen, end - seen);
        if (event.rfind("data: {", 0) != 0) continue;
        const nlohmann::json j = nlohmann::json::parse(event.substr(6));
        if (j.contains("error")) throw std::runtime_error(j["error"]["message"].get<std::string>());
        if (j.contains("usage")) stats.tokens = j["usage"]["completion_tokens"];
        if (j.contains("namm")) {
          stats.peak_kv_bytes = j["namm"]["cache"]["peak_kv_bytes"];
          stats.mean_kv_tokens = j["namm"]["cache"]["mean_kv_tokens"];
        }
        if (!j["choices"].empty() && !j["choices"][0]["text"].get<std::string>().empty()) {
          const auto now = Clock::now();
          if (stats.first_token == 0) stats.first_token = std::chrono::duration<double>(now - sent).count();
          else stats.between.push_back(std::chrono::duration<double>(now - last).count());
          last = now;
        }
      }
    }
    if (parser.get().result() != http::status::ok) stats.error = "HTTP " + std::to_string(parser.get().result_int());
  } catch (const std::exception& e) {
    stats.error = e.what();
  }
  return stats;
}

// The requests running now, from the server's /health.
// The body of GET `path`; throws when the server does not answer.
std::string Get(int port, const char* path) {
  asio::io_context io;
  asio::ip::tcp::socket socket(io);
  socket.connect({asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)});
  http::request<http::empty_body> request{http::verb::get, path, 11};
  request.set(http::field::host, "127.0.0.1");
  http::write(socket, request);
  beast::flat_buffer buffer;
  http::response<http::string_body> response;
  http::read(socket, buffer, response);
  return response.body();
}

int64_t RunningNow(int port) {
  try {
    return nlohmann::json::parse(Get(port, "/health")).value("running", int64_t{0});
  } catch (const std::exception&) {
    return 0;  // (the server drained)
  }
}

// Requests the server preempted for memory so far (namm_api_preemptions_total).
int64_t Preemptions(int port) {
  const std::string metrics = Get(port, "/metrics"), name = "\nnamm_api_preemptions_total ";
  const std::size_t at = metrics.find(name);
  return at == std::string::npos ? -1 : std::stoll(metrics.substr(at + name.size()));
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

// The process's peak resident memory (VmHWM), in MiB.
double PeakRssMiB() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

int Run(const Options& o) {
  set_cpu_threads(static_cast<int>(o.threads));
  Result<std::unique_ptr<worker::Tokenizer>> tokenizer = worker::load_tokenizer(o.tokenizer);
  if (!tokenizer.ok()) return std::fprintf(stderr, "%s\n", tokenizer.status().message().c_str()), 1;
  std::unique_ptr<worker::LlamaModel> model;
  if (o.random_model.empty()) {
    auto loaded = worker::LlamaModel::Load(o.model, {});
    if (!loaded.ok()) return std::fprintf(stderr, "%s\n", loaded.status().message().c_str()), 1;
    model = std::make_unique<worker::LlamaModel>(std::move(*loaded));
  } else {
    auto made = RandomModel(o.random_model, o.prompt_tokens + o.max_tokens, at::kFloat, at::kCPU);
    if (!made.ok()) return std::fprintf(stderr, "%s\n", made.status().message().c_str()), 1;
    model = std::make_unique<worker::LlamaModel>(std::move(*made));
  }
  const int64_t vocab = std::min<int64_t>(model->config().vocab_size, (*tokenizer)->vocab_size());
  std::vector<int64_t> prompt = RandomPrompt(vocab, o.prompt_tokens);
  // Every request makes max_tokens tokens (ignore_eos, as vLLM's serving benchmark asks), so that policies and
  // runs compare the same work.
  const nlohmann::json body = {{"model", "bench"}, {"prompt", prompt}, {"max_tokens", o.max_tokens},
                               {"temperature", 0}, {"ignore_eos", true}, {"stream", true},
                               {"stream_options", {{"include_usage", true}}}};
  std::printf("api_server_bench: %s, prompt %lld random tokens + %lld new, chunk %lld, memory update every %lld, "
              "%lld threads, %lld requests per client\n\n",
              model->config().Describe().c_str(), static_cast<long long>(o.prompt_tokens),
              static_cast<long long>(o.max_tokens), static_cast<long long>(o.chunk),
              static_cast<long long>(o.update_interval), static_cast<long long>(o.threads),
              static_cast<long long>(o.requests));
  const MatmulPeak peak = MeasureMatmulPeak();
  std::printf("matrix-product peak %.1f GFLOP/s (%s, measured now on these threads)\n\n", peak.gflops,
              peak.source.c_str());
  std::printf("| policy | KV blocks | step tokens | clients | most running | preempted | tokens/s | vs 1 client | TTFT p50 (s) | TTFT p99 (s) | between tokens p50 (ms) | "
              "peak RSS (MiB) | KV bytes per request | mean cache (tokens) | GFLOP/s | of peak |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> policies;
  if (!o.skip_full) policies.push_back("full");
  for (const std::string& heads : o.namm_heads) {
    if (!o.namm.empty()) policies.push_back("namm:" + o.namm + (heads == "own" ? ",heads=own" : ""));
  }
  if (o.streaming_budget > 0) policies.push_back("streaming:budget=" + std::to_string(o.streaming_budget));
  for (const std::string& policy : policies) {
    for (int64_t block_tokens : o.kv_block_tokens)
    for (int64_t step_tokens : o.step_tokens) {
      if (Status blocks = worker::use_kv_blocks(*model, block_tokens, o.kv_budget); !blocks.ok()) {
        return std::fprintf(stderr, "%s\n", blocks.message().c_str()), 1;
      }
      double one_client_rate = 0;
      for (int64_t clients : o.clients) {
        server::ApiServerOptions options;
        options.listen = "127.0.0.1:0";
        options.model_name = "bench";
        options.default_policy = policy;
        // A fresh connection per request: a client's last one may still be closing on the server's side.
        options.max_connections = static_cast<std::size_t>(2 * clients + 16);
        options.max_connections_per_address = 0;  // every client and the sampler come from 127.0.0.1
        options.scheduler.max_running = static_cast<std::size_t>(o.max_running);
        options.scheduler.max_queue = static_cast<std::size_t>(clients * o.requests + 8);
        options.scheduler.chunk_size = o.chunk;
        options.scheduler.update_interval = o.update_interval;
        options.scheduler.max_context = o.context;
        options.scheduler.step_tokens = step_tokens;
        options.scheduler.max_kv_bytes = o.kv_budget;
        auto started = server::ApiServer::Start(*model, **tokenizer, nullptr, options);
        if (!started.ok()) return std::fprintf(stderr, "%s\n", started.status().message().c_str()), 1;
        const int port = (*started)->port();
        std::mutex mutex;
        std::vector<RequestStats> all;
        const auto start = Clock::now();
        std::vector<std::thread> threads;
        for (int64_t c = 0; c < clients; ++c) {
          threads.emplace_back([&] {
            for (int64_t r = 0; r < o.requests; ++r) {
              RequestStats stats = Stream(port, body.dump());
              std::lock_guard<std::mutex> lock(mutex);
              all.push_back(std::move(stats));
            }
          });
        }
        std::atomic<bool> clients_done{false};
        int64_t most_running = 0;  // the requests running at once, sampled every 10 ms
        std::thread sampler([&] {
          while (!clients_done.load()) {
            most_running = std::max(most_running, RunningNow(port));
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        });
        for (auto& t : threads) t.join();
        clients_done.store(true);
        sampler.join();
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        const int64_t preemptions = Preemptions(port);
        (*started)->Drain(std::chrono::milliseconds(0));
        std::vector<double> first, between;
        double tokens = 0, kv = 0, mean_cache = 0, flops = 0;
        const int64_t namm_hidden = policy == "full" ? 0 : 32;
        for (const RequestStats& s : all) {
          if (!s.error.empty()) return std::fprintf(stderr, "a request failed: %s\n", s.error.c_str()), 1;
          first.push_back(s.first_token);
          between.insert(between.end(), s.between.begin(), s.between.end());
          tokens += static_cast<double>(s.tokens);
          kv += static_cast<double>(s.peak_kv_bytes) / static_cast<double>(all.size());
          mean_cache += s.mean_kv_tokens / static_cast<double>(all.size());
          worker::GenerationResult done;  // what the response tells of the generation
          done.prompt_tokens = o.prompt_tokens;
          done.decode_steps = std::max<int64_t>(0, s.tokens - 1);
          done.mean_kv_tokens = s.mean_kv_tokens;
          flops += GenerationFlops(model->config(), done, s.tokens, namm_hidden);
        }
        const double rate = tokens / seconds;
        if (clients == o.clients.front()) one_client_rate = rate;
        std::printf("| %s | %s | %lld | %lld | %lld | %lld | %.3g | %.2fx | %.3f | %.3f | %.2f | %.0f | %.0f | %.1f | %s |\n",
                    policy.rfind("namm:", 0) != 0 ? policy.c_str()
                    : policy.find(",heads=own") != std::string::npos ? "NAMM, heads=own" : "NAMM",
                    block_tokens > 0 ? std::to_string(block_tokens).c_str() : "no", static_cast<long long>(step_tokens),
                    static_cast<long long>(clients), static_cast<long long>(most_running), static_cast<long long>(preemptions), rate,
                    rate / one_client_rate, Percentile(first, 0.5), Percentile(first, 0.99),
                    1000 * Percentile(between, 0.5), PeakRssMiB(), kv, mean_cache, RooflineCells(flops, seconds, peak).c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace namm::bench

constexpr const char* kUsage = R"(Usage: api_server_bench [--model M --tokenizer T | --random-model layers=2,dim=4096,...] [--namm FILE]
       [--clients 1,8,64] [--requests 2] [--prompt-tokens 448] [--max-tokens 64] [--max-running 64]
       [--chunk 32] [--update-interval 64] [--threads 2] [--context 0] [--step-tokens 512]
       [--kv-budget 0] [--kv-block-tokens 16] [--streaming-budget 0] [--skip-full 0] [--namm-heads equal]
--namm-heads: the NAMM's heads= settings, a list to compare (own: each KV head keeps its own count).
--step-tokens: the server's per-pass token budget, a list to compare (0: every prompt's chunk each pass).
--kv-budget BYTES: the server's --max-kv-bytes (admission and preemption by memory; 0: no limit).
--kv-block-tokens: the server's --kv-block-tokens, a list to compare (0: rectangular caches).
--streaming-budget N: StreamingLLM with an N-token cache in the table too (e.g. the NAMM's mean cache).
--skip-full 1: no full-cache rows (to profile the other policies alone).
--random-model builds a deterministic random Llama (bench/random_model.h; GPT-2's tokenizer decodes it).
--threads sets the CPU thread budget (BLAS and our kernels' pool).
)";

int main(int argc, char** argv) {
  namm::bench::Options o;
  const std::optional<int> exit = namm::bench::ParseArgs(argc, argv, kUsage, [&](const std::string& key,
                                                                                const std::string& value) {
    if (key == "--model") o.model = value;
    else if (key == "--tokenizer") o.tokenizer = value;
    else if (key == "--namm") o.namm = value;
    else if (key == "--clients") o.clients = namm::bench::ParseCounts(value);
    else if (key == "--requests") o.requests = std::stoll(value);
    else if (key == "--prompt-tokens") o.prompt_tokens = std::stoll(value);
    else if (key == "--max-tokens") o.max_tokens = std::stoll(value);
    else if (key == "--max-running") o.max_running = std::stoll(value);
    else if (key == "--chunk") o.chunk = std::stoll(value);
    else if (key == "--update-interval") o.update_interval = std::stoll(value);
    else if (key == "--threads") o.threads = std::stoll(value);
    else if (key == "--context") o.context = std::stoll(value);
    else if (key == "--step-tokens") o.step_tokens = namm::bench::ParseCounts(value);
    else if (key == "--kv-budget") o.kv_budget = std::stoll(value);
    else if (key == "--kv-block-tokens") o.kv_block_tokens = namm::bench::ParseCounts(value);
    else if (key == "--streaming-budget") o.streaming_budget = std::stoll(value);
    else if (key == "--skip-full") o.skip_full = std::stoll(value) != 0;
    else if (key == "--namm-heads") {
      o.namm_heads.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) {
        if (item != "own" && item != "equal") throw std::invalid_argument("--namm-heads takes own and/or equal");
        o.namm_heads.push_back(item);
      }
    }
    else if (key == "--random-model") {
      o.random_model = value;
      o.tokenizer = std::string(NAMM_SHARED_DIR) + "/tokenizers/gpt2/tokenizer.json";
    }
    else return false;
    return true;
  });
  if (exit) return *exit;
  if (o.clients.empty()) return std::fprintf(stderr, "--clients needs at least one count\n"), 2;
  return namm::bench::Run(o);
}
