// Every supported model family against a forward pass written independently in numpy
// (tests/worker/hf_family_reference.py): a tiny random Hugging Face directory per case, the prompt's logits,
// then a greedy continuation decoded token by token with the KV cache.
#include <ATen/ops/cat.h>
#include <gtest/gtest.h>

#include <cstdio>

#include "../process_util.h"
#include "../temp_path.h"
#include "namm/file_util.h"
#include "namm/npy.h"
#include "namm/safetensors.h"
#include "namm/policies/full_cache_policy.h"
#include "namm/worker/llama_model.h"

namespace namm::worker {
namespace {

// Logits are O(10); float32 against float64 leaves ~1e-5.
constexpr float kTolerance = 2e-4f;

// The case's directory, written by the numpy reference; "" (and the test skipped) without numpy.
std::string MakeCase(const std::string& name) {
  const std::string dir = testing::TempPath("family_" + name);
  EXPECT_TRUE(remove_tree(dir).ok());
  const std::string log = dir + ".log";
  testing::Child child = testing::Spawn({NAMM_SYSTEM_PYTHON, NAMM_SOURCE_DIR "/tests/worker/hf_family_reference.py", name, dir}, log);
  const int exit_code = testing::Wait(child, std::chrono::seconds(120));
  const std::string output = testing::ReadText(log);
  if (exit_code != 0 && output.find("No module named 'numpy'") != std::string::npos) return "";
  EXPECT_EQ(exit_code, 0) << output;
  return dir;
}

at::Tensor Npy(const std::string& path) {
  auto t = read_npy(path);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? *t : at::Tensor();
}

class ModelFamily : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelFamily, MatchesNumpyLogitsAndGreedyTokens) {
  const std::string dir = MakeCase(GetParam());
  if (dir.empty()) GTEST_SKIP() << NAMM_SYSTEM_PYTHON " has no numpy (scripts/install-deps.sh installs python3-numpy)";
  auto model = LlamaModel::Load(dir, LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const at::Tensor prompt = Npy(dir + "/prompt.npy"), tokens = Npy(dir + "/tokens.npy"), expected = Npy(dir + "/logits.npy");
  const int64_t p = prompt.size(0), g = tokens.size(0);
  ASSERT_EQ(expected.size(0), p + g);

  // As the reference: the prompt in one call, then one call per token, each greedy token chosen by us.
  FullCachePolicy full;
  auto caches = model->NewCaches(full);
  auto logits = model->Forward(prompt, caches, full, /*all_logits=*/true);
  ASSERT_TRUE(logits.ok()) << logits.status().ToString();
  EXPECT_LT((*logits - expected.narrow(0, 0, p)).abs().max().item<float>(), kTolerance);
  at::Tensor last = logits->narrow(0, p - 1, 1);
  for (int64_t i = 0; i < g; ++i) {
    const int64_t token = last.argmax(-1).item<int64_t>();
    ASSERT_EQ(token, tokens[i].item<int64_t>()) << "greedy token " << i;
    auto next = model->Forward(tokens.narrow(0, i, 1), caches, full, /*all_logits=*/true);
    ASSERT_TRUE(next.ok()) << next.status().ToString();
    EXPECT_LT((*next - expected.narrow(0, p + i, 1)).abs().max().item<float>(), kTolerance) << "after token " << i;
    last = *next;
  }
  EXPECT_GT(expected.std().item<float>(), 0.5f);  // not a degenerate model

  // A prompt prefilled in chunks gives the same logits: the window and the causal mask hold across chunks. Not
  // under dynamic NTK, where each call's length sets the rotation of the keys it adds (rope.h).
  if (model->config().rope_scaling.kind == RopeScaling::Kind::kDynamic) return;
  auto chunked_caches = model->NewCaches(full);
  std::vector<at::Tensor> rows;
  for (int64_t begin = 0; begin < p; begin += 7) {
    auto chunk = model->Forward(prompt.narrow(0, begin, std::min<int64_t>(7, p - begin)), chunked_caches, full, true);
    ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
    rows.push_back(*chunk);
  }
  EXPECT_LT((at::cat(rows) - expected.narrow(0, 0, p)).abs().max().item<float>(), kTolerance);
}

INSTANTIATE_TEST_SUITE_P(Families, ModelFamily,
                         ::testing::Values("llama3_rope", "llama3_rope_parameters", "qwen2_yarn", "llama_yarn_untruncated", "llama_dynamic",
                                           "qwen2", "qwen2_window", "qwen3", "mistral_window"));

// What each family's config turns on, and what is refused.
LlamaConfig Parse(const std::string& json) {
  auto config = parse_hf_config(json, "config.json");
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  return config.ok() ? *config : LlamaConfig{};
}

const char* kShape = R"("hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64)";

TEST(ModelFamilyConfig, EachFamilySetsItsSwitches) {
  const LlamaConfig qwen2 = Parse(std::string("{") + kShape + R"(, "architectures": ["Qwen2ForCausalLM"],
      "use_sliding_window": false, "sliding_window": 32768, "max_window_layers": 2})");
  EXPECT_TRUE(qwen2.qkv_bias);
  EXPECT_FALSE(qwen2.o_bias);
  EXPECT_EQ(qwen2.window_of(3), 0);  // use_sliding_window false: the window in the config is not used

