// The engine on a CUDA device against the same engine on the CPU: stories260K with every memory policy that
// runs on its own (no tokenizer classes), in float32 (the same tokens, evictions and cache sizes; logits within
// GEMM rounding) and in the half-precision dtypes (the prompt's likelihood close to float32's). Skipped where
// there is no GPU; scripts/device-check.sh runs them on one.
#include <ATen/Context.h>
#include <ATen/ops/log_softmax.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "namm/policies/full_cache_policy.h"
#include "namm/policies/h2o_policy.h"
#include "namm/policies/l2_policy.h"
#include "namm/policies/namm_policy.h"
#include "namm/policies/snapkv_policy.h"
#include "namm/policies/streaming_llm_policy.h"
#include "namm/policies/tova_policy.h"
#include "namm/worker/generator.h"
#include "namm/worker/llama_model.h"
#include "shared_data.h"
#include "stories_inputs.h"

namespace namm::worker {
namespace {

using testing::SharedPath;

#define NAMM_REQUIRE_CUDA()                                                   \
  do {                                                                        \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device in this build or machine"; \
  } while (false)

const at::Device kCuda(at::kCUDA, 0);

LlamaModel LoadStories(at::Device device, at::ScalarType dtype) {
  LoadOptions options;
  options.device = device;
  options.dtype = dtype;
  options.rope_scaling = RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0};  // 2,048 tokens
  auto model = LlamaModel::Load(SharedPath(testing::kStoriesModel), options);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::move(model).value();
}

std::unique_ptr<Tokenizer> StoriesTokenizer() {
  auto tokenizer = load_tokenizer(SharedPath(testing::kStoriesTokenizer));
  EXPECT_TRUE(tokenizer.ok());
  return std::move(tokenizer).value();
}

// The comparisons' generation: 24 greedy tokens, every logit kept.
GenerationOptions GreedyWithLogits() {
  GenerationOptions options;
  options.max_new_tokens = 24;
  options.record_logits = true;
  return options;
}

using PolicyFactory = std::function<std::unique_ptr<MemoryPolicy>(at::Device)>;

template <typename T>
std::unique_ptr<MemoryPolicy> Take(Result<std::unique_ptr<T>> policy) {
  EXPECT_TRUE(policy.ok()) << policy.status().ToString();
  return std::move(policy).value();
}

std::vector<std::pair<std::string, PolicyFactory>> Policies() {
  const auto namm = [](bool from_history) {
    return [from_history](at::Device device) {
      auto policy = NammPolicy::Create(NammWith(0.15, 4), device);
      EXPECT_TRUE(policy.ok()) << policy.status().ToString();
      (*policy)->set_observe_from_query_history(from_history);
      return std::unique_ptr<MemoryPolicy>(std::move(policy).value());
    };
  };
  const CacheBudget budget = CacheBudget::Tokens(256).value();
  return {
      {"full cache", [](at::Device) { return std::unique_ptr<MemoryPolicy>(new FullCachePolicy()); }},
      {"NAMM, query history", namm(true)},
      {"NAMM, sample ring", namm(false)},
      {"H2O", [=](at::Device) { return Take(H2OPolicy::Create(budget, 128)); }},
      {"L2", [=](at::Device) { return Take(L2Policy::Create(budget)); }},
      {"StreamingLLM", [=](at::Device) { return Take(StreamingLlmPolicy::Create(budget)); }},
      {"TOVA", [=](at::Device) { return Take(TovaPolicy::Create(budget)); }},
      {"SnapKV", [=](at::Device) { return Take(SnapKvPolicy::Create(budget)); }},
  };
}

float MaxAbsDifference(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kCPU) - b.to(at::kCPU)).abs().max().item<float>();
}

