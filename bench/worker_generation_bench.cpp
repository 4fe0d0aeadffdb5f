// Generation cost of memory policies on one prompt, measured in one run so that ratios are comparable:
// full cache, the all-zero NAMM (keeps everything; frozen statistics), a NAMM that runs its whole pipeline
// but evicts nothing, an evicting NAMM, H2O and L2. Default: stories260K at 4x its context (static NTK,
// factor 4, alpha 2), a 2016-token prompt and 32 new tokens (2048 in all).
//
// Usage: worker_generation_bench [--model M] [--tokenizer T] [--prompt-tokens N] [--new-tokens N] [--repeats R]
//        [--dtype fp32|bf16] [--only TEXT]
// --only keeps the full cache (the ratios' base) and the rows whose name contains TEXT (e.g. to profile one).
//        worker_generation_bench --random-model layers=2,dim=2048,heads=16,kv_heads=4,ffn=7168,vocab=32000 [...]
// --random-model builds a deterministic random Llama of that shape (Gaussian weights, std 0.02, seed 1; plain
// RoPE, theta 500000, context = prompt + new tokens) and prompts it with seeded random token ids, so that the
// overhead is measured at Llama 3 8B's head size and GQA, where the paper measured it; its tokenizer is GPT-2's
// (../shared), used only to decode.
//
//        worker_generation_bench --chunk-memory 8192,32768 [--random-model ...]
// instead measures the transient memory of one prefill chunk (128 tokens) run through the model with N tokens
// already cached (random keys and values, the cache preallocated so that its growth is not counted): the peak
// resident memory above the start, for the full cache and for a NAMM (which observes the attention).
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "namm/policies/full_cache_policy.h"
#include "namm/policies/h2o_policy.h"
#include "namm/policies/l2_policy.h"
#include "namm/option_spec.h"
#include "namm/policies/namm_policy.h"
#include "namm/worker/generator.h"
#include "peak_memory.h"