  const LlamaConfig windowed = Parse(std::string("{") + kShape + R"(, "architectures": ["Qwen2ForCausalLM"],
      "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 2})");
  EXPECT_EQ(windowed.window_of(1), 0);
  EXPECT_EQ(windowed.window_of(2), 16);

  // No architectures: model_type names the family.
  const LlamaConfig qwen3 = Parse(std::string("{") + kShape + R"(, "model_type": "qwen3", "head_dim": 16})");
  EXPECT_EQ(qwen3.architecture, "Qwen3ForCausalLM");
  EXPECT_TRUE(qwen3.qk_norm);
  EXPECT_FALSE(qwen3.qkv_bias);
  EXPECT_EQ(qwen3.head_dim, 16);

  const LlamaConfig mistral = Parse(std::string("{") + kShape + R"(, "architectures": ["MistralForCausalLM"],
      "sliding_window": 8})");
  EXPECT_EQ(mistral.window_of(0), 8);
  EXPECT_EQ(mistral.window_of(3), 8);

  const LlamaConfig llama = Parse(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "attention_bias": true, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 64}})");
  EXPECT_TRUE(llama.qkv_bias && llama.o_bias);
  EXPECT_EQ(llama.context_length(), 256);
}

// transformers v5 writes RoPE's settings as one rope_parameters object and leaves rope_theta and rope_scaling out;
// read as the older keys, such a model ran with theta 10000 and no scaling, silently.
TEST(ModelFamilyConfig, ReadsRopeParametersAsTransformersV5WritesThem) {
  const LlamaConfig v5 = Parse(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}})");
  EXPECT_EQ(v5.rope_theta, 500000.0);
  EXPECT_EQ(v5.rope_scaling.kind, RopeScaling::Kind::kLlama3);
  EXPECT_EQ(v5.rope_scaling.factor, 8.0);
  EXPECT_EQ(v5.rope_scaling.original_max_position_embeddings, 16);
  const LlamaConfig plain = Parse(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}})");
  EXPECT_EQ(plain.rope_theta, 1000000.0);  // rope_parameters is what transformers reads
  EXPECT_EQ(plain.rope_scaling.kind, RopeScaling::Kind::kNone);
  const auto per_layer = parse_hf_config(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})", "config.json");
  ASSERT_FALSE(per_layer.ok());
  EXPECT_NE(per_layer.status().message().find("per layer type"), std::string::npos) << per_layer.status().ToString();
}

// Keys a config leaves out take transformers' defaults for the family.
TEST(ModelFamilyConfig, AbsentKeysTakeTransformersDefaults) {
  const LlamaConfig llama = Parse(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"]})");
  EXPECT_EQ(llama.norm_eps, 1e-6);
  EXPECT_EQ(llama.window_of(3), 0);
  const LlamaConfig mistral = Parse(std::string("{") + kShape + R"(, "architectures": ["MistralForCausalLM"]})");
  EXPECT_EQ(mistral.window_of(0), 4096);
  const LlamaConfig mistral_null = Parse(std::string("{") + kShape + R"(, "architectures": ["MistralForCausalLM"],
      "sliding_window": null})");
  EXPECT_EQ(mistral_null.window_of(0), 0);
  const LlamaConfig qwen = Parse(R"({"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 30,
      "num_attention_heads": 4, "vocab_size": 64, "max_position_embeddings": 64, "architectures": ["Qwen2ForCausalLM"],
      "use_sliding_window": true})");
  EXPECT_EQ(qwen.window_of(27), 0);
  EXPECT_EQ(qwen.window_of(28), 4096);
}