// float32 on the GPU decides what float32 on the CPU decides: the NAMM's scores, the baselines' rankings and the
// greedy tokens all follow from the same attention up to GEMM rounding (cuBLAS against OpenBLAS, TF32 off).
TEST(EngineOnCuda, GeneratesWhatTheCpuGenerates) {
  NAMM_REQUIRE_CUDA();
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const LlamaModel cpu = LoadStories(at::kCPU, at::kFloat), gpu = LoadStories(kCuda, at::kFloat);
  const std::unique_ptr<Tokenizer> tokenizer = StoriesTokenizer();
  const std::vector<int64_t> prompt = LongPrompt(*tokenizer, 1100);
  const GenerationOptions options = GreedyWithLogits();
  for (const auto& [name, make] : Policies()) {
    SCOPED_TRACE(name);
    auto on_cpu_policy = make(at::kCPU), on_gpu_policy = make(kCuda);
    auto on_cpu = Generator(cpu, *tokenizer).Generate(prompt, *on_cpu_policy, options);
    auto on_gpu = Generator(gpu, *tokenizer).Generate(prompt, *on_gpu_policy, options);
    ASSERT_TRUE(on_cpu.ok()) << on_cpu.status().ToString();
    ASSERT_TRUE(on_gpu.ok()) << on_gpu.status().ToString();
    EXPECT_TRUE(on_gpu->prompt_logits.is_cuda());
    EXPECT_EQ(on_gpu->token_ids, on_cpu->token_ids);
    EXPECT_EQ(on_gpu->final_cache_sizes, on_cpu->final_cache_sizes);
    EXPECT_DOUBLE_EQ(on_gpu->mean_kv_tokens, on_cpu->mean_kv_tokens);
    const float prompt_difference = MaxAbsDifference(on_gpu->prompt_logits, on_cpu->prompt_logits);
    const float generated_difference = MaxAbsDifference(on_gpu->generated_logits, on_cpu->generated_logits);
    EXPECT_LT(prompt_difference, 2e-3f);
    EXPECT_LT(generated_difference, 2e-3f);
    if (name != "full cache") {
      EXPECT_LT(on_gpu->final_cache_sizes.front(), 1100 + 23) << "should have evicted";
    }
    std::printf("[ %s ] final cache %lld, max |logit difference| prompt %.2e generated %.2e\n", name.c_str(),
                static_cast<long long>(on_gpu->final_cache_sizes.front()), prompt_difference, generated_difference);
  }
}

// Prefill chunks of 512 rows with a policy that observes nothing take libtorch's fused attention on the GPU
// (LlamaModel::Attend): the same greedy tokens as the CPU's blocks, logits as close as the blocks' are.
TEST(EngineOnCuda, TheFusedAttentionGeneratesWhatTheCpuGenerates) {
  NAMM_REQUIRE_CUDA();
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const LlamaModel cpu = LoadStories(at::kCPU, at::kFloat), gpu = LoadStories(kCuda, at::kFloat);
  const std::unique_ptr<Tokenizer> tokenizer = StoriesTokenizer();
  const std::vector<int64_t> prompt = LongPrompt(*tokenizer, 1100);  // chunks of 512, 512 and 76 rows
  GenerationOptions options = GreedyWithLogits();
  options.chunk_size = 512;
  FullCachePolicy on_cpu_policy, on_gpu_policy;
  auto on_cpu = Generator(cpu, *tokenizer).Generate(prompt, on_cpu_policy, options);
  auto on_gpu = Generator(gpu, *tokenizer).Generate(prompt, on_gpu_policy, options);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status().ToString();
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status().ToString();
  EXPECT_EQ(on_gpu->token_ids, on_cpu->token_ids);
  EXPECT_LT(MaxAbsDifference(on_gpu->prompt_logits, on_cpu->prompt_logits), 2e-3f);
  EXPECT_LT(MaxAbsDifference(on_gpu->generated_logits, on_cpu->generated_logits), 2e-3f);
}

