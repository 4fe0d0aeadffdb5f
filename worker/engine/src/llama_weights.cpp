#include "namm/worker/llama_weights.h"

#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "aten.h"
#include "namm/dtype.h"
#include "namm/file_util.h"
#include "namm/json_util.h"
#include "namm/safetensors.h"

namespace namm::worker {

namespace {

std::optional<at::ScalarType> TorchType(DType dtype) {
  switch (dtype) {
    case DType::kF32: return at::kFloat;
    case DType::kF16: return at::kHalf;
    case DType::kBF16: return at::kBFloat16;
    case DType::kF64: return at::kDouble;
    default: return std::nullopt;
  }
}

// The tensors of a Hugging Face checkpoint, over one or several safetensors shards.
class HfTensorSource {
 public:
  static Result<HfTensorSource> Open(const std::string& dir) {
    HfTensorSource source;
    const std::string single = dir + "/model.safetensors";
    const std::string index = dir + "/model.safetensors.index.json";
    std::vector<std::string> shard_names;
    if (path_exists(index)) {
      NAMM_ASSIGN_OR_RETURN(std::string text, read_file(index));
      NAMM_ASSIGN_OR_RETURN(const nlohmann::json j, parse_json_bounded(text, index));
      if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
        return Status::Corruption(index + ": missing 'weight_map'");
      }
      std::map<std::string, std::size_t> shard_of_file;
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        if (!it->is_string()) return Status::Corruption(index + ": weight_map['" + it.key() + "'] is not a string");
        const std::string file = it->get<std::string>();
        if (file.find('/') != std::string::npos) return Status::Corruption(index + ": shard path '" + file + "' leaves the directory");
        auto [pos, inserted] = shard_of_file.emplace(file, shard_names.size());
        if (inserted) shard_names.push_back(file);
        source.shard_of_tensor_[it.key()] = pos->second;
      }
    } else if (path_exists(single)) {
      shard_names.push_back("model.safetensors");
    } else {
      std::string hint = path_exists(dir + "/pytorch_model.bin") ? " (pytorch_model.bin is not supported: convert it to safetensors)" : "";
      return Status::NotFound(dir + ": no model.safetensors or model.safetensors.index.json" + hint);
    }
    for (const auto& name : shard_names) {
      NAMM_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(dir + "/" + name));
      source.shards_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    }
    return source;
  }

  // The tensor `name`, checked against `shape`, converted to `options`; an undefined tensor if absent.
  Result<at::Tensor> Get(const std::string& name, const std::vector<int64_t>& shape, const at::TensorOptions& options) const {
    const SafetensorsFile* file = nullptr;
    const SafetensorInfo* info = nullptr;
    auto it = shard_of_tensor_.find(name);
    if (it != shard_of_tensor_.end()) {
      file = shards_[it->second].get();
      info = file->find(name);
      if (info == nullptr) return Status::Corruption(file->path() + ": the index places '" + name + "' here but it is missing");
    } else {
      for (const auto& shard : shards_) {
        if ((info = shard->find(name)) != nullptr) {
          file = shard.get();
          break;
        }
      }
    }
    if (info == nullptr) return at::Tensor();
    auto type = TorchType(info->dtype);
    if (!type) {
      return Status::Unimplemented(file->path() + ": tensor '" + name + "' has dtype " + safetensors_dtype_name(info->dtype) +
                                   " (supported: F32, F16, BF16)");
    }
    if (info->shape != shape) {
      return Status::Corruption(file->path() + ": tensor '" + name + "' has shape " + shape_to_string(info->shape) +
                                ", the config implies " + shape_to_string(shape));
    }
    at::Tensor raw = at::empty(shape, at::TensorOptions().dtype(*type).device(at::kCPU));
    if (info->bytes > 0) std::memcpy(raw.data_ptr(), file->data(*info), info->bytes);  // the mapping may be unaligned
    return raw.to(options);
  }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, std::size_t> shard_of_tensor_;
};

