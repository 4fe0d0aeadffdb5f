// Generation cost of memory policies on one prompt, measured in one run so that ratios are comparable:
// full cache, the all-zero NAMM (keeps everything; frozen statistics), a NAMM that runs its whole pipeline
// but evicts nothing, an evicting NAMM, H2O and L2. Default: stories260K at 4x its context (static NTK,
// factor 4, alpha 2), a 2016-token prompt and 32 new tokens (2048 in all). Every row also prints its FLOP
// rate and that rate's share of a matrix-product peak measured in the same run (bench/roofline.h).
// On a CUDA device every timed generation ends with the host reading its last token (a device synchronization),
// so totals are wall-clock times of finished work. Options: kUsage below (--help).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/record_function.h>

#include "namm/cpu_threads.h"
#include "namm/bam_scorer.h"
#include "namm/policies/full_cache_policy.h"
#include "namm/policies/h2o_policy.h"
#include "namm/policies/l2_policy.h"
#include "namm/policies/namm_policy.h"
#include "namm/stft_features.h"
#include "namm/worker/generator.h"
#include "bench_args.h"
#include "peak_memory.h"
#include "random_model.h"
#include "roofline.h"

namespace namm::worker {
namespace {

struct Options {
  std::string model = std::string(NAMM_SHARED_DIR) + "/models/stories260K/stories260K.bin";
  std::string tokenizer = std::string(NAMM_SHARED_DIR) + "/models/stories260K/tok512.bin";
  std::string random_model;  // "layers=2,dim=2048,...": a random model of that shape instead of --model
  int64_t prompt_tokens = 2016, new_tokens = 32, repeats = 5, chunk = 128;
  std::vector<int64_t> chunk_memory;  // cached-token counts for --chunk-memory
  at::ScalarType dtype = at::kFloat;  // --dtype fp32|bf16|fp16
  at::Device device = at::kCPU;       // --device cpu|cuda:N
  int64_t threads = 0;                // --threads N: the CPU thread budget (default: one per core)
  std::string only;                   // --only TEXT: the full cache and the rows whose name contains TEXT ("A|B": either)
  bool profile = false;               // --profile: where each row's time goes
  std::vector<int64_t> parts;         // --parts N1,N2: the NAMM's parts at those cache sizes
};

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Waits for the work queued on `t`'s device (a one-element copy to the host); nothing to wait for on the CPU.
void WaitFor(const at::Tensor& t) {
  if (t.defined() && !t.device().is_cpu()) (void)t.reshape({-1}).narrow(0, 0, 1).to(at::kCPU);
}

// ATen operators dispatched since the process began counting (OperatorCount): each costs the host microseconds
// and, on a GPU, usually a kernel launch.
std::atomic<int64_t> operators_dispatched{0};
// Top-level operators (those our code calls, not those they call in turn) by name, while a profile runs.
thread_local int operator_depth = 0;
std::mutex top_level_mutex;
std::map<std::string, int64_t> top_level_operators;
std::unique_ptr<at::ObserverContext> CountOperator(const at::RecordFunction& fn) {
  operators_dispatched.fetch_add(1, std::memory_order_relaxed);
  if (operator_depth++ == 0) {
    std::lock_guard<std::mutex> lock(top_level_mutex);
    ++top_level_operators[fn.name()];
  }
  return nullptr;
}
void EndOperator(const at::RecordFunction&, at::ObserverContext*) { --operator_depth; }

// Counts the operators dispatched while it lives.
class OperatorCount {
 public:
  OperatorCount()
      : handle_(at::addGlobalCallback(
            at::RecordFunctionCallback(CountOperator, EndOperator).scopes({at::RecordScope::FUNCTION}))) {}
  ~OperatorCount() { at::removeCallback(handle_); }
  OperatorCount(const OperatorCount&) = delete;
  OperatorCount& operator=(const OperatorCount&) = delete;