// KV in blocks on the GPU (namm-api's and serve's default): a pool of one slab, read and written by one tensor
// operation per layer and step. The same tokens, cache sizes and logits as the rectangular caches on the GPU.
TEST(EngineOnCuda, KvInBlocksGivesWhatRectangularCachesGive) {
  NAMM_REQUIRE_CUDA();
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  LlamaModel gpu = LoadStories(kCuda, at::kFloat);
  const std::unique_ptr<Tokenizer> tokenizer = StoriesTokenizer();
  const std::vector<int64_t> prompt = LongPrompt(*tokenizer, 1100);
  const GenerationOptions options = GreedyWithLogits();
  for (const auto& [name, make] : Policies()) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(use_kv_blocks(gpu, 0, 0).ok());
    auto rectangular_policy = make(kCuda), blocks_policy = make(kCuda);
    auto rectangular = Generator(gpu, *tokenizer).Generate(prompt, *rectangular_policy, options);
    ASSERT_TRUE(use_kv_blocks(gpu, 16, int64_t{64} << 20).ok());
    auto blocks = Generator(gpu, *tokenizer).Generate(prompt, *blocks_policy, options);
    ASSERT_TRUE(rectangular.ok()) << rectangular.status().ToString();
    ASSERT_TRUE(blocks.ok()) << blocks.status().ToString();
    EXPECT_EQ(blocks->token_ids, rectangular->token_ids);
    EXPECT_EQ(blocks->final_cache_sizes, rectangular->final_cache_sizes);
    const float difference = MaxAbsDifference(blocks->generated_logits, rectangular->generated_logits);
    EXPECT_LT(difference, 1e-4f);
    EXPECT_EQ(gpu.kv_block_pool()->blocks_in_use(), 0);
    std::printf("[ %s ] in blocks: max |logit difference| %.2e\n", name.c_str(), difference);
  }
}

// Mean negative log-likelihood of the prompt's tokens after the first.
double PromptNll(const at::Tensor& prompt_logits, const std::vector<int64_t>& ids) {
  const at::Tensor log_probs = at::log_softmax(prompt_logits.to(at::kCPU).to(at::kDouble), -1);
  double nll = 0;
  for (std::size_t i = 0; i + 1 < ids.size(); ++i) nll -= log_probs[static_cast<int64_t>(i)][ids[i + 1]].item<double>();
  return nll / static_cast<double>(ids.size() - 1);
}

// bf16 and fp16 on the GPU: the prompt's likelihood close to float32's, and the evicting NAMM (features in
// float32 whatever the model's dtype) runs and evicts.
TEST(EngineOnCuda, HalfPrecisionFollowsFloat32) {
  NAMM_REQUIRE_CUDA();
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const std::unique_ptr<Tokenizer> tokenizer = StoriesTokenizer();
  const std::vector<int64_t> prompt = LongPrompt(*tokenizer, 1100);
  GenerationOptions options;
  options.max_new_tokens = 8;
  options.record_logits = true;
  FullCachePolicy full;
  auto reference = Generator(LoadStories(at::kCPU, at::kFloat), *tokenizer).Generate(prompt, full, options);
  ASSERT_TRUE(reference.ok());
  const double reference_nll = PromptNll(reference->prompt_logits, prompt);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const LlamaModel model = LoadStories(kCuda, dtype);
    auto run = Generator(model, *tokenizer).Generate(prompt, full, options);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    const double nll = PromptNll(run->prompt_logits, prompt);
    EXPECT_NEAR(nll, reference_nll, 0.02 * reference_nll + 0.01);
    EXPECT_EQ(run->token_ids.front(), reference->token_ids.front());
    auto namm = NammPolicy::Create(NammWith(0.15, 4), kCuda);
    ASSERT_TRUE(namm.ok());
    auto evicting = Generator(model, *tokenizer).Generate(prompt, **namm, options);
    ASSERT_TRUE(evicting.ok()) << evicting.status().ToString();
    EXPECT_LT(evicting->final_cache_sizes.front(), 1100);
    std::printf("[ %s ] prompt NLL %.4f (float32 on the CPU %.4f); evicting NAMM final cache %lld\n",
                c10::toString(dtype), nll, reference_nll,
                static_cast<long long>(evicting->final_cache_sizes.front()));
  }
}

}  // namespace
}  // namespace namm::worker