namespace namm::worker {
namespace {

struct Options {
  std::string model = std::string(NAMM_SHARED_DIR) + "/models/stories260K/stories260K.bin";
  std::string tokenizer = std::string(NAMM_SHARED_DIR) + "/models/stories260K/tok512.bin";
  std::string random_model;  // "layers=2,dim=2048,...": a random model of that shape instead of --model
  int64_t prompt_tokens = 2016, new_tokens = 32, repeats = 5;
  std::vector<int64_t> chunk_memory;  // cached-token counts for --chunk-memory
  at::ScalarType dtype = at::kFloat;  // --dtype fp32|bf16 (--random-model only)
  int64_t threads = 0;                // --threads N: libtorch's intra-op threads (default: libtorch's)
  std::string only;                   // --only TEXT: the full cache and the rows whose name contains TEXT
};

// A deterministic random Llama of the shape `spec` names (see the usage above).
Result<LlamaModel> RandomModel(const std::string& spec, int64_t context, at::ScalarType dtype) {
  NAMM_ASSIGN_OR_RETURN(OptionSpec shape, parse_option_spec("random:" + spec));
  NAMM_RETURN_IF_ERROR(shape.CheckKeys({"layers", "dim", "heads", "kv_heads", "ffn", "vocab"}));
  LlamaConfig c;
  c.architecture = "random";
  NAMM_ASSIGN_OR_RETURN(c.n_layers, shape.GetInt("layers", 2));
  NAMM_ASSIGN_OR_RETURN(c.dim, shape.GetInt("dim", 2048));
  NAMM_ASSIGN_OR_RETURN(c.n_heads, shape.GetInt("heads", 16));
  NAMM_ASSIGN_OR_RETURN(c.n_kv_heads, shape.GetInt("kv_heads", 4));
  NAMM_ASSIGN_OR_RETURN(c.hidden_dim, shape.GetInt("ffn", 7168));
  NAMM_ASSIGN_OR_RETURN(c.vocab_size, shape.GetInt("vocab", 32000));
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  c.rope_theta = 500000;
  c.max_position_embeddings = context;
  NAMM_RETURN_IF_ERROR(c.Validate());
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  const auto gaussian = [&](std::vector<int64_t> shape_of) {
    return at::normal(0.0, 0.02, shape_of, generator, f32);
  };
  LlamaWeights w;
  w.token_embedding = gaussian({c.vocab_size, c.dim});
  for (int64_t l = 0; l < c.n_layers; ++l) {
    LlamaLayerWeights layer;
    layer.attention_norm = at::ones({c.dim}, f32);
    layer.wq = gaussian({c.n_heads * c.head_dim, c.dim});
    layer.wk = gaussian({c.n_kv_heads * c.head_dim, c.dim});
    layer.wv = gaussian({c.n_kv_heads * c.head_dim, c.dim});
    layer.wo = gaussian({c.dim, c.n_heads * c.head_dim});
    layer.ffn_norm = at::ones({c.dim}, f32);
    layer.w_gate = gaussian({c.hidden_dim, c.dim});
    layer.w_up = gaussian({c.hidden_dim, c.dim});
    layer.w_down = gaussian({c.dim, c.hidden_dim});
    w.layers.push_back(std::move(layer));
  }
  w.final_norm = at::ones({c.dim}, f32);
  w.lm_head = gaussian({c.vocab_size, c.dim});
  if (dtype != at::kFloat) {  // drawn in float32, so that every dtype runs the same model
    for (at::Tensor* t : {&w.token_embedding, &w.final_norm, &w.lm_head}) *t = t->to(dtype);
    for (LlamaLayerWeights& l : w.layers) {
      for (at::Tensor* t : {&l.attention_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down}) {
        *t = t->to(dtype);
      }
    }
  }
  return LlamaModel(LoadedModel{c, std::move(w)}, f32.dtype(dtype));
}

// Seeded random token ids in [0, vocab).
std::vector<int64_t> RandomPrompt(int64_t vocab, int64_t n) {
  uint64_t state = 0x2545F4914F6CDD1Dull;
  std::vector<int64_t> ids(static_cast<std::size_t>(n));
  for (int64_t& id : ids) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int64_t>((state >> 33) % static_cast<uint64_t>(vocab));
  }
  return ids;
}

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

// Peak memory of one 128-token chunk's forward pass over `cached` tokens already in every layer's cache.
Result<int64_t> ChunkPeakBytes(const LlamaModel& model, MemoryPolicy& policy, int64_t cached) {
  constexpr int64_t kChunk = 128;
  const LlamaConfig& c = model.config();
  std::vector<int64_t> prompt = RandomPrompt(c.vocab_size, cached + kChunk);
  NAMM_RETURN_IF_ERROR(policy.BeginSequence({prompt}));
  std::vector<LayerKVCache> caches = model.NewCaches(policy);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(2);
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  for (LayerKVCache& cache : caches) {
    cache.ExpectTokens(cached + kChunk, /*allocate_now=*/true);
    NAMM_RETURN_IF_ERROR(cache.Append(at::normal(0.0, 1.0, {c.n_kv_heads, cached, c.head_dim}, generator, f32),
                                      at::normal(0.0, 1.0, {c.n_kv_heads, cached, c.head_dim}, generator, f32),
                                      at::arange(cached, f32.dtype(at::kLong))));
    // A policy that computes earlier queries' attention again finds the queries a real prefill would have left.
    if (const int64_t h = policy.query_history(); h > 0) {
      NAMM_RETURN_IF_ERROR(cache.query_history().Record(at::normal(0.0, 1.0, {c.n_heads, h, c.head_dim}, generator, f32),
                                                        at::full({c.n_heads, h}, std::log(static_cast<double>(cached)), f32),
                                                        cached - h, 0, h));
    }
  }
  const at::Tensor chunk = at::tensor(std::vector<int64_t>(prompt.end() - kChunk, prompt.end()), f32.dtype(at::kLong));
  bench::PeakMemory memory;
  memory.Start();
  NAMM_ASSIGN_OR_RETURN(at::Tensor logits, model.Forward(chunk, caches, policy, /*all_logits=*/false));
  return memory.PeakAboveStartBytes();
}

int ChunkMemory(const Options& o, const LlamaModel& model) {
  NammModel m = Bam(0.15, 1e4f, NormStats());
  m.norm_state = NormState::kCollecting;
  std::printf("%s\nPeak resident memory above the start of one 128-token chunk's forward pass with N tokens cached\n\n",
              model.config().Describe().c_str());
  std::printf("%10s %18s %18s\n", "N cached", "full cache MiB", "NAMM MiB");
  for (int64_t n : o.chunk_memory) {
    FullCachePolicy full;
    auto namm = NammPolicy::Create(m);
    if (!namm.ok()) return 1;
    (*namm)->set_observe_from_query_history(true);
    Result<int64_t> full_peak = ChunkPeakBytes(model, full, n);
    Result<int64_t> namm_peak = ChunkPeakBytes(model, **namm, n);
    if (!full_peak.ok() || !namm_peak.ok()) {
      std::fprintf(stderr, "%s\n", (!full_peak.ok() ? full_peak.status() : namm_peak.status()).ToString().c_str());
      return 1;
    }
    std::printf("%10lld %18.1f %18.1f\n", static_cast<long long>(n), static_cast<double>(*full_peak) / (1 << 20),
                static_cast<double>(*namm_peak) / (1 << 20));
  }
  return 0;
}

int Run(const Options& o) {
  if (o.threads > 0) at::set_num_threads(static_cast<int>(o.threads));
  LoadOptions load;
  load.rope_scaling = RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0};
  int64_t context = o.prompt_tokens + o.new_tokens;
  for (int64_t n : o.chunk_memory) context = std::max(context, n + 128);
  load.dtype = o.dtype;
  auto model = o.random_model.empty() ? LlamaModel::Load(o.model, load) : RandomModel(o.random_model, context, o.dtype);
  auto tokenizer = load_tokenizer(o.tokenizer);
  if (!model.ok() || !tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", (!model.ok() ? model.status() : tokenizer.status()).ToString().c_str());
    return 1;
  }
  if (!o.chunk_memory.empty()) return ChunkMemory(o, *model);
  const std::vector<int64_t> prompt = o.random_model.empty() ? Prompt(**tokenizer, o.prompt_tokens)
                                                             : RandomPrompt(model->config().vocab_size, o.prompt_tokens);
  GenerationOptions options;
  options.max_new_tokens = o.new_tokens;
  Generator generator(*model, **tokenizer);