Status ApplyOverrides(const LoadOptions& options, LlamaConfig* config) {
  if (options.rope_scaling) config->rope_scaling = *options.rope_scaling;
  return config->Validate();
}

// Reads the BOS/EOS ids that generation_config.json adds (it overrides config.json in transformers).
void ReadGenerationConfig(const std::string& dir, LlamaConfig* config) {
  auto text = read_file(dir + "/generation_config.json");
  if (!text.ok()) return;
  const Result<nlohmann::json> j = parse_json_bounded(*text, "generation_config.json");
  if (!j.ok() || !j->is_object()) return;
  const nlohmann::json& config_json = *j;
  auto ids = [](const nlohmann::json& v) {
    std::vector<int64_t> out;
    if (v.is_number_integer()) out.push_back(v.get<int64_t>());
    if (v.is_array()) for (const auto& x : v) if (x.is_number_integer()) out.push_back(x.get<int64_t>());
    return out;
  };
  const auto read = [&](const char* key, std::vector<int64_t>* out) {
    if (config_json.contains(key) && !ids(config_json[key]).empty()) *out = ids(config_json[key]);
  };
  read("eos_token_id", &config->eos_token_ids);
  read("bos_token_id", &config->bos_token_ids);
}

}  // namespace

at::Tensor interleaved_to_rotate_half(const at::Tensor& weight, int64_t heads) {
  const int64_t rows = weight.size(0), cols = weight.size(1), half = rows / heads / 2;
  return weight.reshape({heads, half, 2, cols}).transpose(1, 2).reshape({rows, cols});
}

