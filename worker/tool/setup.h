// Options and loading shared by namm-worker's subcommands: model, tokenizer, device, memory policy.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "namm/memory_policy.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker::cli {

struct ModelOptions {
  std::string model, tokenizer, rope_scaling, device = "cpu";
};
// --model (required), --tokenizer, --rope-scaling, --device.
void AddModelOptions(CLI::App* cmd, ModelOptions& options);

struct LoadedModelAndTokenizer {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};
// `default_rope`: the RoPE scaling to use when --rope-scaling is not given ("" = the checkpoint's).
Result<LoadedModelAndTokenizer> LoadModelAndTokenizer(const ModelOptions& options, const std::string& default_rope = "");

struct PolicyOptions {
  std::string namm, policy = "full";
};
// --namm F | --policy SPEC.
void AddPolicyOptions(CLI::App* cmd, PolicyOptions& options);
Result<std::unique_ptr<MemoryPolicy>> MakePolicy(const PolicyOptions& options, const LlamaModel& model);

}  // namespace namm::worker::cli
