// A deterministic random Llama of a named shape, and seeded random prompts for it: how the benchmarks measure
// the engine at Llama 3 8B's layer width without its weights (none can be downloaded here).
#pragma once

#include <ATen/core/TensorBody.h>

#include <cstdint>
#include <string>
#include <vector>

#include "namm/status.h"
#include "namm/worker/llama_model.h"

namespace namm::bench {

// `spec` is "layers=2,dim=2048,heads=16,kv_heads=4,ffn=7168,vocab=32000" (each key optional, those the
// defaults): Gaussian weights (std 0.02, each matrix from its own seed 1 + i, drawn in float32 on the CPU so
// that every dtype and device runs the same model), unit norms, plain RoPE with theta 500000 and a context of `context` tokens.
Result<worker::LlamaModel> RandomModel(const std::string& spec, int64_t context, at::ScalarType dtype,
                                       at::Device device);

// `n` seeded pseudo-random token ids in [0, vocab): the same ids on every call.
std::vector<int64_t> RandomPrompt(int64_t vocab, int64_t n);

}  // namespace namm::bench