Result<LoadedModel> load_hf_model(const std::string& dir, const LoadOptions& options) {
  NAMM_ASSIGN_OR_RETURN(std::string config_text, read_file(dir + "/config.json"));
  LoadedModel model;
  NAMM_ASSIGN_OR_RETURN(model.config, parse_hf_config(config_text, dir + "/config.json"));
  ReadGenerationConfig(dir, &model.config);
  NAMM_RETURN_IF_ERROR(ApplyOverrides(options, &model.config));
  NAMM_ASSIGN_OR_RETURN(HfTensorSource source, HfTensorSource::Open(dir));

  const LlamaConfig& c = model.config;
  const auto to = at::TensorOptions().dtype(options.dtype).device(options.device);
  std::vector<std::string> missing;
  auto get = [&](const std::string& name, std::vector<int64_t> shape, bool required = true) -> Result<at::Tensor> {
    NAMM_ASSIGN_OR_RETURN(at::Tensor t, source.Get(name, shape, to));
    if (!t.defined() && required) missing.push_back(name);
    return t;
  };
  const int64_t q_out = c.n_heads * c.head_dim, kv_out = c.n_kv_heads * c.head_dim;
  LlamaWeights& w = model.weights;
  NAMM_ASSIGN_OR_RETURN(w.token_embedding, get("model.embed_tokens.weight", {c.vocab_size, c.dim}));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LlamaLayerWeights layer;
    NAMM_ASSIGN_OR_RETURN(layer.attention_norm, get(p + "input_layernorm.weight", {c.dim}));
    NAMM_ASSIGN_OR_RETURN(layer.wq, get(p + "self_attn.q_proj.weight", {q_out, c.dim}));
    NAMM_ASSIGN_OR_RETURN(layer.wk, get(p + "self_attn.k_proj.weight", {kv_out, c.dim}));
    NAMM_ASSIGN_OR_RETURN(layer.wv, get(p + "self_attn.v_proj.weight", {kv_out, c.dim}));
    NAMM_ASSIGN_OR_RETURN(layer.wo, get(p + "self_attn.o_proj.weight", {c.dim, q_out}));
    if (c.qkv_bias) {
      NAMM_ASSIGN_OR_RETURN(layer.bq, get(p + "self_attn.q_proj.bias", {q_out}));
      NAMM_ASSIGN_OR_RETURN(layer.bk, get(p + "self_attn.k_proj.bias", {kv_out}));
      NAMM_ASSIGN_OR_RETURN(layer.bv, get(p + "self_attn.v_proj.bias", {kv_out}));
    }
    if (c.o_bias) {
      NAMM_ASSIGN_OR_RETURN(layer.bo, get(p + "self_attn.o_proj.bias", {c.dim}));
    }
    if (c.qk_norm) {
      NAMM_ASSIGN_OR_RETURN(layer.q_norm, get(p + "self_attn.q_norm.weight", {c.head_dim}));
      NAMM_ASSIGN_OR_RETURN(layer.k_norm, get(p + "self_attn.k_norm.weight", {c.head_dim}));
    }
    NAMM_ASSIGN_OR_RETURN(layer.ffn_norm, get(p + "post_attention_layernorm.weight", {c.dim}));
    NAMM_ASSIGN_OR_RETURN(layer.w_gate, get(p + "mlp.gate_proj.weight", {c.hidden_dim, c.dim}));
    NAMM_ASSIGN_OR_RETURN(layer.w_up, get(p + "mlp.up_proj.weight", {c.hidden_dim, c.dim}));
    NAMM_ASSIGN_OR_RETURN(layer.w_down, get(p + "mlp.down_proj.weight", {c.dim, c.hidden_dim}));
    if (c.mlp_bias) {
      NAMM_ASSIGN_OR_RETURN(layer.b_gate, get(p + "mlp.gate_proj.bias", {c.hidden_dim}));
      NAMM_ASSIGN_OR_RETURN(layer.b_up, get(p + "mlp.up_proj.bias", {c.hidden_dim}));
      NAMM_ASSIGN_OR_RETURN(layer.b_down, get(p + "mlp.down_proj.bias", {c.dim}));
    }
    w.layers.push_back(std::move(layer));
  }
  NAMM_ASSIGN_OR_RETURN(w.final_norm, get("model.norm.weight", {c.dim}));
  NAMM_ASSIGN_OR_RETURN(w.lm_head, get("lm_head.weight", {c.vocab_size, c.dim}, !c.tie_word_embeddings));
  if (!w.lm_head.defined()) w.lm_head = w.token_embedding;
  if (!missing.empty()) {
    std::string list;
    for (std::size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 8) list += ", ... (" + std::to_string(missing.size()) + " in all)";
    return Status::Corruption(dir + ": missing tensors: " + list);
  }
  return model;
}

