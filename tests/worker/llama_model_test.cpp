#include <ATen/ops/arange.h>
#include <ATen/ops/log_softmax.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <optional>
#include <random>

#include "../namm_core/test_util.h"
#include "../temp_path.h"
#include "namm/batch_invariant.h"
#include "namm/policies/full_cache_policy.h"
#include "namm/policies/h2o_policy.h"
#include "namm/policies/l2_policy.h"
#include "namm/policies/namm_policy.h"
#include "namm/worker/generator.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/policy_spec.h"
#include "namm/worker/rope.h"
#include "shared_data.h"
#include "stories_inputs.h"

namespace namm::worker {
namespace {

using testing::SharedPath;

TEST(Rope, StaticNtkBaseMatchesTheReferenceFormula) {
  // Llama 3 at 4x with alpha 2 (spec §1.2): base' = 500000 * 7^(64/63) = 3609793.0043.
  LlamaConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000;
  c.rope_scaling.kind = RopeScaling::Kind::kNtk;
  c.rope_scaling.factor = 4;
  c.rope_scaling.alpha = 2;
  const at::Tensor inv_freq = rope_inverse_frequencies(c, at::kCPU);
  ASSERT_EQ(inv_freq.size(0), 64);
  for (int64_t i : {0, 1, 17, 63}) {
    const double expected = 1.0 / std::pow(3609793.0043, 2.0 * static_cast<double>(i) / 128.0);
    EXPECT_NEAR(inv_freq[i].item<float>(), expected, expected * 2e-6) << i;
  }
}

TEST(Rope, LinearAndLlama3Scaling) {
  LlamaConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000;
  const at::Tensor plain = rope_inverse_frequencies(c, at::kCPU);
  c.rope_scaling.kind = RopeScaling::Kind::kLinear;
  c.rope_scaling.factor = 2;
  EXPECT_TRUE(rope_inverse_frequencies(c, at::kCPU).allclose(plain / 2));
  c.rope_scaling = RopeScaling{RopeScaling::Kind::kLlama3, 8.0, 1.0, 1.0, 4.0, 8192};
  const at::Tensor llama3 = rope_inverse_frequencies(c, at::kCPU);
  for (int64_t i = 0; i < 64; ++i) {
    const double f = plain[i].item<float>(), wavelen = 2 * M_PI / f;
    double expected = f;  // high frequencies (wavelength < 8192 / 4) unchanged
    if (wavelen > 8192) {
      expected = f / 8;  // low frequencies divided by the factor
    } else if (wavelen >= 2048) {
      const double smooth = (8192 / wavelen - 1) / (4 - 1);
      expected = (1 - smooth) * f / 8 + smooth * f;
    }
    EXPECT_NEAR(llama3[i].item<float>(), expected, expected * 1e-5) << i;
  }
}

// The engine rotates packed rows in place on the CPU (invariant_rope_): the same bits as the tensor operations,
// for each sequence's rows by its own tables, YaRN's scaled tables included.
TEST(Rope, InPlaceRotationIsTheTensorOperationsBitForBit) {
  LlamaConfig c;
  c.head_dim = 64;
  c.rope_theta = 10000;
  const at::Tensor inv_freq = rope_inverse_frequencies(c, at::kCPU);
  for (const double scale : {1.0, 1.1377}) {
    const int64_t heads = 3, rows = 37;
    const at::Tensor x = testing::RandomNormal({rows, heads * 64}, 5, 3.0);
    const RopeTables first = rope_tables(inv_freq, at::arange(100, 120, at::TensorOptions().dtype(at::kLong)), scale);
    const RopeTables second = rope_tables(inv_freq, at::arange(7, 24, at::TensorOptions().dtype(at::kLong)), scale);
    at::Tensor rotated = x.clone();
    invariant_rope_(rotated, heads, 0, first.cos, first.sin);
    invariant_rope_(rotated, heads, 20, second.cos, second.sin);
    const at::Tensor a = apply_rope(x.narrow(0, 0, 20).view({20, heads, 64}),
                                    RopeTables{first.cos.unsqueeze(1), first.sin.unsqueeze(1)});
    const at::Tensor b = apply_rope(x.narrow(0, 20, 17).view({17, heads, 64}),
                                    RopeTables{second.cos.unsqueeze(1), second.sin.unsqueeze(1)});
    EXPECT_TRUE(rotated.narrow(0, 0, 20).view({20, heads, 64}).equal(a)) << "scale " << scale;
    EXPECT_TRUE(rotated.narrow(0, 20, 17).view({17, heads, 64}).equal(b)) << "scale " << scale;
  }
}

TEST(RopeScaling, ParsesTheCommandLineForm) {
  auto ntk = RopeScaling::Parse("ntk:factor=4,alpha=2");
  ASSERT_TRUE(ntk.ok());
  EXPECT_EQ(ntk->kind, RopeScaling::Kind::kNtk);
  EXPECT_EQ(ntk->alpha, 2);
  EXPECT_EQ(ntk->ToString(), "ntk:factor=4,alpha=2");
  EXPECT_FALSE(RopeScaling::Parse("ntk:alpha=2").ok());           // factor required
  EXPECT_FALSE(RopeScaling::Parse("longrope:factor=4").ok());       // not a supported kind
  auto yarn = RopeScaling::Parse("yarn:factor=4,original_max_position_embeddings=32768");
  ASSERT_TRUE(yarn.ok()) << yarn.status().ToString();
  EXPECT_NEAR(yarn->yarn_attention_factor(), 0.1 * std::log(4.0) + 1.0, 1e-12);
  EXPECT_FALSE(RopeScaling::Parse("yarn:factor=4,beta_fast=1,beta_slow=32").ok());  // edges out of order
  auto dynamic = RopeScaling::Parse("dynamic:factor=2");
  ASSERT_TRUE(dynamic.ok());
  EXPECT_EQ(dynamic->ToString(), "dynamic:factor=2");
  EXPECT_FALSE(RopeScaling::Parse("linear:factor=0.5").ok());
}

// ---- stories260K -------------------------------------------------------------------------------------------------

struct Stories {
  LlamaModel model;
  std::unique_ptr<Tokenizer> tokenizer;
};

Stories LoadStories(std::optional<RopeScaling> scaling = std::nullopt) {
  LoadOptions options;
  options.rope_scaling = scaling;
  auto model = LlamaModel::Load(SharedPath(testing::kStoriesModel), options);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  auto tokenizer = load_tokenizer(SharedPath(testing::kStoriesTokenizer));
  EXPECT_TRUE(tokenizer.ok());
  return {std::move(model).value(), std::move(tokenizer).value()};
}

// `prompt` generated on `s` with the policy `spec` names (made without a tokenizer).
Result<GenerationResult> GenerateWith(Stories& s, const std::vector<int64_t>& prompt, const std::string& spec,
                                      const GenerationOptions& options) {
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<MemoryPolicy> policy, make_policy(spec, PolicyContext{}));
  return Generator(s.model, *s.tokenizer).Generate(prompt, *policy, options);
}

TEST(Stories260K, GreedyContinuationIsTheKnownStory) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories();
  FullCachePolicy full;
  GenerationOptions options;
  options.max_new_tokens = 64;
  options.eos_ids = {2};
  auto result = Generator(s.model, *s.tokenizer).Generate(s.tokenizer->EncodeForModel("Once upon a time").value(), full, options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  const std::string expected =
      ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red "
      "ball. She wanted to play with it, but it was too high.\n";
  EXPECT_EQ(result->text.substr(0, expected.size()), expected);
  EXPECT_EQ(result->prompt_tokens, 5);
  EXPECT_TRUE(result->updates.empty());  // far below 512 tokens: never evicted
}

TEST(Stories260K, PromptLikelihoodMatchesTheReference) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories();
  FullCachePolicy full;
  GenerationOptions options;
  options.max_new_tokens = 0;
  options.record_logits = true;
  const std::vector<int64_t> ids = s.tokenizer->EncodeForModel("Once upon a time").value();
  auto result = Generator(s.model, *s.tokenizer).Generate(ids, full, options);
  ASSERT_TRUE(result.ok());
  const at::Tensor log_probs = at::log_softmax(result->prompt_logits, -1);
  double nll = 0;
  for (std::size_t i = 0; i + 1 < ids.size(); ++i) nll -= log_probs[static_cast<int64_t>(i)][ids[i + 1]].item<double>();
  EXPECT_NEAR(nll / 4.0, 0.0685, 0.0005);
}

