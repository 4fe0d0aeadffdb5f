// Evaluations per second of the batched engine at several batch sizes, measured in one run, in the training
// case: a generation's candidates (one NAMM each: the given NAMM's parameters plus a seeded perturbation) on the
// same prompts, batched B at a time on each prompt, each scored by the likelihood of its row's continuation
// under teacher forcing (the interruption task's metric and settings: chunks of 32, a memory update every 64
// tokens). Checks that every (candidate, prompt) scores the same bits at every batch size. Each row also prints
// its FLOP rate and that rate's share of a matrix-product peak measured in the same run on the same threads
// (bench/roofline.h). Options: kUsage below (--help).
#include <ATen/ops/log_softmax.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "namm/cpu_threads.h"
#include "namm/namm_file.h"
#include "namm/policies/namm_policy.h"
#include "namm/worker/generator.h"
#include "bench_args.h"
#include "random_model.h"
#include "roofline.h"

namespace namm::worker {
namespace {

struct Options {
  std::string model = std::string(NAMM_SHARED_DIR) + "/models/stories260K/stories260K.bin";
  std::string tokenizer = std::string(NAMM_SHARED_DIR) + "/models/stories260K/tok512.bin";
  std::string rows, namm, random_model;
  int64_t prompt_tokens = 362, continuation_tokens = 48;  // of the random rows
  int64_t new_tokens = 0;                                  // > 0: greedy decoding instead of teacher forcing
  std::vector<int64_t> batches = {1, 2, 4, 8, 16};
  int64_t prompts = 8, candidates = 16, chunk = 32, update_interval = 64, threads = 1;
};

struct Row {
  std::vector<int64_t> prompt, continuation;
};

std::vector<int64_t> Ids(const nlohmann::json& a) { return a.get<std::vector<int64_t>>(); }

double Likelihood(const at::Tensor& logits, const std::vector<int64_t>& continuation) {
  const auto n = static_cast<int64_t>(continuation.size());
  const at::Tensor log_probs = at::log_softmax(logits.to(at::kDouble), -1);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += log_probs[i][continuation[static_cast<std::size_t>(i)]].item<double>();
  return std::exp(sum / static_cast<double>(n));
}

int Run(const Options& o) {
  set_cpu_threads(static_cast<int>(o.threads));
  auto model = o.random_model.empty()
                   ? LlamaModel::Load(o.model, LoadOptions{})
                   : bench::RandomModel(o.random_model, o.prompt_tokens + std::max(o.continuation_tokens, o.new_tokens), at::kFloat,
                                        at::kCPU);
  auto tokenizer = load_tokenizer(o.tokenizer);
  if (!model.ok() || !tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", (!model.ok() ? model.status() : tokenizer.status()).ToString().c_str());
    return 1;
  }
  std::vector<Row> rows;
  if (o.rows.empty()) {
    std::mt19937_64 random(7);
    std::uniform_int_distribution<int64_t> token(3, model->config().vocab_size - 1);
    for (int64_t r = 0; r < o.prompts; ++r) {
      Row row{{1}, {}};
      while (static_cast<int64_t>(row.prompt.size()) < o.prompt_tokens) row.prompt.push_back(token(random));
      while (static_cast<int64_t>(row.continuation.size()) < o.continuation_tokens) {
        row.continuation.push_back(token(random));
      }
      rows.push_back(std::move(row));
    }
  }
  std::ifstream in(o.rows);
  for (std::string line; !o.rows.empty() && std::getline(in, line) && static_cast<int64_t>(rows.size()) < o.prompts;) {
    const auto j = nlohmann::json::parse(line);
    rows.push_back({Ids(j.at("prompt_ids")), Ids(j.at("continuation_ids"))});
  }
  if (rows.empty()) {
    std::fprintf(stderr, "no rows in %s\n", o.rows.c_str());
    return 1;
  }
  NammModel base;
  if (!o.namm.empty()) {
    auto read = read_namm_file(o.namm);
    if (!read.ok()) {
      std::fprintf(stderr, "%s\n", read.status().ToString().c_str());
      return 1;
    }
    base = std::move(read).value();
  } else {
    base.params = initial_params(base.architecture);
  }
  std::vector<NammModel> candidates(static_cast<std::size_t>(o.candidates), base);
  for (std::size_t c = 0; c < candidates.size(); ++c) {
    std::mt19937_64 random(1234 + c);
    std::normal_distribution<double> normal(0.0, 0.05);
    for (float& p : candidates[c].params) p += static_cast<float>(normal(random));
  }

  const Generator generator(*model, **tokenizer);
  std::map<int64_t, double> seconds, flops;
  std::map<int64_t, std::vector<double>> scores;
  const int64_t namm_hidden = base.architecture.scorer.kind == ScorerKind::kBam ? base.architecture.scorer.hidden : 0;
  for (int64_t batch : o.batches) {
    const auto start = std::chrono::steady_clock::now();
    for (const Row& row : rows) {
      for (std::size_t first = 0; first < candidates.size(); first += static_cast<std::size_t>(batch)) {
        const std::size_t end = std::min(candidates.size(), first + static_cast<std::size_t>(batch));
        std::vector<std::unique_ptr<NammPolicy>> policies;
        std::vector<Generator::Request> requests;
        for (std::size_t c = first; c < end; ++c) {
          auto policy = NammPolicy::Create(candidates[c]);
          if (!policy.ok()) {
            std::fprintf(stderr, "%s\n", policy.status().ToString().c_str());
            return 1;
          }
          (*policy)->set_observe_from_query_history(true);
          policies.push_back(std::move(policy).value());
          Generator::Request request;
          request.prompt_ids = row.prompt;
          request.policy = policies.back().get();
          request.options.max_new_tokens = o.new_tokens;
          request.options.chunk_size = o.chunk;
          request.options.memory_update_interval = o.update_interval;
          request.options.teacher_forcing = o.new_tokens == 0;
          if (o.new_tokens == 0) {
            request.options.forced_tokens.assign(row.continuation.begin(), row.continuation.end() - 1);
          }
          requests.push_back(std::move(request));
        }
        for (auto& result : generator.GenerateBatch(requests)) {
          if (!result.ok()) {
            std::fprintf(stderr, "%s\n", result.status().ToString().c_str());
            return 1;
          }
          flops[batch] += bench::GenerationFlops(model->config(), *result, result->decode_steps + 1, namm_hidden);
          if (o.new_tokens == 0) {
            scores[batch].push_back(Likelihood(result->forced_logits, row.continuation));
          } else {
            scores[batch].insert(scores[batch].end(), result->token_ids.begin(), result->token_ids.end());
          }
        }
      }
    }
    seconds[batch] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const double evaluations = static_cast<double>(rows.size() * candidates.size());
  const double base_rate = evaluations / seconds[o.batches.front()];
  const bench::MatmulPeak peak = bench::MeasureMatmulPeak();
  std::printf("%zu prompts x %zu candidates, %s, %d threads; matrix-product peak %.1f GFLOP/s (%s, measured now on "
              "these threads)\n| batch | evaluations/s | vs batch %lld | GFLOP/s | of peak | scores as at batch %lld |\n"
              "|---:|---:|---:|---:|---:|---|\n",
              rows.size(), candidates.size(), model->config().Describe().c_str(), cpu_threads(), peak.gflops,
              peak.source.c_str(), static_cast<long long>(o.batches.front()), static_cast<long long>(o.batches.front()));
  bool identical = true;
  for (int64_t batch : o.batches) {
    const bool same = scores[batch] == scores[o.batches.front()];
    identical = identical && same;
    std::printf("| %lld | %.3g | %.2fx | %s | %s |\n", static_cast<long long>(batch), evaluations / seconds[batch],
                evaluations / seconds[batch] / base_rate, bench::RooflineCells(flops[batch], seconds[batch], peak).c_str(),
                same ? "identical" : "DIFFERENT");
  }
  return identical ? 0 : 1;
}

}  // namespace
}  // namespace namm::worker

constexpr const char* kUsage = R"(Usage: batch_throughput_bench [--rows FILE.jsonl] [--namm FILE.safetensors] [--model M] [--tokenizer T]
       [--batches 1,2,4,8,16] [--prompts 8] [--candidates 16] [--chunk 32] [--update-interval 64] [--threads 1]
       [--random-model layers=2,dim=4096,...] [--prompt-tokens 362] [--continuation-tokens 48] [--new-tokens 0]
--threads sets the CPU thread budget: BLAS's and our kernels' pool alike (default 1, as
`namm-coordinator run` gives each of 2 local workers on 2 cores).
Rows are token-id rows ({"prompt_ids": [...], "continuation_ids": [...]}), e.g. `namm-worker build-synthetic
--family interruption`; without --rows, seeded random tokens of the interruption rows' shape (362 prompt and
48 continuation tokens, or --prompt-tokens and --continuation-tokens). Without --namm the candidates perturb
the zero NAMM. --random-model builds a deterministic random Llama of that shape (bench/random_model.h) instead of
--model, e.g. Llama 3 8B's layers: layers=2,dim=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000 (its tokenizer
is GPT-2's, used only to decode). --new-tokens N instead decodes N greedy tokens after each prompt (a generative
task's evaluation: batched decoding reads each weight once for the batch), compared token for token.
)";

