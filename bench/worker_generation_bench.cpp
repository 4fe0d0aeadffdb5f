// Generation cost of memory policies on one prompt, measured in one run so that ratios are comparable:
// full cache, the all-zero NAMM (keeps everything; frozen statistics), a NAMM that runs its whole pipeline
// but evicts nothing, an evicting NAMM, H2O and L2. Default: stories260K at 4x its context (static NTK,
// factor 4, alpha 2), a 2016-token prompt and 32 new tokens (2048 in all).
//
// Usage: worker_generation_bench [--model M] [--tokenizer T] [--prompt-tokens N] [--new-tokens N] [--repeats R]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "namm/policies/full_cache_policy.h"
#include "namm/policies/h2o_policy.h"
#include "namm/policies/l2_policy.h"
#include "namm/policies/namm_policy.h"
#include "namm/worker/generator.h"

namespace namm::worker {
namespace {

struct Options {
  std::string model = std::string(NAMM_SHARED_DIR) + "/models/stories260K/stories260K.bin";
  std::string tokenizer = std::string(NAMM_SHARED_DIR) + "/models/stories260K/tok512.bin";
  int64_t prompt_tokens = 2016, new_tokens = 32, repeats = 5;
};

std::vector<int64_t> Prompt(const Tokenizer& tokenizer, int64_t n) {
  std::string text;
  while (static_cast<int64_t>(tokenizer.Encode(text).size()) < n) {
    text += "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ";
    text += "One day, she saw a big, red ball and a dog named Max. They played until the sun went down. ";
  }
  std::vector<int64_t> ids = tokenizer.EncodeForModel(text);
  ids.resize(static_cast<std::size_t>(n));
  return ids;
}

// A BAM NAMM with deterministic pseudo-random parameters of the given scale.
NammModel Bam(double scale, float output_bias, const NormStats& stats) {
  NammModel model;
  model.params = initial_params(model.architecture);
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (float& p : model.params) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    p = static_cast<float>(scale * ((static_cast<double>(state >> 11) * 0x1.0p-53) * 2.0 - 1.0) * 1.7320508);
  }
  model.params.back() = output_bias;
  model.norm_state = NormState::kFrozen;
  model.norm_stats = stats;
  return model;
}

struct Row {
  std::string name;
  std::function<std::unique_ptr<MemoryPolicy>()> make;
  std::vector<double> prefill, decode, total;
  GenerationResult last;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run(const Options& o) {
  LoadOptions load;
  load.rope_scaling = RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0};
  auto model = LlamaModel::Load(o.model, load);
  auto tokenizer = load_tokenizer(o.tokenizer);
  if (!model.ok() || !tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", (!model.ok() ? model.status() : tokenizer.status()).ToString().c_str());
    return 1;
  }
  const std::vector<int64_t> prompt = Prompt(**tokenizer, o.prompt_tokens);
  GenerationOptions options;
  options.max_new_tokens = o.new_tokens;
  Generator generator(*model, **tokenizer);

  // Normalization statistics as deployed NAMMs carry them: collected once by the all-zero NAMM, then frozen.
  NammModel collecting;
  collecting.params = initial_params(collecting.architecture);
  auto collector = NammPolicy::Create(collecting);
  if (!generator.Generate(prompt, **collector, options).ok()) return 1;
  const NormStats stats = (*collector)->normalizer().stats();

  auto namm = [&](NammModel m) {
    return [m] { return std::unique_ptr<MemoryPolicy>(std::move(NammPolicy::Create(m)).value()); };
  };
  std::vector<Row> rows = {
      {"full cache", [] { return std::unique_ptr<MemoryPolicy>(new FullCachePolicy()); }, {}, {}, {}, {}},
      {"NAMM, zero parameters", namm(Bam(0.0, 0.0f, stats)), {}, {}, {}, {}},
      {"NAMM, full pipeline, no eviction", namm(Bam(0.15, 1e4f, stats)), {}, {}, {}, {}},
      {"NAMM, evicting", namm(Bam(0.15, 0.0f, stats)), {}, {}, {}, {}},
      {"H2O budget 512", [] { return std::unique_ptr<MemoryPolicy>(std::move(H2OPolicy::Create(CacheBudget::Tokens(512).value(), 256)).value()); }, {}, {}, {}, {}},
      {"L2 budget 512", [] { return std::unique_ptr<MemoryPolicy>(std::move(L2Policy::Create(CacheBudget::Tokens(512).value())).value()); }, {}, {}, {}, {}},
  };
  for (int64_t r = 0; r < o.repeats + 1; ++r) {  // round robin; the first round warms up
    for (auto& row : rows) {
      auto policy = row.make();
      const auto start = std::chrono::steady_clock::now();
      auto result = generator.Generate(prompt, *policy, options);
      const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!result.ok()) {
        std::fprintf(stderr, "%s: %s\n", row.name.c_str(), result.status().ToString().c_str());
        return 1;
      }
      if (r == 0) continue;
      row.prefill.push_back(result->prefill_seconds);
      row.decode.push_back(result->decode_seconds);
      row.total.push_back(total);
      row.last = std::move(result).value();
    }
  }
  const double base = Median(rows[0].total);
  std::printf("%s\nprompt %lld tokens + %lld new, %lld repeats (medians), one process\n\n",
              model->config().Describe().c_str(), static_cast<long long>(o.prompt_tokens),
              static_cast<long long>(o.new_tokens), static_cast<long long>(o.repeats));
  std::printf("%-34s %9s %9s %9s %8s %11s %10s %11s %12s\n", "policy", "prefill s", "decode s", "total s", "vs full",
              "prefill t/s", "decode t/s", "final cache", "peak KV MiB");
  for (const auto& row : rows) {
    double cache = 0;
    for (int64_t size : row.last.final_cache_sizes) cache += static_cast<double>(size);
    cache /= static_cast<double>(row.last.final_cache_sizes.size());
    const double prefill = Median(row.prefill), decode = Median(row.decode), total = Median(row.total);
    std::printf("%-34s %9.3f %9.3f %9.3f %7.2fx %11.0f %10.0f %11.0f %12.2f\n", row.name.c_str(), prefill, decode, total,
                total / base, static_cast<double>(o.prompt_tokens) / prefill,
                static_cast<double>(row.last.decode_steps) / decode, cache,
                static_cast<double>(row.last.peak_kv_bytes) / (1 << 20));
  }
  return 0;
}

}  // namespace
}  // namespace namm::worker

int main(int argc, char** argv) {
  namm::worker::Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--model") o.model = value;
    else if (key == "--tokenizer") o.tokenizer = value;
    else if (key == "--prompt-tokens") o.prompt_tokens = std::stoll(value);
    else if (key == "--new-tokens") o.new_tokens = std::stoll(value);
    else if (key == "--repeats") o.repeats = std::stoll(value);
    else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      return 2;
    }
  }
  return namm::worker::Run(o);
}