TEST(Stories260K, ZeroParameterNammReproducesTheFullCacheExactly) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 1600);
  GenerationOptions options;
  options.max_new_tokens = 40;
  options.record_logits = true;
  FullCachePolicy full;
  auto namm = NammPolicy::Create(NammWith(0, 0));
  ASSERT_TRUE(namm.ok());
  Generator generator(s.model, *s.tokenizer);
  auto base = generator.Generate(prompt, full, options);
  auto with_namm = generator.Generate(prompt, **namm, options);
  ASSERT_TRUE(base.ok() && with_namm.ok()) << with_namm.status().ToString();
  ASSERT_EQ(with_namm->updates.size(), 3u);  // at 512, 1024 and 1536 tokens
  EXPECT_EQ(with_namm->updates[2].sequence_length, 1536);
  for (const auto& update : with_namm->updates) {
    for (int64_t size : update.cache_sizes) EXPECT_EQ(size, update.sequence_length);
  }
  EXPECT_EQ(with_namm->token_ids, base->token_ids);
  EXPECT_TRUE(with_namm->prompt_logits.equal(base->prompt_logits));
  EXPECT_TRUE(with_namm->generated_logits.equal(base->generated_logits));
}

// Records, for every memory update of every layer, the absolute positions each KV head keeps.
class RecordingPolicy final : public MemoryPolicy {
 public:
  explicit RecordingPolicy(MemoryPolicy& inner) : inner_(inner) {}
  std::string name() const override { return inner_.name(); }
  std::vector<TokenStateSpec> token_state() const override { return inner_.token_state(); }
  bool needs_attention() const override { return inner_.needs_attention(); }
  Status Observe(int layer, const at::Tensor& attention, int64_t first_query, LayerKVCache& cache) override {
    return inner_.Observe(layer, attention, first_query, cache);
  }
  Result<at::Tensor> Select(int layer, LayerKVCache& cache) override {
    auto keep = inner_.Select(layer, cache);
    if (keep.ok()) kept[layer].push_back({cache.tokens_seen(), cache.positions().gather(1, *keep)});
    return keep;
  }
  struct Event {
    int64_t length;       // sequence length at the update
    at::Tensor positions; // [kv_heads, k] kept absolute positions
  };
  std::map<int, std::vector<Event>> kept;