int main(int argc, char** argv) {
  namm::worker::Options o;
  const std::optional<int> exit = namm::bench::ParseArgs(argc, argv, kUsage, [&](const std::string& key,
                                                                                const std::string& value) {
    if (key == "--model") o.model = value;
    else if (key == "--tokenizer") o.tokenizer = value;
    else if (key == "--rows") o.rows = value;
    else if (key == "--namm") o.namm = value;
    else if (key == "--batches") o.batches = namm::bench::ParseCounts(value);
    else if (key == "--prompts") o.prompts = std::stoll(value);
    else if (key == "--candidates") o.candidates = std::stoll(value);
    else if (key == "--chunk") o.chunk = std::stoll(value);
    else if (key == "--update-interval") o.update_interval = std::stoll(value);
    else if (key == "--threads") o.threads = std::stoll(value);
    else if (key == "--random-model") {
      o.random_model = value;
      o.tokenizer = std::string(NAMM_SHARED_DIR) + "/tokenizers/gpt2/tokenizer.json";
    }
    else if (key == "--new-tokens") o.new_tokens = std::stoll(value);
    else if (key == "--prompt-tokens") o.prompt_tokens = std::stoll(value);
    else if (key == "--continuation-tokens") o.continuation_tokens = std::stoll(value);
    else return false;
    return true;
  });
  if (exit) return *exit;
  if (o.batches.empty()) {
    std::fprintf(stderr, "--batches needs at least one size\n");
    return 2;
  }
  if (std::set<int64_t>(o.batches.begin(), o.batches.end()).size() != o.batches.size()) {
    std::fprintf(stderr, "--batches lists a size twice (each size is one row of the table)\n");
    return 2;
  }
  return namm::worker::Run(o);
}