  // Normalization statistics as deployed NAMMs carry them: collected once by the all-zero NAMM, then frozen.
  NammModel collecting;
  collecting.params = initial_params(collecting.architecture);
  auto collector = NammPolicy::Create(collecting);
  if (!generator.Generate(prompt, **collector, options).ok()) return 1;
  const NormStats stats = (*collector)->normalizer().stats();

  // As the worker runs it (from the query history), or with the per-token sample ring.
  auto namm = [&](NammModel m, bool from_history = true) {
    return [m, from_history] {
      std::unique_ptr<NammPolicy> policy = std::move(NammPolicy::Create(m)).value();
      policy->set_observe_from_query_history(from_history);
      return std::unique_ptr<MemoryPolicy>(std::move(policy));
    };
  };
  std::vector<Row> rows = {
      {"full cache", [] { return std::unique_ptr<MemoryPolicy>(new FullCachePolicy()); }, {}, {}, {}, {}},
      {"NAMM, zero parameters", namm(Bam(0.0, 0.0f, stats)), {}, {}, {}, {}},
      {"NAMM, full pipeline, no eviction", namm(Bam(0.15, 1e4f, stats)), {}, {}, {}, {}},
      {"  same, per-token sample ring", namm(Bam(0.15, 1e4f, stats), false), {}, {}, {}, {}},
      {"NAMM, evicting", namm(Bam(0.15, 0.0f, stats)), {}, {}, {}, {}},
      {"H2O budget 512", [] { return std::unique_ptr<MemoryPolicy>(std::move(H2OPolicy::Create(CacheBudget::Tokens(512).value(), 256)).value()); }, {}, {}, {}, {}},
      {"L2 budget 512", [] { return std::unique_ptr<MemoryPolicy>(std::move(L2Policy::Create(CacheBudget::Tokens(512).value())).value()); }, {}, {}, {}, {}},
  };
  if (!o.only.empty()) {
    rows.erase(std::remove_if(rows.begin() + 1, rows.end(),
                              [&](const Row& row) { return row.name.find(o.only) == std::string::npos; }),
               rows.end());
  }
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
  std::printf("%-34s %9s %9s %9s %8s %11s %10s %11s %10s %12s %9s\n", "policy", "prefill s", "decode s", "total s",
              "vs full", "prefill t/s", "decode t/s", "final cache", "rel. cache", "peak KV MiB", "state/KV");
  for (const auto& row : rows) {
    double cache = 0;
    for (int64_t size : row.last.final_cache_sizes) cache += static_cast<double>(size);
    cache /= static_cast<double>(row.last.final_cache_sizes.size());
    const double prefill = Median(row.prefill), decode = Median(row.decode), total = Median(row.total);
    // Relative cache: the mean over queries of the cached tokens each attended to, against the full cache's.
    // state/KV: the policy's state (per-token state and query history) over the KV cache, at the KV peak.
    std::printf("%-34s %9.3f %9.3f %9.3f %7.2fx %11.0f %10.0f %11.0f %10.3f %12.2f %8.1f%%\n", row.name.c_str(), prefill,
                decode, total, total / base, static_cast<double>(o.prompt_tokens) / prefill,
                static_cast<double>(row.last.decode_steps) / decode, cache,
                row.last.mean_kv_tokens / rows[0].last.mean_kv_tokens,
                static_cast<double>(row.last.peak_kv_bytes) / (1 << 20),
                100.0 * static_cast<double>(row.last.peak_policy_state_bytes) / static_cast<double>(row.last.peak_kv_bytes));
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
    else if (key == "--dtype") {
      if (value != "fp32" && value != "bf16") {
        std::fprintf(stderr, "--dtype takes fp32 or bf16, got %s\n", value.c_str());
        return 2;
      }
      o.dtype = value == "bf16" ? at::kBFloat16 : at::kFloat;
    }
    else if (key == "--only") o.only = value;
    else if (key == "--threads") o.threads = std::stoll(value);
    else if (key == "--chunk-memory") {
      for (std::size_t begin = 0; begin < value.size();) {
        const std::size_t end = std::min(value.find(',', begin), value.size());
        o.chunk_memory.push_back(std::stoll(value.substr(begin, end - begin)));
        begin = end + 1;
      }
    }
    else if (key == "--random-model") {
      o.random_model = value;
      o.tokenizer = std::string(NAMM_SHARED_DIR) + "/tokenizers/gpt2/tokenizer.json";
    }
    else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      return 2;
    }
  }
  return namm::worker::Run(o);
}