 private:
  MemoryPolicy& inner_;
};

// Logits of every position computed without a KV cache: full self-attention over the sequence, where query i
// of layer l, KV head h sees key j iff j <= i and j survived the latest memory update before i.
at::Tensor MaskedFullSequenceLogits(const LlamaModel& model, const at::Tensor& tokens,
                                    const std::map<int, std::vector<RecordingPolicy::Event>>& kept) {
  const LlamaConfig& c = model.config();
  const LlamaWeights& w = model.weights();
  const int64_t n = tokens.size(0), hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
  auto rms = [&](const at::Tensor& x, const at::Tensor& weight) {
    return weight * (x * at::rsqrt(x.square().mean(-1, true) + c.norm_eps));
  };
  const RopeTables rope = rope_tables(rope_inverse_frequencies(c, at::kCPU), at::arange(n, at::TensorOptions().dtype(at::kLong)));
  at::Tensor x = w.token_embedding.index_select(0, tokens);
  for (int l = 0; l < static_cast<int>(c.n_layers); ++l) {
    const LlamaLayerWeights& lw = w.layers[static_cast<std::size_t>(l)];
    // visible[h][i][j]
    at::Tensor visible = at::ones({n, n}, at::TensorOptions().dtype(at::kBool)).tril().unsqueeze(0).repeat({c.n_kv_heads, 1, 1});
    auto it = kept.find(l);
    if (it != kept.end()) {
      for (const auto& event : it->second) {
        // Queries from event.length on see, among keys before event.length, only the kept ones.
        at::Tensor survivor = at::zeros({c.n_kv_heads, n}, at::TensorOptions().dtype(at::kBool));
        survivor.narrow(1, event.length, n - event.length).fill_(true);
        survivor.scatter_(1, event.positions, true);
        visible.narrow(1, event.length, n - event.length).logical_and_(survivor.unsqueeze(1));
      }
    }
    const at::Tensor h = rms(x, lw.attention_norm);
    const at::Tensor q = apply_rope(at::linear(h, lw.wq).view({n, c.n_heads, hd}).transpose(0, 1), rope);
    const at::Tensor k = apply_rope(at::linear(h, lw.wk).view({n, c.n_kv_heads, hd}).transpose(0, 1), rope);
    const at::Tensor v = at::linear(h, lw.wv).view({n, c.n_kv_heads, hd}).transpose(0, 1);
    std::vector<at::Tensor> heads;
    for (int64_t head = 0; head < c.n_heads; ++head) {
      const int64_t kv = head / group;
      at::Tensor scores = q[head].matmul(k[kv].t()) / std::sqrt(static_cast<double>(hd));
      scores.masked_fill_(visible[kv].logical_not(), -std::numeric_limits<float>::infinity());
      heads.push_back(scores.softmax(-1).matmul(v[kv]));
    }
    x = x + at::linear(at::cat(heads, 1), lw.wo);
    const at::Tensor g = rms(x, lw.ffn_norm);
    x = x + at::linear(at::silu(at::linear(g, lw.w_gate)) * at::linear(g, lw.w_up), lw.w_down);
  }
  return at::linear(rms(x, w.final_norm), w.lm_head);
}