 private:
  at::CallbackHandle handle_;
};

// A policy that times the calls of the one it wraps: the device's queued work is waited for before each call
// (so that the engine's work is not counted) and after it. It also counts the calls and the operators they
// dispatch.
class TimedPolicy final : public MemoryPolicy {
 public:
  explicit TimedPolicy(std::unique_ptr<MemoryPolicy> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  std::vector<TokenStateSpec> token_state() const override { return inner_->token_state(); }
  bool needs_attention() const override { return inner_->needs_attention(); }
  int64_t query_history() const override { return inner_->query_history(); }
  bool may_evict() const override { return inner_->may_evict(); }
  Status BeginSequence(const SequenceInfo& info) override { return inner_->BeginSequence(info); }
  Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache) override {
    WaitFor(attention);
    const auto start = Clock::now();
    const int64_t operators = operators_dispatched.load();
    Status status = inner_->Observe(layer, attention, first_query, cache);
    observe_operators += operators_dispatched.load() - operators;
    ++observe_calls;
    WaitFor(cache.positions());
    observe_seconds += Since(start);
    return status;
  }
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override {
    WaitFor(cache.positions());
    const auto start = Clock::now();
    const int64_t operators = operators_dispatched.load();
    Result<at::Tensor> keep = inner_->Select(layer, cache);
    select_operators += operators_dispatched.load() - operators;
    ++select_calls;
    if (keep.ok()) WaitFor(*keep);
    select_seconds += Since(start);
    return keep;
  }
  // The inner policy's own SelectTogether (it may select a sequence's layers together), timed as a whole; with
  // other policies among the updates (not in this bench), each one's Select().
  std::vector<Result<at::Tensor>> SelectTogether(const std::vector<MemoryUpdate>& updates) override {
    std::vector<MemoryUpdate> inner = updates;
    for (MemoryUpdate& u : inner) {
      if (u.policy != this) return MemoryPolicy::SelectTogether(updates);
      u.policy = inner_.get();
      WaitFor(u.cache->positions());
    }
    const auto start = Clock::now();
    const int64_t operators = operators_dispatched.load();
    std::vector<Result<at::Tensor>> kept = inner_->SelectTogether(inner);
    select_operators += operators_dispatched.load() - operators;
    select_calls += static_cast<int64_t>(updates.size());
    for (const Result<at::Tensor>& keep : kept) {
      if (keep.ok()) WaitFor(*keep);
    }
    select_seconds += Since(start);
    return kept;
  }
  Result<std::optional<at::Tensor>> EndPrefill(int layer, LayerKVCache& cache) override {
    return inner_->EndPrefill(layer, cache);
  }
  double observe_seconds = 0, select_seconds = 0;
  int64_t observe_calls = 0, select_calls = 0, observe_operators = 0, select_operators = 0;

