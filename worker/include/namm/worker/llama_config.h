// Hyper-parameters of a Llama-family decoder (Llama 1/2/3, Mistral, llama2.c checkpoints) and its RoPE scaling.
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
  };
  Kind kind = Kind::kNone;
  double factor = 1.0;
  double alpha = 1.0;                              // kNtk (the reference uses factor 4, alpha 2)
  double low_freq_factor = 1.0;                    // kLlama3
  double high_freq_factor = 4.0;                   // kLlama3
  int64_t original_max_position_embeddings = 0;    // kLlama3

  Status Validate() const;
  // "none", "ntk:factor=4,alpha=2", "linear:factor=2", "llama3:factor=8,low_freq_factor=1,...".
  std::string ToString() const;
  // Parses the command-line form above.
  static Result<RopeScaling> Parse(const std::string& spec);
};

struct LlamaConfig {
  std::string architecture;  // "LlamaForCausalLM", "MistralForCausalLM" or "llama2.c"
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
  bool attention_bias = false;  // q/k/v/o projections carry biases
  bool mlp_bias = false;        // gate/up/down projections carry biases
  std::vector<int64_t> bos_token_ids;
  std::vector<int64_t> eos_token_ids;

  Status Validate() const;
  // Longest sequence (prompt + generation) the model is run on: max_position_embeddings, times the scaling
  // factor for NTK and linear scaling (Llama 3 configs already state their extended length).
  int64_t context_length() const;
  // One line for logs: "LlamaForCausalLM 5 layers, dim 64, 8/4 heads, vocab 512, rope ntk:factor=4,alpha=2".
  std::string Describe() const;
};

// Parses a Hugging Face config.json (LlamaForCausalLM / MistralForCausalLM). Unknown architectures, missing
// fields and unsupported features (sliding-window attention, HF's dynamic NTK) are refused with a message.
Result<LlamaConfig> parse_hf_config(const std::string& json_text, const std::string& source);

}  // namespace namm::worker