TEST(Stories260K, EvictionEqualsMaskingTheEvictedTokens) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 1300);
  auto namm = NammPolicy::Create(NammWith(0.15, 4));
  ASSERT_TRUE(namm.ok());
  RecordingPolicy recorder(**namm);
  GenerationOptions options;
  options.max_new_tokens = 300;  // decoding crosses 1536: one update during generation
  options.record_logits = true;
  auto result = Generator(s.model, *s.tokenizer).Generate(prompt, recorder, options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_EQ(result->updates.size(), 3u);
  int64_t evicted = 0;
  for (const auto& update : result->updates) {
    for (int64_t size : update.cache_sizes) evicted += update.sequence_length - size;
  }
  ASSERT_GT(evicted, 500) << "the NAMM should evict";

  // The whole sequence (prompt + generated tokens fed back), computed from scratch with masks.
  std::vector<int64_t> all = prompt;
  all.insert(all.end(), result->token_ids.begin(), result->token_ids.end() - 1);
  const at::Tensor tokens = at::from_blob(all.data(), {static_cast<int64_t>(all.size())}, at::TensorOptions().dtype(at::kLong)).clone();
  const at::Tensor reference = MaskedFullSequenceLogits(s.model, tokens, recorder.kept);
  const at::Tensor engine = at::cat({result->prompt_logits, result->generated_logits.narrow(0, 1, result->generated_logits.size(0) - 1)}, 0);
  ASSERT_EQ(engine.sizes(), reference.sizes());
  EXPECT_LT((engine - reference).abs().max().item<float>(), 2e-4f);
  // And without masking the logits after the first update do differ: the masks matter.
  const at::Tensor unmasked = MaskedFullSequenceLogits(s.model, tokens, {});
  EXPECT_GT((engine - unmasked).narrow(0, 600, 100).abs().max().item<float>(), 1e-2f);
}

TEST(Stories260K, PrefillChunkSizeDoesNotChangeTheResult) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 1100);
  auto run = [&](int64_t chunk) {
    auto namm = NammPolicy::Create(NammWith(0.15, 4));
    GenerationOptions options;
    options.max_new_tokens = 20;
    options.chunk_size = chunk;
    options.record_logits = true;
    auto result = Generator(s.model, *s.tokenizer).Generate(prompt, **namm, options);
    EXPECT_TRUE(result.ok());
    return std::move(result).value();
  };
  const GenerationResult a = run(128), b = run(512), c = run(32);
  EXPECT_EQ(a.token_ids, b.token_ids);
  EXPECT_EQ(a.token_ids, c.token_ids);
  EXPECT_EQ(a.final_cache_sizes, c.final_cache_sizes);
  EXPECT_LT((a.prompt_logits - c.prompt_logits).abs().max().item<float>(), 1e-4f);
}

// The engine's NAMM (observing from the query history) takes a prefill frame's earlier queries from the previous
// pass's rows, carried (small caches), so its features, evictions and logits are the same bits for every prefill
// chunk that divides the update interval.
TEST(Stories260K, NammFromTheQueryHistoryIsTheSameForEveryPrefillChunk) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 700);
  std::vector<at::Tensor> features;  // of the last update, per run
  auto run = [&](int64_t chunk) {
    auto namm = NammPolicy::Create(NammWith(0.15, 4));
    (*namm)->set_observe_from_query_history(true);
    (*namm)->set_tracing(true);
    GenerationOptions options;
    options.max_new_tokens = 20;
    options.chunk_size = chunk;
    options.memory_update_interval = 128;
    options.record_logits = true;
    auto result = Generator(s.model, *s.tokenizer).Generate(prompt, **namm, options);
    EXPECT_TRUE(result.ok());
    features.push_back((*namm)->last_trace().features);
    return std::move(result).value();
  };
  const GenerationResult a = run(32), b = run(64), c = run(128);
  EXPECT_TRUE(features[0].equal(features[1]));  // the last update's features, to the last bit
  EXPECT_TRUE(features[0].equal(features[2]));
  for (const GenerationResult* other : {&b, &c}) {
    EXPECT_EQ(a.token_ids, other->token_ids);
    EXPECT_EQ(a.final_cache_sizes, other->final_cache_sizes);
    ASSERT_EQ(a.updates.size(), other->updates.size());
    for (std::size_t u = 0; u < a.updates.size(); ++u) EXPECT_EQ(a.updates[u].cache_sizes, other->updates[u].cache_sizes);
    EXPECT_TRUE(a.generated_logits.equal(other->generated_logits));
  }
  EXPECT_LT(a.final_cache_sizes[0], 600);  // it evicted
}

