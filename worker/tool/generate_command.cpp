// namm-worker generate: one greedy generation, printed as text or as a JSON report.
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.h"
#include "namm/file_util.h"
#include "namm/worker/generator.h"
#include "setup.h"

namespace namm::worker::cli {

namespace {

struct GenerateOptions {
  ModelOptions model;
  PolicyOptions policy;
  std::string prompt, prompt_file;
  std::vector<std::string> stop;
  int64_t max_new_tokens = 128, chunk_size = 128, update_interval = 512, max_context = 0;
  bool truncate = false, json = false;
};

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
  std::string prompt = o.prompt;
  if (!o.prompt_file.empty()) {
    NAMM_ASSIGN_OR_RETURN(prompt, read_file(o.prompt_file));
  }
  NAMM_ASSIGN_OR_RETURN(LoadedModelAndTokenizer loaded, LoadModelAndTokenizer(o.model));
  const LlamaModel& model = *loaded.model;
  const Tokenizer* tokenizer = loaded.tokenizer.get();
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<MemoryPolicy> policy, MakePolicy(o.policy, model));

  const int64_t context = o.max_context > 0 ? o.max_context : model.config().context_length();
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
  options.max_context = context;
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
  AddModelOptions(cmd, o->model);
  AddPolicyOptions(cmd, o->policy);
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
  cmd->add_option("--max-context", o->max_context, "Longest prompt + generation (default: the model's context; larger "
                  "values run beyond the trained length)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--truncate", o->truncate, "Cut the middle of a prompt that does not fit (as LongBench does)");
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