TEST(ModelFamilyConfig, RefusesWhatItDoesNotRunNamingTheSupportedFamilies) {
  auto refused = [](const std::string& json) {
    auto config = parse_hf_config(json, "config.json");
    EXPECT_FALSE(config.ok()) << json;
    return config.ok() ? std::string() : config.status().message();
  };
  const std::string gemma = refused(std::string("{") + kShape + R"(, "architectures": ["Gemma2ForCausalLM"]})");
  EXPECT_NE(gemma.find("Gemma2ForCausalLM is not supported"), std::string::npos) << gemma;
  EXPECT_NE(gemma.find("LlamaForCausalLM (llama), MistralForCausalLM (mistral), Qwen2ForCausalLM (qwen2), "
                       "Qwen3ForCausalLM (qwen3)"),
            std::string::npos)
      << gemma;
  const std::string phi = refused(std::string("{") + kShape + R"(, "model_type": "phi3"})");
  EXPECT_NE(phi.find("model_type 'phi3' is not supported"), std::string::npos) << phi;
  EXPECT_NE(refused(std::string("{") + kShape + "}").find("names no architecture"), std::string::npos);
  const std::string deepseek = refused(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}})");
  EXPECT_NE(deepseek.find("'mscale'"), std::string::npos) << deepseek;
  const std::string longrope = refused(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})");
  EXPECT_NE(longrope.find("'longrope' is not supported"), std::string::npos) << longrope;
  EXPECT_NE(refused(std::string("{") + kShape + R"(, "architectures": ["MistralForCausalLM"], "sliding_window": 0})")
                .find("sliding_window"),
            std::string::npos);
  // An MLP other than SwiGLU, and RoPE scalings whose factor is missing or not a number (which scaled nothing).
  const std::string gelu = refused(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "hidden_act": "gelu"})");
  EXPECT_NE(gelu.find("hidden_act \"gelu\" is not supported"), std::string::npos) << gelu;
  const std::string no_factor = refused(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "rope_scaling": {"type": "linear"}})");
  EXPECT_NE(no_factor.find("rope_scaling of type 'linear' needs a factor"), std::string::npos) << no_factor;
  const std::string text_factor = refused(std::string("{") + kShape + R"(, "architectures": ["Qwen2ForCausalLM"],
      "rope_scaling": {"type": "yarn", "factor": "4.0", "original_max_position_embeddings": 64}})");
  EXPECT_NE(text_factor.find("rope_scaling.factor must be a number"), std::string::npos) << text_factor;
  // An unsupported type is named as such, factor or not (Phi-3.5's longrope has none).
  const std::string longrope_no_factor = refused(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}})");
  EXPECT_NE(longrope_no_factor.find("type 'longrope' is not supported"), std::string::npos) << longrope_no_factor;
  Parse(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"], "hidden_act": "swish"})");
  const std::string text_beta = refused(std::string("{") + kShape + R"(, "architectures": ["LlamaForCausalLM"],
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": "32"}})");
  EXPECT_NE(text_beta.find("rope_parameters.beta_fast must be a number"), std::string::npos) << text_beta;
}

// A config's numbers cannot make the loader allocate or loop past what a model could be, or convert out of range.
TEST(ModelFamilyConfig, RefusesNumbersNoModelHas) {
  const std::string llama = R"("architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
      "num_attention_heads": 8, "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0)";
  for (const auto& [json, says] : std::vector<std::pair<std::string, std::string>>{
           {R"("num_hidden_layers": 1000000000000, "max_position_embeddings": 512)", "dimensions over the limits"},
           {R"("num_hidden_layers": 2, "max_position_embeddings": 9000000000000)", "max_position_embeddings must be in"},
           {R"("num_hidden_layers": 2, "max_position_embeddings": 512, "rope_scaling": {"rope_type": "yarn",
               "factor": 4.0, "original_max_position_embeddings": 1e300})", "original_max_position_embeddings must be in"},
           {R"("num_hidden_layers": 2, "max_position_embeddings": 512, "rope_scaling": {"rope_type": "linear",
               "factor": 1e30})", "stretches the context past"}}) {
    const auto config = parse_hf_config("{" + llama + ", " + json + "}", "config.json");
    ASSERT_FALSE(config.ok()) << json;
    EXPECT_NE(config.status().message().find(says), std::string::npos) << config.status().ToString();
  }
}

TEST(ModelFamilyConfig, Qwen3WithoutItsNormWeightsIsRefused) {
  const std::string dir = MakeCase("qwen3");
  if (dir.empty()) GTEST_SKIP() << NAMM_SYSTEM_PYTHON " has no numpy";
  // Rewrites the weights without the q/k norms: a Qwen3 checkpoint missing them is not silently run as Llama.
  {
    auto file = SafetensorsFile::Open(dir + "/model.safetensors");
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    std::vector<SafetensorWrite> kept;
    for (const SafetensorInfo& t : file->tensors()) {
      if (t.name.find("_norm.weight") != std::string::npos && t.name.find("self_attn") != std::string::npos) continue;
      kept.push_back({t.name, t.dtype, t.shape, file->data(t)});
    }
    ASSERT_EQ(kept.size() + 2 * 2, file->tensors().size());  // q_norm and k_norm of 2 layers
    ASSERT_TRUE(write_safetensors(dir + "/pruned.safetensors", kept, {}).ok());
  }
  ASSERT_EQ(std::rename((dir + "/pruned.safetensors").c_str(), (dir + "/model.safetensors").c_str()), 0);
  auto model = LlamaModel::Load(dir, LoadOptions{});
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("missing tensors: model.layers.0.self_attn.q_norm.weight, "
                                          "model.layers.0.self_attn.k_norm.weight"),
            std::string::npos)
      << model.status().message();
}

}  // namespace
}  // namespace namm::worker
