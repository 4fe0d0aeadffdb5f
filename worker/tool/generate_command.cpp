// namm-worker generate: one greedy generation, printed as text or as a JSON report.
#include <ATen/Context.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.h"
#include "namm/file_util.h"
#include "namm/worker/generator.h"
#include "namm/worker/policy_spec.h"

namespace namm::worker::cli {

namespace {

struct GenerateOptions {
  std::string model, tokenizer, rope_scaling, namm, policy = "full", prompt, prompt_file, device = "cpu";
  std::vector<std::string> stop;
  int64_t max_new_tokens = 128, chunk_size = 128, update_interval = 512, max_context = 0;
  bool truncate = false, json = false;
};

// The tokenizer to use: --tokenizer, else the model directory, else a tokenizer.bin beside a llama2.c model.
Result<std::string> TokenizerPath(const GenerateOptions& o) {
  if (!o.tokenizer.empty()) return o.tokenizer;
  if (is_directory(o.model)) return o.model;
  const std::string beside = parent_directory(o.model) + "/tokenizer.bin";
  if (path_exists(beside)) return beside;
  return Status::InvalidArgument("--tokenizer is required for the llama2.c model " + o.model +
                                 " (no tokenizer.bin beside it)");
}

Result<at::Device> ParseDevice(const std::string& text) {
  try {
    at::Device device(text);
    if (device.is_cuda() && !at::hasCUDA()) {
      return Status::FailedPrecondition("--device " + text + ": this build or machine has no CUDA");
    }
    if (!device.is_cpu() && !device.is_cuda()) return Status::InvalidArgument("--device must be cpu or cuda:N");
    return device;
  } catch (const std::exception&) {
    return Status::InvalidArgument("--device '" + text + "' is not a device (cpu, cuda:0, ...)");
  }
}

nlohmann::ordered_json Report(const GenerationResult& r, const LlamaModel& model, const MemoryPolicy& policy) {
  nlohmann::ordered_json j;
  j["text"] = r.text;
  j["token_ids"] = r.token_ids;
  j["prompt_tokens"] = r.prompt_tokens;
  j["generated_tokens"] = r.token_ids.size();
  j["stop_reason"] = r.stop_reason;
  j["policy"] = policy.name();
  j["model"] = model.config().Describe();
  nlohmann::ordered_json updates = nlohmann::ordered_json::array();
  for (const auto& u : r.updates) updates.push_back({{"sequence_length", u.sequence_length}, {"cache_sizes", u.cache_sizes}});
  j["memory_updates"] = updates;
  j["final_cache_sizes"] = r.final_cache_sizes;
  j["prefill_seconds"] = r.prefill_seconds;
  j["decode_seconds"] = r.decode_seconds;
  j["prefill_tokens_per_second"] = r.prefill_tokens_per_second();
  j["decode_tokens_per_second"] = r.decode_tokens_per_second();
  j["peak_kv_bytes"] = r.peak_kv_bytes;
  j["peak_policy_state_bytes"] = r.peak_policy_state_bytes;
  return j;
}

Status RunGenerate(const GenerateOptions& o) {
  NAMM_ASSIGN_OR_RETURN(at::Device device, ParseDevice(o.device));
  LoadOptions load;
  load.device = device;
  load.dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (!o.rope_scaling.empty()) {
    NAMM_ASSIGN_OR_RETURN(RopeScaling scaling, RopeScaling::Parse(o.rope_scaling));
    load.rope_scaling = scaling;
  }
  std::string prompt = o.prompt;
  if (!o.prompt_file.empty()) {
    NAMM_ASSIGN_OR_RETURN(prompt, read_file(o.prompt_file));
  }

  NAMM_ASSIGN_OR_RETURN(std::string tokenizer_path, TokenizerPath(o));
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, load_tokenizer(tokenizer_path));
  NAMM_ASSIGN_OR_RETURN(LlamaModel model, LlamaModel::Load(o.model, load));
  std::unique_ptr<MemoryPolicy> policy;
  if (!o.namm.empty()) {
    NAMM_ASSIGN_OR_RETURN(policy, make_namm_policy(o.namm, device));
  } else {
    NAMM_ASSIGN_OR_RETURN(policy, make_baseline_policy(o.policy));
  }