 private:
  std::unique_ptr<MemoryPolicy> inner_;
};

std::vector<int64_t> Prompt(const Tokenizer& tokenizer, int64_t n) {
  std::string text;
  while (static_cast<int64_t>(tokenizer.Encode(text).value().size()) < n) {
    text += "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ";
    text += "One day, she saw a big, red ball and a dog named Max. They played until the sun went down. ";
  }
  std::vector<int64_t> ids = tokenizer.EncodeForModel(text).value();
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

// The full cache with the attention computed as for a policy that observes it (probabilities in blocks; the
// observation ignored): on a GPU, the fused attention's counterpart in the same process.
class FullCacheInBlocks final : public MemoryPolicy {
 public:
  std::string name() const override { return "full, attention in blocks"; }
  bool needs_attention() const override { return true; }
  bool may_evict() const override { return false; }
  Status Observe(int, const at::Tensor&, int64_t, LayerKVCache&) override { return Status::Ok(); }
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override { return full_.Select(layer, cache); }

 private:
  FullCachePolicy full_;
};

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
  std::vector<int64_t> prompt = bench::RandomPrompt(c.vocab_size, cached + kChunk);
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

// Median seconds of `repeats` calls of fn after a warm-up, each waited for on `on`'s device.
template <typename Fn>
double MedianSeconds(int64_t repeats, const at::Tensor& on, Fn fn) {
  fn();
  std::vector<double> seconds;
  for (int64_t r = 0; r < repeats; ++r) {
    WaitFor(on);
    const auto start = Clock::now();
    fn();
    WaitFor(on);
    seconds.push_back(Since(start));
  }
  return Median(seconds);
}

// The NAMM's parts on the device at each cache size (8B shape: 16 query heads over 4 KV heads).
int Parts(const Options& o) {
  constexpr int64_t kQHeads = 16, kKvHeads = 4, kRows = 128;
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(o.device);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto random = [&](std::vector<int64_t> shape) {
    return at::normal(0.0, 1.0, shape, generator, f32.device(at::kCPU)).to(f32);
  };
  NormStats stats;
  stats.var.fill(1.0);
  auto policy = NammPolicy::Create(Bam(0.15, 0.0f, stats), o.device);
  if (!policy.ok()) return 1;
  std::printf("The NAMM's parts on %s, %lld KV heads (%lld query heads), medians of %lld, ms\n\n",
              o.device.str().c_str(), static_cast<long long>(kKvHeads), static_cast<long long>(kQHeads),
              static_cast<long long>(o.repeats));
  std::printf("%10s %18s %18s %14s %16s\n", "n cached", "GQA mean (chunk)", "frame fold (8)", "BAM attention",
              "Select (update)");
  for (int64_t n : o.parts) {
    n = (n + kStftHop - 1) / kStftHop * kStftHop;
    const at::Tensor attention = random({kQHeads, kRows, n}).abs_().div_(static_cast<double>(n));
    const at::Tensor mean = at::empty({kKvHeads, kRows, n}, f32);
    const double gqa = MedianSeconds(o.repeats, mean, [&] { gqa_mean_into(attention, AttentionPrecision::kF32, mean); });
    const at::Tensor samples = random({kKvHeads, kRows + kStftHop, n}).abs_().div_(static_cast<double>(n));
    const at::Tensor ema = random({kKvHeads, n, kStftBins}).abs_();
    const double fold = MedianSeconds(o.repeats, ema, [&] { fold_frames(samples, ema); });
    const at::Tensor q = random({kKvHeads, n, 32}), k = random({kKvHeads, n, 32}), v = random({kKvHeads, n, 32});
    const double bam = MedianSeconds(o.repeats, q, [&] { (void)backward_masked_attention(q, k, v, 0.17); });
    LayerKVCache cache(kKvHeads, 0, f32, (*policy)->token_state());
    if (!cache.Append(at::Tensor(), at::Tensor(), at::arange(n, f32.dtype(at::kLong))).ok()) return 1;
    cache.state("namm.ema").copy_(ema);
    bool selected = true;
    const double select = MedianSeconds(o.repeats, q, [&] { selected = selected && (*policy)->Select(0, cache).ok(); });
    if (!selected) return 1;
    std::printf("%10lld %18.3f %18.3f %14.3f %16.3f\n", static_cast<long long>(n), 1e3 * gqa, 1e3 * fold, 1e3 * bam,
                1e3 * select);
  }
  return 0;
}

int Run(const Options& o) {
  set_cpu_threads(o.threads > 0 ? static_cast<int>(o.threads) : cpu_threads());
  if (!o.parts.empty()) return Parts(o);  // needs no model
  LoadOptions load;
  load.rope_scaling = RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0};
  int64_t context = o.prompt_tokens + o.new_tokens;
  for (int64_t n : o.chunk_memory) context = std::max(context, n + 128);
  load.dtype = o.dtype;
  load.device = o.device;
  if (!o.chunk_memory.empty() && !o.device.is_cpu()) {
    std::fprintf(stderr, "--chunk-memory measures host memory: run it with --device cpu\n");
    return 2;
  }
  auto model = o.random_model.empty() ? LlamaModel::Load(o.model, load)
                                      : bench::RandomModel(o.random_model, context, o.dtype, o.device);
  auto tokenizer = load_tokenizer(o.tokenizer);
  if (!model.ok() || !tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", (!model.ok() ? model.status() : tokenizer.status()).ToString().c_str());
    return 1;
  }
  if (!o.chunk_memory.empty()) return ChunkMemory(o, *model);
  const std::vector<int64_t> prompt = o.random_model.empty() ? Prompt(**tokenizer, o.prompt_tokens)
                                                             : bench::RandomPrompt(model->config().vocab_size, o.prompt_tokens);
  GenerationOptions options;
  options.max_new_tokens = o.new_tokens;
  options.chunk_size = o.chunk;
  Generator generator(*model, **tokenizer);

  // Normalization statistics as deployed NAMMs carry them: collected once by the all-zero NAMM, then frozen.
  NammModel collecting;
  collecting.params = initial_params(collecting.architecture);
  auto collector = NammPolicy::Create(collecting, o.device);
  if (const auto collected = generator.Generate(prompt, **collector, options); !collected.ok()) {
    std::fprintf(stderr, "%s\n", collected.status().ToString().c_str());
    return 1;
  }
  const NormStats stats = (*collector)->normalizer().stats();

  // As the worker runs it (from the query history), or with the per-token sample ring.
  auto namm = [&](NammModel m, bool from_history = true) {
    return [m, from_history, device = o.device] {
      std::unique_ptr<NammPolicy> policy = std::move(NammPolicy::Create(m, device)).value();
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
  if (!o.device.is_cpu()) {  // where the full cache's attention may take libtorch's fused kernel
    rows.push_back({"full cache, attention in blocks", [] { return std::unique_ptr<MemoryPolicy>(new FullCacheInBlocks()); },
                    {}, {}, {}, {}});
  }
  if (!o.only.empty()) {
    rows.erase(std::remove_if(rows.begin() + 1, rows.end(),
                              [&](const Row& row) {
                                for (std::size_t from = 0; from <= o.only.size();) {  // "A|B": A or B
                                  const std::size_t bar = std::min(o.only.find('|', from), o.only.size());
                                  if (row.name.find(o.only.substr(from, bar - from)) != std::string::npos) return false;
                                  from = bar + 1;
                                }
                                return true;
                              }),
               rows.end());
  }
  for (int64_t r = 0; r < o.repeats + 1; ++r) {  // round robin; the first round warms up
    for (auto& row : rows) {
      auto policy = row.make();
      const auto start = Clock::now();
      auto result = generator.Generate(prompt, *policy, options);
      const double total = Since(start);
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
  const bench::MatmulPeak peak = bench::MeasureMatmulPeak(o.device, o.dtype);
  const char* observe_path = o.device.is_cpu()                  ? "CPU kernels"
                             : observe_kernels_run_on(o.device) ? "our CUDA kernels"
                                                                : "libtorch operators";
  std::printf("%s\nprompt %lld tokens + %lld new, prefill chunks of %lld, %lld repeats (medians), one process, %s %s, "
              "the NAMM's observe path on %s\n\n",
              model->config().Describe().c_str(), static_cast<long long>(o.prompt_tokens),
              static_cast<long long>(o.new_tokens), static_cast<long long>(o.chunk), static_cast<long long>(o.repeats),
              o.device.str().c_str(), c10::toString(o.dtype), observe_path);
  std::printf("FLOP rates against a matrix-product peak of %.1f GFLOP/s (%s, measured now on these threads)\n\n",
              peak.gflops, peak.source.c_str());
  std::printf("%-34s %9s %9s %9s %8s %11s %10s %11s %10s %12s %9s %12s %8s\n", "policy", "prefill s", "decode s",
              "total s", "vs full", "prefill t/s", "decode t/s", "final cache", "rel. cache", "peak KV MiB", "state/KV",
              "GFLOP/s", "of peak");
  for (const auto& row : rows) {
    double cache = 0;
    for (int64_t size : row.last.final_cache_sizes) cache += static_cast<double>(size);
    cache /= static_cast<double>(row.last.final_cache_sizes.size());
    const double prefill = Median(row.prefill), decode = Median(row.decode), total = Median(row.total);
    // Relative cache: the mean over queries of the cached tokens each attended to, against the full cache's.
    // state/KV: the policy's state (per-token state and query history) over the KV cache, at the KV peak.
    // The NAMM rows' policies observe attention (the others' FLOPs are the model's).
    const bool namm_row = row.name.find("NAMM") != std::string::npos || row.name.find("same,") != std::string::npos;
    const double gflops = bench::GenerationFlops(model->config(), row.last, row.last.decode_steps + 1, namm_row ? 32 : 0) /
                          total / 1e9;
    std::printf("%-34s %9.3f %9.3f %9.3f %7.2fx %11.0f %10.0f %11.0f %10.3f %12.2f %8.1f%% %12.3g %7.1f%%\n",
                row.name.c_str(), prefill, decode, total, total / base, static_cast<double>(o.prompt_tokens) / prefill,
                static_cast<double>(row.last.decode_steps) / decode, cache,
                row.last.mean_kv_tokens / rows[0].last.mean_kv_tokens,
                static_cast<double>(row.last.peak_kv_bytes) / (1 << 20),
                100.0 * static_cast<double>(row.last.peak_policy_state_bytes) / static_cast<double>(row.last.peak_kv_bytes),
                gflops, 100.0 * gflops / peak.gflops);
  }
  if (!o.profile) return 0;
  std::printf("\nWhere the time goes (one generation per row, the device waited for around each policy call)\n\n");
  std::printf("%-34s %9s %11s %10s %9s %17s %17s %11s\n", "policy", "total s", "Observe s", "Select s", "rest s",
              "Observe calls/ops", "Select calls/ops", "all ops");
  std::vector<std::map<std::string, int64_t>> top_level_by_row;
  for (const auto& row : rows) {
    TimedPolicy timed(row.make());
    {
      std::lock_guard<std::mutex> lock(top_level_mutex);
      top_level_operators.clear();
    }
    const OperatorCount counting;
    const int64_t operators = operators_dispatched.load();
    const auto start = Clock::now();
    auto result = generator.Generate(prompt, timed, options);
    const double total = Since(start);
    if (!result.ok()) return 1;
    // The gathers after Select() count with the rest (the engine applies them). Operators per call: ATen
    // operators dispatched (nested ones too) per Observe or Select call; all ops: the whole generation's.
    const auto per_call = [](int64_t ops, int64_t calls) {
      return std::to_string(calls) + " / " + std::to_string(calls > 0 ? ops / calls : 0);
    };
    std::printf("%-34s %9.3f %11.3f %10.3f %9.3f %17s %17s %11lld\n", row.name.c_str(), total, timed.observe_seconds,
                timed.select_seconds, total - timed.observe_seconds - timed.select_seconds,
                per_call(timed.observe_operators, timed.observe_calls).c_str(),
                per_call(timed.select_operators, timed.select_calls).c_str(),
                static_cast<long long>(operators_dispatched.load() - operators));
    std::lock_guard<std::mutex> lock(top_level_mutex);
    top_level_by_row.push_back(top_level_operators);
  }
  // What each row's code dispatches itself (nested operators left out), most frequent first: on a GPU most are
  // launches, so these say which calls a decode step's host time goes to.
  std::printf("\nTop-level operators per generation, the most frequent (name: count)\n");
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::vector<std::pair<int64_t, std::string>> sorted;
    int64_t total = 0;
    for (const auto& [name, count] : top_level_by_row[r]) {
      sorted.emplace_back(count, name);
      total += count;
    }
    std::sort(sorted.rbegin(), sorted.rend());
    std::printf("%s (%lld top-level):", rows[r].name.c_str(), static_cast<long long>(total));
    for (std::size_t i = 0; i < std::min<std::size_t>(sorted.size(), 16); ++i) {
      std::printf(" %s %lld%s", sorted[i].second.c_str(), static_cast<long long>(sorted[i].first),
                  i + 1 < std::min<std::size_t>(sorted.size(), 16) ? "," : "\n");
    }
  }
  return 0;
}

}  // namespace
}  // namespace namm::worker

constexpr const char* kUsage = R"(Usage: worker_generation_bench [--model M] [--tokenizer T] [--prompt-tokens N] [--new-tokens N]
       [--repeats R] [--dtype fp32|bf16|fp16] [--device cpu|cuda:N] [--only TEXT] [--profile 1] [--parts N1,N2,...]
       [--chunk 128] [--threads N]
--only keeps the full cache (the ratios' base) and the rows whose name contains TEXT (e.g. to profile one;
"A|B": rows containing A or B). On a GPU a last row, "full cache, attention in blocks", computes the full
cache's attention as an observing policy's is (probabilities in blocks), where the full cache itself may take
libtorch's fused kernel: the two in one process.
--chunk sets the prefill chunk of every row (the reference's 128; a divisor of the 512-token memory update
interval, so the NAMM's updates and what they see are the same, and fewer, larger chunks cost fewer launches).
--threads N: the CPU thread budget (BLAS and our kernels' pool; default: one per core).

       worker_generation_bench --random-model layers=2,dim=2048,heads=16,kv_heads=4,ffn=7168,vocab=32000 [...]
--random-model builds a deterministic random Llama of that shape (Gaussian weights, std 0.02, seed 1; plain
RoPE, theta 500000, context = prompt + new tokens) and prompts it with seeded random token ids, so that the
overhead is measured at Llama 3 8B's head size and GQA, where the paper measured it; its tokenizer is GPT-2's
(../shared), used only to decode.

       worker_generation_bench --chunk-memory 8192,32768 [--random-model ...]
instead measures the transient memory of one prefill chunk (128 tokens) run through the model with N tokens
already cached (random keys and values, the cache preallocated so that its growth is not counted): the peak
resident memory above the start, for the full cache and for a NAMM (which observes the attention). CPU only.

--profile 1 adds, for every row, one more generation with the policy's calls timed (the device waited for
before and after each, so the waits cost some time of their own): seconds in Observe(), in Select() (memory
updates), and everything else (the model, the cache's gathers); the calls, the ATen operators each dispatches
on average (nested ones counted), and the generation's operators in all; then each row's most frequent
top-level operators (those our code dispatches itself: on a GPU, where a decode step's host time goes).
--parts N1,N2,... instead times the NAMM's parts alone on the device at those cache sizes: one 128-row chunk's
GQA mean and frame fold, the BAM scorer's backward-masked attention, and a whole memory update's Select().
)";

int main(int argc, char** argv) {
  namm::worker::Options o;
  bool bad_value = false;
  const std::optional<int> exit = namm::bench::ParseArgs(argc, argv, kUsage, [&](const std::string& key,
                                                                                const std::string& value) {
    if (key == "--model") o.model = value;
    else if (key == "--tokenizer") o.tokenizer = value;
    else if (key == "--prompt-tokens") o.prompt_tokens = std::stoll(value);
    else if (key == "--new-tokens") o.new_tokens = std::stoll(value);
    else if (key == "--repeats") o.repeats = std::stoll(value);
    else if (key == "--chunk") o.chunk = std::stoll(value);
    else if (key == "--dtype") {
      if (value != "fp32" && value != "bf16" && value != "fp16") {
        std::fprintf(stderr, "--dtype takes fp32, bf16 or fp16, got %s\n", value.c_str());
        bad_value = true;
      }
      o.dtype = value == "bf16" ? at::kBFloat16 : value == "fp16" ? at::kHalf : at::kFloat;
    }
    else if (key == "--device") {
      try {
        o.device = at::Device(value);
      } catch (const std::exception&) {
        std::fprintf(stderr, "--device takes cpu or cuda:N, got %s\n", value.c_str());
        bad_value = true;
      }
    }
    else if (key == "--only") o.only = value;
    else if (key == "--threads") o.threads = std::stoll(value);
    else if (key == "--profile") o.profile = value != "0";
    else if (key == "--parts") o.parts = namm::bench::ParseCounts(value);
    else if (key == "--chunk-memory") o.chunk_memory = namm::bench::ParseCounts(value);
    else if (key == "--random-model") {
      o.random_model = value;
      o.tokenizer = std::string(NAMM_SHARED_DIR) + "/tokenizers/gpt2/tokenizer.json";
    }
    else return false;
    return true;
  });
  if (exit) return *exit;
  if (bad_value) return 2;
  return namm::worker::Run(o);
}