// Attention in blocks of query rows (one row at a time here) gives what one block per chunk gives, evictions
// included: the NAMM observes each block at its own query indices. On the CPU in float32 both run our kernel
// (the blocks with their keys truncated to what each block sees), so the numbers are the same bits, with
// rectangular caches and with keys and values in a pool's blocks alike.
TEST(Stories260K, AttentionBlocksDoNotChangeTheResult) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 1100);
  auto pool = KvBlockPool::Create(16, s.model.config().head_dim, s.model.options(), 0);
  ASSERT_TRUE(pool.ok());
  auto run = [&](int64_t block_elements, bool in_blocks) {
    EXPECT_TRUE(s.model.set_kv_block_pool(in_blocks ? *pool : nullptr).ok());
    s.model.set_attention_block_elements(block_elements);
    auto namm = NammPolicy::Create(NammWith(0.15, 4));
    GenerationOptions options;
    options.max_new_tokens = 20;
    options.record_logits = true;
    auto result = Generator(s.model, *s.tokenizer).Generate(prompt, **namm, options);
    EXPECT_TRUE(result.ok());
    return std::move(result).value();
  };
  const GenerationResult whole = run(int64_t{1} << 40, false);
  EXPECT_LT(whole.final_cache_sizes.front(), 1100) << "the NAMM should have evicted";
  for (const auto& [block_elements, in_blocks] :
       {std::pair<int64_t, bool>{1, false}, {int64_t{1} << 40, true}, {1, true}}) {
    SCOPED_TRACE("block elements " + std::to_string(block_elements) + (in_blocks ? ", KV in blocks" : ""));
    const GenerationResult other = run(block_elements, in_blocks);
    EXPECT_EQ(whole.token_ids, other.token_ids);
    EXPECT_EQ(whole.final_cache_sizes, other.final_cache_sizes);
    EXPECT_TRUE(whole.prompt_logits.equal(other.prompt_logits));
    EXPECT_TRUE(whole.generated_logits.equal(other.generated_logits));
  }
  EXPECT_TRUE(s.model.set_kv_block_pool(nullptr).ok());
  s.model.set_attention_block_elements(kAttentionBlockElements);
}

// The NAMM that keeps only the EMA per token and computes earlier queries' attention again from the recorded
// queries evicts what the one with a per-token sample ring evicts: same tokens, same cache sizes, features within
// float rounding; with whole chunks, a chunk of 32, and attention run one query row at a time.
TEST(Stories260K, NammFromTheQueryHistoryMatchesTheSampleRing) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 1100);
  struct Run {
    GenerationResult result;
    at::Tensor features;  // of the last memory update of the last layer
  };
  auto run = [&](bool from_history, int64_t chunk, int64_t block_elements) {
    s.model.set_attention_block_elements(block_elements);
    auto namm = NammPolicy::Create(NammWith(0.15, 4));
    EXPECT_TRUE(namm.ok());
    (*namm)->set_tracing(true);
    (*namm)->set_observe_from_query_history(from_history);
    EXPECT_EQ((*namm)->token_state().size(), from_history ? 1u : 2u);
    EXPECT_EQ((*namm)->query_history(), from_history ? 31 : 0);
    GenerationOptions options;
    options.max_new_tokens = 40;
    options.chunk_size = chunk;
    options.record_logits = true;
    auto result = Generator(s.model, *s.tokenizer).Generate(prompt, **namm, options);
    EXPECT_TRUE(result.ok()) << result.status().ToString();
    return Run{std::move(result).value(), (*namm)->last_trace().features};
  };
  for (const auto& [chunk, block_elements] :
       {std::pair<int64_t, int64_t>{128, int64_t{1} << 22}, {32, int64_t{1} << 22}, {128, 1}}) {
    const Run ring = run(false, chunk, block_elements), history = run(true, chunk, block_elements);
    ASSERT_LT(ring.result.final_cache_sizes.front(), 1100) << "the NAMM should have evicted";
    EXPECT_EQ(history.result.token_ids, ring.result.token_ids) << "chunk " << chunk << ", block " << block_elements;
    EXPECT_EQ(history.result.final_cache_sizes, ring.result.final_cache_sizes) << "chunk " << chunk;
    ASSERT_EQ(history.features.sizes(), ring.features.sizes());
    // z-scored features up to ~22, differing by float rounding only: exp(s - lse) against the softmax, and the CPU
    // kernels' fold (the DFT's symmetry, another summation order) against the ring's product. Measured 3e-6 to
    // 7e-5 before the CPU kernels; with them, on an AVX2 machine, 2.8e-6, 1.4e-5 and 4.8e-4 (whole chunks of
    // 128): z-scoring magnifies the rounding of the bins with the smallest spread.
    EXPECT_LT((history.features - ring.features).abs().max().item<float>(), 1e-3f) << "chunk " << chunk;
    EXPECT_TRUE(history.result.generated_logits.equal(ring.result.generated_logits)) << "chunk " << chunk;
  }
  s.model.set_attention_block_elements(int64_t{1} << 22);
}

