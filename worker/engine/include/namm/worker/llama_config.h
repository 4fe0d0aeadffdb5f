// Hyper-parameters of a Llama-family decoder and its RoPE scaling. One forward pass serves every supported
// family; they differ only in the switches below:
//   Llama 1/2/3 (LlamaForCausalLM), llama2.c checkpoints: the plain pre-norm decoder (optional biases)
//   Mistral (MistralForCausalLM): sliding-window attention unless config.sliding_window is null (4,096 when absent)
//   Qwen2/Qwen2.5 (Qwen2ForCausalLM): biases on the q/k/v projections (not o); optional sliding window on
//     the layers from max_window_layers on
//   Qwen3 (Qwen3ForCausalLM): RMSNorm of each query and key head before RoPE (q_norm, k_norm)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "namm/status.h"

namespace namm::worker {

// How rotary position frequencies are rescaled for contexts longer than the trained one (spec §1.2).
struct RopeScaling {
  enum class Kind {
    kNone,
    kNtk,     // static NTK-aware: base' = theta * (alpha * factor - (alpha - 1))^(d / (d - 2))
    kLinear,  // positions divided by factor
    kLlama3,  // Llama 3.1's frequency-band interpolation
    kYarn,    // YaRN: per-band blend of interpolated and original frequencies, and an attention temperature
    kDynamic, // Hugging Face's dynamic NTK: the NTK base grows with the sequence length past the trained one
  };
  Kind kind = Kind::kNone;
  double factor = 1.0;
  double alpha = 1.0;                              // kNtk (the reference uses factor 4, alpha 2)
  double low_freq_factor = 1.0;                    // kLlama3
  double high_freq_factor = 4.0;                   // kLlama3
  // kLlama3: the trained context (required). kYarn: the length whose rotation counts place the blend's band
  // edges (0: the model's max_position_embeddings, as transformers does when it is absent).
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;                         // kYarn: band edges, in rotations over that length
  double beta_slow = 1.0;
  double attention_factor = 0.0;                   // kYarn: scales cos and sin; 0 = 0.1 ln(factor) + 1
  bool truncate = true;                            // kYarn: band edges rounded to whole dimensions

  Status Validate() const;
  // kYarn: the factor cos and sin are multiplied by (so attention logits by its square); 1 for other kinds.
  double yarn_attention_factor() const;
  // "none", "ntk:factor=4,alpha=2", "linear:factor=2", "llama3:factor=8,low_freq_factor=1,...",
  // "yarn:factor=4[,original_max_position_embeddings=N,beta_fast=32,beta_slow=1,attention_factor=A]",
  // "dynamic:factor=2".
  std::string ToString() const;
  // Parses the command-line form above.
  static Result<RopeScaling> Parse(const std::string& spec);
};

struct LlamaConfig {
  std::string architecture;  // "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                             // "llama2.c"
  int64_t dim = 0;           // hidden size
  int64_t hidden_dim = 0;    // feed-forward (intermediate) size
  int64_t n_layers = 0;
  int64_t n_heads = 0;       // query heads
  int64_t n_kv_heads = 0;    // key/value heads (GQA when fewer than n_heads)
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  // Positions the model was trained on; with RoPE scaling the usable context is longer (context_length()).
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;        // q/k/v projections carry biases (Llama's attention_bias, always in Qwen2)
  bool o_bias = false;          // the output projection carries one (Llama's attention_bias)
  bool mlp_bias = false;        // gate/up/down projections carry biases
  bool qk_norm = false;         // Qwen3: RMSNorm over head_dim of every query and key head, before RoPE
  // Sliding-window attention: a query at position p sees keys at positions > p - sliding_window (itself and
  // the sliding_window - 1 before it), on layers >= first_sliding_layer. 0: every layer sees everything.
  int64_t sliding_window = 0;
  int64_t first_sliding_layer = 0;
  std::vector<int64_t> bos_token_ids;
  std::vector<int64_t> eos_token_ids;

  Status Validate() const;
  // Longest sequence (prompt + generation) the model is run on: max_position_embeddings, times the scaling
  // factor for NTK, linear, dynamic and YaRN scaling (Llama 3 configs already state their extended length).
  int64_t context_length() const;
  // The attention window of `layer` (0: unlimited).
  int64_t window_of(int64_t layer) const { return layer >= first_sliding_layer ? sliding_window : 0; }
  // One line for logs: "LlamaForCausalLM 5 layers, dim 64, 8/4 heads, vocab 512, rope ntk:factor=4,alpha=2".
  std::string Describe() const;
};

// Parses a Hugging Face config.json of a supported family (architectures[0], or model_type when that is absent).
// Unknown architectures, missing fields and unsupported features are refused with a message naming them.
Result<LlamaConfig> parse_hf_config(const std::string& json_text, const std::string& source);

}  // namespace namm::worker
