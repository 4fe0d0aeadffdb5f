// The Hugging Face and llama2.c loaders agree: the same random weights written in both formats (Meta's
// interleaved RoPE rows for llama2.c, Hugging Face's permuted rows for safetensors) give the same logits.
#include <ATen/ops/cat.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>

#include "../namm_core/test_util.h"
#include "namm/policies/full_cache_policy.h"
#include "namm/file_util.h"
#include "namm/safetensors.h"
#include "namm/worker/llama_model.h"

namespace namm::worker {
namespace {

constexpr int64_t kDim = 32, kHidden = 48, kLayers = 2, kHeads = 4, kKvHeads = 2, kVocab = 40, kSeqLen = 64;
constexpr int64_t kHeadDim = kDim / kHeads, kKvDim = kKvHeads * kHeadDim;

// Weights in Meta/llama2.c layout (RoPE rotates interleaved pairs of rows).
struct MetaWeights {
  at::Tensor embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, wcls;
};

MetaWeights RandomWeights(uint64_t seed, bool bf16_exact) {
  uint64_t s = seed;
  auto round = [&](at::Tensor t) { return bf16_exact ? t.to(at::kBFloat16).to(at::kFloat) : t; };
  auto r = [&](std::vector<int64_t> shape, double scale) {
    return round(testing::RandomNormal(std::move(shape), s++, scale));
  };
  auto norm = [&](std::vector<int64_t> shape) { return round(testing::RandomNormal(std::move(shape), s++, 0.1).add_(1.0)); };
  return {r({kVocab, kDim}, 0.5), norm({kLayers, kDim}), r({kLayers, kDim, kDim}, 0.2), r({kLayers, kKvDim, kDim}, 0.2),
          r({kLayers, kKvDim, kDim}, 0.2), r({kLayers, kDim, kDim}, 0.2), norm({kLayers, kDim}),
          r({kLayers, kHidden, kDim}, 0.2), r({kLayers, kDim, kHidden}, 0.2), r({kLayers, kHidden, kDim}, 0.2),
          norm({kDim}), r({kVocab, kDim}, 0.5)};
}

std::string Bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel() * c.element_size()));
}

void WriteLlama2c(const std::string& path, const MetaWeights& w, bool shared_classifier) {
  const int32_t header[7] = {kDim, kHidden, kLayers, kHeads, kKvHeads, static_cast<int32_t>(shared_classifier ? kVocab : -kVocab),
                             kSeqLen};
  std::vector<std::string> parts = {std::string(reinterpret_cast<const char*>(header), sizeof header)};
  for (const at::Tensor* t : {&w.embedding, &w.rms_att, &w.wq, &w.wk, &w.wv, &w.wo, &w.rms_ffn, &w.w1, &w.w2, &w.w3,
                              &w.rms_final}) {
    parts.push_back(Bytes(*t));
  }
  parts.push_back(std::string(static_cast<std::size_t>(2 * kSeqLen * kHeadDim / 2 * 4), '\0'));  // RoPE tables
  if (!shared_classifier) parts.push_back(Bytes(w.wcls));
  std::vector<std::string_view> views(parts.begin(), parts.end());
  ASSERT_TRUE(write_file_atomically(path, views).ok());
}

// Hugging Face's conversion permutation, written out independently of the loader.
at::Tensor HfPermute(const at::Tensor& w, int64_t heads) {
  return w.reshape({heads, w.size(0) / heads / 2, 2, w.size(1)}).transpose(1, 2).reshape(w.sizes());
}

struct HfFile {
  std::string name;
  at::ScalarType dtype;
};

// Writes config.json and the weights, split over `shards` files (an index when more than one).
void WriteHf(const std::string& dir, const MetaWeights& w, bool tied, at::ScalarType dtype, int shards,
             const std::string& architecture = "LlamaForCausalLM", const std::string& drop = "") {
  ::mkdir(dir.c_str(), 0755);
  const std::string config = std::string(R"({"architectures": [")") + architecture + R"("], "hidden_size": )" +
                             std::to_string(kDim) + R"(, "intermediate_size": )" + std::to_string(kHidden) +
                             R"(, "num_hidden_layers": )" + std::to_string(kLayers) + R"(, "num_attention_heads": )" +
                             std::to_string(kHeads) + R"(, "num_key_value_heads": )" + std::to_string(kKvHeads) +
                             R"(, "vocab_size": )" + std::to_string(kVocab) + R"(, "max_position_embeddings": )" +
                             std::to_string(kSeqLen) + R"(, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                             "tie_word_embeddings": )" + (tied ? "true" : "false") + R"(, "bos_token_id": 1,
                             "eos_token_id": 2})";
  ASSERT_TRUE(write_file_atomically(dir + "/config.json", {config}).ok());
  std::vector<std::pair<std::string, at::Tensor>> tensors = {{"model.embed_tokens.weight", w.embedding},
                                                             {"model.norm.weight", w.rms_final}};
  if (!tied) tensors.push_back({"lm_head.weight", w.wcls});
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    tensors.push_back({p + "input_layernorm.weight", w.rms_att[l]});
    tensors.push_back({p + "self_attn.q_proj.weight", HfPermute(w.wq[l], kHeads)});
    tensors.push_back({p + "self_attn.k_proj.weight", HfPermute(w.wk[l], kKvHeads)});
    tensors.push_back({p + "self_attn.v_proj.weight", w.wv[l]});
    tensors.push_back({p + "self_attn.o_proj.weight", w.wo[l]});
    tensors.push_back({p + "post_attention_layernorm.weight", w.rms_ffn[l]});
    tensors.push_back({p + "mlp.gate_proj.weight", w.w1[l]});
    tensors.push_back({p + "mlp.down_proj.weight", w.w2[l]});
    tensors.push_back({p + "mlp.up_proj.weight", w.w3[l]});
  }
  const DType file_dtype = dtype == at::kBFloat16 ? DType::kBF16 : dtype == at::kHalf ? DType::kF16 : DType::kF32;
  std::string index = R"({"metadata": {}, "weight_map": {)";
  std::vector<std::vector<SafetensorWrite>> per_shard(static_cast<std::size_t>(shards));
  std::vector<at::Tensor> keep_alive;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].first == drop) continue;
    const auto shard = i % static_cast<std::size_t>(shards);
    keep_alive.push_back(tensors[i].second.to(dtype).contiguous());
    per_shard[shard].push_back({tensors[i].first, file_dtype, keep_alive.back().sizes().vec(), keep_alive.back().data_ptr()});
    index += (index.back() == '{' ? "\"" : ", \"") + tensors[i].first + "\": \"model-" + std::to_string(shard) + ".safetensors\"";
  }
  index += "}}";
  if (shards == 1) {
    ASSERT_TRUE(write_safetensors(dir + "/model.safetensors", per_shard[0], {{"format", "pt"}}).ok());
  } else {
    for (int s = 0; s < shards; ++s) {
      ASSERT_TRUE(write_safetensors(dir + "/model-" + std::to_string(s) + ".safetensors",
                                    per_shard[static_cast<std::size_t>(s)], {{"format", "pt"}}).ok());
    }
    ASSERT_TRUE(write_file_atomically(dir + "/model.safetensors.index.json", {index}).ok());
  }
}