TEST(Stories260K, BaselinesKeepTheirBudget) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 1100);
  GenerationOptions options;
  options.max_new_tokens = 5;
  auto h2o = H2OPolicy::Create(CacheBudget::Tokens(256).value(), 128);
  auto with_h2o = Generator(s.model, *s.tokenizer).Generate(prompt, **h2o, options);
  ASSERT_TRUE(with_h2o.ok());
  ASSERT_EQ(with_h2o->updates.size(), 2u);
  for (const auto& update : with_h2o->updates) EXPECT_EQ(update.cache_sizes, std::vector<int64_t>(5, 256));
  // After the update at 1024: 76 more prompt tokens and 4 decoded ones (the 5th is never fed back).
  EXPECT_EQ(with_h2o->final_cache_sizes[0], 256 + 76 + 4);
  auto l2 = L2Policy::Create(CacheBudget::Tokens(300).value());
  auto with_l2 = Generator(s.model, *s.tokenizer).Generate(prompt, **l2, options);
  ASSERT_TRUE(with_l2.ok());
  EXPECT_EQ(with_l2->updates.back().cache_sizes, std::vector<int64_t>(5, 300));
}

// Every baseline, built from its spec as the CLI does, with a budget of at least the whole sequence, generates
// exactly what the full cache generates; so do the prompt-compressing ones (SnapKV, FastGen) with a budget of the
// prompt's length, and every one of them with the whole cache at its disposal reports the same cache sizes.
TEST(Stories260K, BaselinesWithRoomForTheSequenceReproduceTheFullCache) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 600);
  GenerationOptions options;
  options.max_new_tokens = 40;
  options.memory_update_interval = 128;  // updates at 128, 256, ..., 640 (during decoding)
  options.record_logits = true;
  FullCachePolicy full;
  auto base = Generator(s.model, *s.tokenizer).Generate(prompt, full, options);
  ASSERT_TRUE(base.ok());
  PolicyContext context;
  context.tokenizer = s.tokenizer.get();
  const std::string whole = std::to_string(prompt.size() + 40), prompt_length = std::to_string(prompt.size());
  for (const std::string& spec :
       {"h2o:budget=" + whole, "l2:budget=" + whole, "streaming:budget=" + whole, "tova:budget=" + whole,
        "snapkv:budget=" + prompt_length, "fastgen:budget=" + prompt_length, std::string("snapkv:ratio=1"),
        std::string("h2o:ratio=1")}) {
    SCOPED_TRACE(spec);
    auto policy = make_policy(spec, context);
    ASSERT_TRUE(policy.ok()) << policy.status().ToString();
    auto run = Generator(s.model, *s.tokenizer).Generate(prompt, **policy, options);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    EXPECT_EQ(run->token_ids, base->token_ids);
    EXPECT_TRUE(run->prompt_logits.equal(base->prompt_logits));
    EXPECT_TRUE(run->generated_logits.equal(base->generated_logits));
    EXPECT_EQ(run->final_cache_sizes, base->final_cache_sizes);
    EXPECT_DOUBLE_EQ(run->mean_kv_tokens, base->mean_kv_tokens);
  }
}

TEST(Stories260K, SnapKvCompressesThePromptOnceAndKeepsEveryDecodedToken) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 300);
  GenerationOptions options;
  options.max_new_tokens = 30;
  options.chunk_size = 32;
  options.memory_update_interval = 64;
  auto run = GenerateWith(s, prompt, "snapkv:budget=64", options);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  std::vector<MemoryUpdateRecord> compressions;
  for (const auto& u : run->updates) {
    if (u.end_of_prefill) compressions.push_back(u);
    else EXPECT_EQ(u.cache_sizes[0], u.sequence_length > 300 ? 64 + u.sequence_length - 300 : u.sequence_length);
  }
  ASSERT_EQ(compressions.size(), 1u);
  EXPECT_EQ(compressions[0].sequence_length, static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(compressions[0].cache_sizes, std::vector<int64_t>(5, 64));
  EXPECT_EQ(run->final_cache_sizes, std::vector<int64_t>(5, 64 + 29));  // the 30th token is never fed back
  EXPECT_DOUBLE_EQ(run->peak_kv_tokens, static_cast<double>(prompt.size()));
}