  const int64_t context = o.max_context > 0 ? std::min(o.max_context, model.config().context_length())
                                            : model.config().context_length();
  const int64_t prompt_budget = context - o.max_new_tokens;
  if (prompt_budget <= 0) {
    return Status::InvalidArgument("--max-new-tokens " + std::to_string(o.max_new_tokens) +
                                   " leaves no room for a prompt in a context of " + std::to_string(context));
  }
  std::vector<int64_t> ids;
  if (o.truncate) {
    // The reference's rule (spec §1.5) with its budget, context - new tokens. Template tokens and re-encoding
    // can push the result a few tokens over; the reference then runs over its context, here the middle is
    // cut by that much more so that generation stays within it.
    ids = encode_truncated_middle(*tokenizer, prompt, prompt_budget);
    const int64_t over = static_cast<int64_t>(ids.size()) - prompt_budget;
    if (over > 0) ids = encode_truncated_middle(*tokenizer, prompt, prompt_budget - 2 * over);
  } else {
    ids = tokenizer->EncodeForModel(prompt);
  }
  if (static_cast<int64_t>(ids.size()) > prompt_budget) {
    return Status::InvalidArgument("the prompt has " + std::to_string(ids.size()) + " tokens but at most " +
                                   std::to_string(prompt_budget) + " fit (context " + std::to_string(context) +
                                   " minus " + std::to_string(o.max_new_tokens) + " new tokens)" +
                                   (o.truncate ? "" : "; pass --truncate to cut its middle"));
  }

  GenerationOptions options;
  options.max_new_tokens = o.max_new_tokens;
  options.stop_strings = o.stop;
  options.chunk_size = o.chunk_size;
  options.memory_update_interval = o.update_interval;
  options.eos_ids = model.config().eos_token_ids;
  for (int64_t id : tokenizer->eos_ids()) {
    if (std::find(options.eos_ids.begin(), options.eos_ids.end(), id) == options.eos_ids.end()) options.eos_ids.push_back(id);
  }
  Generator generator(model, *tokenizer);
  NAMM_ASSIGN_OR_RETURN(GenerationResult result, generator.Generate(ids, *policy, options));
  if (o.json) {
    std::cout << Report(result, model, *policy).dump(2) << "\n";
  } else {
    std::cout << result.text << "\n";
  }
  return Status::Ok();
}

}  // namespace

void AddGenerateCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate greedily from a prompt with a memory policy");
  cmd->add_option("--model", o->model, "Hugging Face model directory or llama2.c checkpoint (.bin)")->required();
  cmd->add_option("--tokenizer", o->tokenizer,
                  "tokenizer.json (or its directory) or llama2.c tokenizer .bin (default: the model directory, or a "
                  "tokenizer.bin beside a llama2.c model)");
  cmd->add_option("--rope-scaling", o->rope_scaling,
                  "Override RoPE scaling: none | ntk:factor=4,alpha=2 | linear:factor=F | "
                  "llama3:factor=F,low_freq_factor=L,high_freq_factor=H,original_max_position_embeddings=N");
  auto* namm = cmd->add_option("--namm", o->namm, "NAMM file (.safetensors) to use as the memory policy")
                   ->check(CLI::ExistingFile);
  auto* policy = cmd->add_option("--policy", o->policy, "Baseline policy: full (default) | h2o:budget=N[,recent=R] | l2:budget=N");
  namm->excludes(policy);
  auto* prompt = cmd->add_option("--prompt", o->prompt, "Prompt text");
  auto* file = cmd->add_option("--prompt-file", o->prompt_file, "File holding the prompt text")->check(CLI::ExistingFile);
  prompt->excludes(file);
  cmd->add_option("--max-new-tokens", o->max_new_tokens, "Most tokens to generate (default 128)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--stop", o->stop, "Stop string (repeatable): the answer is cut before it");
  cmd->add_option("--chunk-size", o->chunk_size, "Prefill chunk length; must divide --update-interval (default 128)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--update-interval", o->update_interval, "Memory update every N tokens (default 512)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-context", o->max_context, "Cap on prompt + generation length (default: the model's context)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--truncate", o->truncate, "Cut the middle of a prompt that does not fit (as LongBench does)");
  cmd->add_option("--device", o->device, "cpu (default) or cuda:N");
  cmd->add_flag("--json", o->json, "Print a JSON report instead of the text");
  cmd->callback([o, &run] {
    if (o->prompt_file.empty() && o->prompt.empty()) throw CLI::RequiredError("--prompt or --prompt-file");
    run = [o] {
      Status s = RunGenerate(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::worker::cli