at::Tensor Logits(const std::string& path) {
  auto model = LlamaModel::Load(path, LoadOptions{});
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  FullCachePolicy full;
  auto caches = model->NewCaches(full);
  const at::Tensor tokens = testing::RandomNormal({kSeqLen}, 5).abs().mul(10).to(at::kLong).remainder(kVocab);
  auto logits = model->Forward(tokens, caches, full, /*all_logits=*/true);
  EXPECT_TRUE(logits.ok());
  return *logits;
}

TEST(ModelLoading, HuggingFaceAndLlama2cGiveTheSameLogits) {
  const std::string base = testing::TempPath("loaders");
  ::mkdir(base.c_str(), 0755);
  const MetaWeights w = RandomWeights(100, false);
  WriteLlama2c(base + "/model.bin", w, /*shared_classifier=*/true);
  WriteHf(base + "/hf", w, /*tied=*/true, at::kFloat, 1);
  const at::Tensor a = Logits(base + "/model.bin"), b = Logits(base + "/hf");
  EXPECT_EQ(a.sizes(), (at::IntArrayRef{kSeqLen, kVocab}));
  EXPECT_LT((a - b).abs().max().item<float>(), 1e-5f);
  EXPECT_GT(a.std().item<float>(), 0.1f);  // not a degenerate model
}

TEST(ModelLoading, ShardedBf16WithUntiedHeadMatchesToo) {
  const std::string base = testing::TempPath("loaders16");
  ::mkdir(base.c_str(), 0755);
  const MetaWeights w = RandomWeights(200, /*bf16_exact=*/true);
  WriteLlama2c(base + "/model.bin", w, /*shared_classifier=*/false);
  WriteHf(base + "/hf", w, /*tied=*/false, at::kBFloat16, 3);
  EXPECT_LT((Logits(base + "/model.bin") - Logits(base + "/hf")).abs().max().item<float>(), 1e-5f);
  WriteHf(base + "/hf16", w, /*tied=*/false, at::kHalf, 2);
  EXPECT_LT((Logits(base + "/model.bin") - Logits(base + "/hf16")).abs().max().item<float>(), 1e-2f);
}

TEST(ModelLoading, RefusesBrokenModelsWithAClearMessage) {
  const std::string base = testing::TempPath("broken");
  ::mkdir(base.c_str(), 0755);
  const MetaWeights w = RandomWeights(300, false);
  WriteHf(base + "/missing", w, true, at::kFloat, 1, "LlamaForCausalLM", "model.layers.1.mlp.up_proj.weight");
  auto missing = LlamaModel::Load(base + "/missing", LoadOptions{});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("missing tensors: model.layers.1.mlp.up_proj.weight"), std::string::npos)
      << missing.status().message();

  WriteHf(base + "/neox", w, true, at::kFloat, 1, "GPTNeoXForCausalLM");
  auto neox = LlamaModel::Load(base + "/neox", LoadOptions{});
  ASSERT_FALSE(neox.ok());
  EXPECT_NE(neox.status().message().find("architecture GPTNeoXForCausalLM is not supported"), std::string::npos);

  WriteLlama2c(base + "/model.bin", w, true);
  auto bytes = read_file(base + "/model.bin");
  ASSERT_TRUE(write_file_atomically(base + "/truncated.bin", {std::string_view(*bytes).substr(0, bytes->size() - 10)}).ok());
  auto truncated = LlamaModel::Load(base + "/truncated.bin", LoadOptions{});
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.status().message().find("the header implies"), std::string::npos);

  auto absent = LlamaModel::Load(base + "/nothing-here", LoadOptions{});
  ASSERT_FALSE(absent.ok());
  EXPECT_EQ(absent.status().code(), Status::Code::kNotFound);
  auto empty_dir = LlamaModel::Load(base, LoadOptions{});
  ASSERT_FALSE(empty_dir.ok());
  EXPECT_NE(empty_dir.status().message().find("config.json"), std::string::npos);
}

}  // namespace
}  // namespace namm::worker