// A temperature so small that the logits over it overflow chooses as temperature 0 does (before: softmax of
// infinities, NaN, and token 0 at every step).
TEST(Stories260K, ATemperatureTooSmallToDivideByChoosesTheArgmax) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{});
  const std::vector<int64_t> prompt = s.tokenizer->EncodeForModel("Once upon a time").value();
  std::vector<std::vector<int64_t>> answers;
  for (const double temperature : {0.0, 1e-310}) {
    GenerationOptions options;
    options.max_new_tokens = 12;
    options.temperature = temperature;
    options.seed = 7;
    FullCachePolicy full;
    auto run = Generator(s.model, *s.tokenizer).Generate(prompt, full, options);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    answers.push_back(run->token_ids);
  }
  EXPECT_EQ(answers[1], answers[0]);
  EXPECT_NE(answers[0], std::vector<int64_t>(answers[0].size(), 0));
}

// A pooling kernel wider than the prompt pools its whole maximum, as one just spanning it does, and takes no
// longer: libtorch walks a kernel's whole width, and a namm-api request's kernel=2^62-1 held the scheduler.
TEST(Stories260K, SnapKvPoolingWiderThanThePromptPoolsWhatOneSpanningItPools) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 300);
  GenerationOptions options;
  options.max_new_tokens = 8;
  options.chunk_size = 32;
  options.memory_update_interval = 64;
  options.record_logits = true;
  std::vector<GenerationResult> runs;
  for (const std::string kernel : {"601", "4611686018427387903"}) {  // 2 * 300 + 1, 2^62 - 1
    auto run = GenerateWith(s, prompt, "snapkv:budget=64,kernel=" + kernel, options);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    runs.push_back(std::move(*run));
  }
  EXPECT_EQ(runs[0].token_ids, runs[1].token_ids);
  EXPECT_TRUE(runs[0].generated_logits.equal(runs[1].generated_logits));
  EXPECT_EQ(runs[1].final_cache_sizes, std::vector<int64_t>(5, 64 + 7));
}

// namm:FILE,prompt=keep: the prompt's updates keep every token, the NAMM evicts once at its end (at a length no
// multiple of the hop), then at the decoding's updates.
TEST(Stories260K, ANammKeepingThePromptEvictsFromItsEndOn) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0});
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 300);
  ASSERT_NE(prompt.size() % 16, 0u) << "the test wants a prompt's end between spectrogram hops";
  GenerationOptions options;
  options.max_new_tokens = 100;
  options.chunk_size = 32;
  options.memory_update_interval = 64;
  auto namm = NammPolicy::Create(NammWith(0.15, 4));
  ASSERT_TRUE(namm.ok());
  (*namm)->set_observe_from_query_history(true);
  (*namm)->set_keep_prompt(true);
  auto run = Generator(s.model, *s.tokenizer).Generate(prompt, **namm, options);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  const auto length = static_cast<int64_t>(prompt.size());
  int64_t at_end = 0, after = 0;
  for (const auto& u : run->updates) {
    if (u.end_of_prefill) {
      ++at_end;
      EXPECT_EQ(u.sequence_length, length);
      for (int64_t size : u.cache_sizes) EXPECT_LT(size, length);
    } else if (u.sequence_length <= length) {
      EXPECT_EQ(u.cache_sizes, std::vector<int64_t>(5, u.sequence_length)) << "inside the prompt";
    } else {
      ++after;
    }
  }
  EXPECT_EQ(at_end, 1);
  EXPECT_GT(after, 0);
  EXPECT_DOUBLE_EQ(run->peak_kv_tokens, static_cast<double>(length));
  EXPECT_LT(run->answer_kv_tokens, 0.8 * static_cast<double>(length));
}

TEST(Generator, CacheSizesAreMeansOverQueries) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories();
  FullCachePolicy full;
  GenerationOptions options;
  options.max_new_tokens = 0;
  options.chunk_size = 32;
  options.teacher_forcing = true;
  options.forced_tokens = std::vector<int64_t>(20, 300);
  const std::vector<int64_t> prompt = LongPrompt(*s.tokenizer, 100);
  auto run = Generator(s.model, *s.tokenizer).Generate(prompt, full, options);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  const double length = static_cast<double>(prompt.size()) + 20;
  // Query i (from 0) attends to i + 1 tokens: the mean over L queries is (L + 1) / 2.
  EXPECT_DOUBLE_EQ(run->mean_kv_tokens, (length + 1) / 2);
  EXPECT_DOUBLE_EQ(run->answer_kv_tokens, (static_cast<double>(prompt.size()) * 2 + 21) / 2);
  EXPECT_DOUBLE_EQ(run->peak_kv_tokens, length);
  EXPECT_EQ(run->forced_logits.size(0), 21);
  // A StreamingLLM window of 16 with updates every 32 tokens: the cache oscillates between 16 and 48.
  options.memory_update_interval = 32;
  auto window = make_policy("streaming:budget=16", PolicyContext{});
  ASSERT_TRUE(window.ok());
  auto windowed = Generator(s.model, *s.tokenizer).Generate(prompt, **window, options);
  ASSERT_TRUE(windowed.ok());
  EXPECT_LT(windowed->mean_kv_tokens, 40);
  EXPECT_GT(windowed->mean_kv_tokens, 16);
  EXPECT_DOUBLE_EQ(windowed->peak_kv_tokens, 48);
}

