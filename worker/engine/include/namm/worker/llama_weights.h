// Llama-family weights (Llama, Mistral, Qwen2, Qwen3: llama_config.h) and their loaders: Hugging Face
// directories (config.json + model.safetensors or a sharded model.safetensors.index.json) and llama2.c checkpoints.
//
// Linear weights are kept in PyTorch's (out, in) layout. Query/key rows are in the rotate-half RoPE order of
// Hugging Face; llama2.c checkpoints rotate interleaved pairs, so their wq/wk rows are permuted on load (the
// same permutation Hugging Face's conversion script applies), after which one forward pass serves both.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "namm/status.h"
#include "namm/worker/llama_config.h"

namespace namm::worker {

struct LlamaLayerWeights {
  at::Tensor attention_norm;            // [dim]
  at::Tensor wq, wk, wv, wo;            // [heads*hd, dim], [kv_heads*hd, dim] x2, [dim, heads*hd]
  at::Tensor bq, bk, bv;                // undefined unless config.qkv_bias
  at::Tensor bo;                        // undefined unless config.o_bias
  at::Tensor q_norm, k_norm;            // [head_dim]; undefined unless config.qk_norm
  at::Tensor ffn_norm;                  // [dim]
  at::Tensor w_gate, w_up, w_down;      // [hidden, dim], [hidden, dim], [dim, hidden]
  at::Tensor b_gate, b_up, b_down;      // undefined unless config.mlp_bias
};

struct LlamaWeights {
  at::Tensor token_embedding;  // [vocab, dim]
  std::vector<LlamaLayerWeights> layers;
  at::Tensor final_norm;       // [dim]
  at::Tensor lm_head;          // [vocab, dim]; the token embedding itself when tied
};

struct LoadOptions {
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;  // compute dtype; stored bf16/fp16/fp32 weights are converted
  std::optional<RopeScaling> rope_scaling;  // overrides the checkpoint's
};

struct LoadedModel {
  LlamaConfig config;
  LlamaWeights weights;
};

// A directory is loaded as a Hugging Face model, a file as a llama2.c checkpoint.
Result<LoadedModel> load_model(const std::string& path, const LoadOptions& options);
Result<LoadedModel> load_hf_model(const std::string& directory, const LoadOptions& options);
Result<LoadedModel> load_llama2c_model(const std::string& path, const LoadOptions& options);

// Reorders the rows of a [heads * head_dim, in] projection from interleaved RoPE pairs (2j, 2j+1) to the
// rotate-half layout (j, j + head_dim/2), head by head.
at::Tensor interleaved_to_rotate_half(const at::Tensor& weight, int64_t heads);

}  // namespace namm::worker