Result<LoadedModel> load_llama2c_model(const std::string& path, const LoadOptions& options) {
  NAMM_ASSIGN_OR_RETURN(std::string bytes, read_file(path));
  auto corrupt = [&](const std::string& what) { return Status::Corruption(path + ": " + what); };
  if (bytes.size() < 28) return corrupt("too short for a llama2.c header (28 bytes)");
  int32_t header[7];
  std::memcpy(header, bytes.data(), sizeof header);
  LoadedModel model;
  LlamaConfig& c = model.config;
  c.architecture = "llama2.c";
  c.dim = header[0];
  c.hidden_dim = header[1];
  c.n_layers = header[2];
  c.n_heads = header[3];
  c.n_kv_heads = header[4];
  const bool shared_classifier = header[5] > 0;
  c.vocab_size = header[5] > 0 ? header[5] : -static_cast<int64_t>(header[5]);
  c.max_position_embeddings = header[6];
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  c.norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = shared_classifier;
  c.bos_token_ids = {1};
  // llama2.c's run.c ends a sequence at BOS (EOS kept too): its TinyStories data delimits stories with BOS, so a
  // story's end is a BOS (which decoding drops), and generating past it starts another story.
  c.eos_token_ids = {2, 1};
  if (c.dim <= 0 || c.hidden_dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.vocab_size <= 0 || c.max_position_embeddings <= 0 || c.dim % c.n_heads != 0 || c.n_layers > 4096 ||
      c.dim > (1 << 20) || c.hidden_dim > (1 << 22)) {
    return corrupt("implausible header (dim " + std::to_string(c.dim) + ", hidden " + std::to_string(c.hidden_dim) +
                   ", layers " + std::to_string(c.n_layers) + ", heads " + std::to_string(c.n_heads) + "/" +
                   std::to_string(c.n_kv_heads) + ", vocab " + std::to_string(header[5]) + ", seq_len " +
                   std::to_string(c.max_position_embeddings) + "): not a llama2.c checkpoint?");
  }
  NAMM_RETURN_IF_ERROR(ApplyOverrides(options, &c));

  const int64_t L = c.n_layers, dim = c.dim, kv_dim = c.n_kv_heads * c.head_dim, hidden = c.hidden_dim;
  const int64_t rope_table = c.max_position_embeddings * c.head_dim / 2;
  const int64_t floats = c.vocab_size * dim + L * dim + L * dim * dim + 2 * L * kv_dim * dim + L * dim * dim + L * dim +
                         3 * L * hidden * dim + dim + 2 * rope_table + (shared_classifier ? 0 : c.vocab_size * dim);
  const auto expected = static_cast<std::size_t>(28 + 4 * floats);
  if (bytes.size() != expected) {
    return corrupt("the header implies " + std::to_string(expected) + " bytes but the file has " +
                   std::to_string(bytes.size()) + " (truncated or not a legacy llama2.c checkpoint)");
  }
  const auto to = at::TensorOptions().dtype(options.dtype).device(options.device);
  std::size_t offset = 28;
  auto take = [&](std::vector<int64_t> shape) {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
    std::memcpy(t.data_ptr(), bytes.data() + offset, static_cast<std::size_t>(t.numel()) * 4);
    offset += static_cast<std::size_t>(t.numel()) * 4;
    return t;
  };
  LlamaWeights& w = model.weights;
  w.token_embedding = take({c.vocab_size, dim});
  at::Tensor rms_att = take({L, dim}), wq = take({L, dim, dim}), wk = take({L, kv_dim, dim}), wv = take({L, kv_dim, dim}),
             wo = take({L, dim, dim}), rms_ffn = take({L, dim}), w1 = take({L, hidden, dim}), w2 = take({L, dim, hidden}),
             w3 = take({L, hidden, dim});
  w.final_norm = take({dim}).to(to);
  offset += static_cast<std::size_t>(2 * rope_table) * 4;  // precomputed RoPE tables: recomputed instead
  w.lm_head = shared_classifier ? w.token_embedding : take({c.vocab_size, dim});
  w.token_embedding = w.token_embedding.to(to);
  w.lm_head = shared_classifier ? w.token_embedding : w.lm_head.to(to);
  for (int64_t l = 0; l < L; ++l) {
    LlamaLayerWeights layer;
    layer.attention_norm = rms_att[l].to(to);
    layer.wq = interleaved_to_rotate_half(wq[l], c.n_heads).to(to);
    layer.wk = interleaved_to_rotate_half(wk[l], c.n_kv_heads).to(to);
    layer.wv = wv[l].to(to);
    layer.wo = wo[l].to(to);
    layer.ffn_norm = rms_ffn[l].to(to);
    layer.w_gate = w1[l].to(to);
    layer.w_down = w2[l].to(to);
    layer.w_up = w3[l].to(to);
    w.layers.push_back(std::move(layer));
  }
  return model;
}

Result<LoadedModel> load_model(const std::string& path, const LoadOptions& options) {
  if (!path_exists(path)) return Status::NotFound(path + ": no such file or directory");
  return is_directory(path) ? load_hf_model(path, options) : load_llama2c_model(path, options);
}

}  // namespace namm::worker