TEST(Generator, RefusesPromptsThatDoNotFit) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories();  // context 512 without scaling
  FullCachePolicy full;
  GenerationOptions options;
  options.max_new_tokens = 100;
  auto result = Generator(s.model, *s.tokenizer).Generate(std::vector<int64_t>(500, 1), full, options);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("exceeds the context of 512"), std::string::npos);
  options.max_new_tokens = std::numeric_limits<int64_t>::max();  // its sum with the prompt's length overflowed
  result = Generator(s.model, *s.tokenizer).Generate({1, 2}, full, options);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("plus 9223372036854775807 new tokens exceeds the context of 512"),
            std::string::npos)
      << result.status().ToString();
  options.max_new_tokens = 100;
  options.chunk_size = 100;  // does not divide 512
  EXPECT_FALSE(Generator(s.model, *s.tokenizer).Generate({1, 2}, full, options).ok());
}

// policy_peak_tokens is what namm-api admits a request at, so no cache may hold more than it says: every family,
// budgets and ratios drawn around the prompt's length, prompts and answers of drawn lengths, chunks of 32 and
// memory updates every 64 (the largest size a cache holds, averaged over layers, against the bound). With SnapKV
// and FastGen counted at their budget plus an interval, a 300-token prompt held 300 where the bound said 80.
TEST(Stories260K, NoPolicysCacheHoldsMoreThanItsPeakBoundSays) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories(RopeScaling{});
  const std::string file = testing::WriteRandomNammFile("peak-bound.safetensors", 11);
  std::mt19937_64 random(11);
  const auto draw = [&](int64_t low, int64_t high) {
    return std::uniform_int_distribution<int64_t>(low, high)(random);
  };
  const std::vector<std::string> families = {"full", "h2o", "l2", "streaming", "tova", "snapkv", "fastgen", "namm"};
  PolicyContext context;
  context.tokenizer = s.tokenizer.get();
  int64_t runs = 0;
  for (int round = 0; round < 4; ++round) {
    for (const std::string& family : families) {
      const int64_t prompt_tokens = draw(20, 320), new_tokens = draw(1, 120);
      const std::string amount = draw(0, 1) == 0 ? "budget=" + std::to_string(draw(1, prompt_tokens + 40))
                                                 : "ratio=" + std::to_string(draw(5, 95) / 100.0);
      std::string spec = family == "full" ? "full" : family == "namm" ? "namm:" + file : family + ":" + amount;
      if (family == "namm" && draw(0, 3) > 0) spec += "," + amount;
      if (family == "namm" && draw(0, 1) == 0) spec += ",prompt=keep";
      if ((family == "namm" || family == "fastgen") && draw(0, 1) == 0) spec += ",heads=own";
      if (family == "l2" && draw(0, 1) == 0) spec += ",skip_layers=" + std::to_string(draw(1, 2));
      SCOPED_TRACE(spec + ", " + std::to_string(prompt_tokens) + " + " + std::to_string(new_tokens) + " tokens");
      std::vector<int64_t> prompt = {1};
      while (static_cast<int64_t>(prompt.size()) < prompt_tokens) prompt.push_back(draw(3, 511));
      GenerationOptions options;
      options.max_new_tokens = new_tokens;
      options.chunk_size = 32;
      options.memory_update_interval = 64;
      const Result<int64_t> bound = policy_peak_tokens(spec, prompt_tokens, new_tokens, 64);
      ASSERT_TRUE(bound.ok()) << bound.status().ToString();
      auto policy = make_policy(spec, context);
      ASSERT_TRUE(policy.ok()) << policy.status().ToString();
      const auto run = Generator(s.model, *s.tokenizer).Generate(prompt, **policy, options);
      ASSERT_TRUE(run.ok()) << run.status().ToString();
      EXPECT_LE(run->peak_kv_tokens, static_cast<double>(*bound));
      ++runs;
    }
  }
  EXPECT_EQ(runs, 32);
}

}  // namespace
}  // namespace namm::worker
