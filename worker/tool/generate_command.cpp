// namm-worker generate: one greedy generation, printed as text or as a JSON report; --explain also writes a page
// of what the memory policy kept (explain_page.h).
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.h"
#include "namm/file_util.h"
#include "namm/worker/explain_page.h"
#include "namm/worker/generator.h"
#include "setup.h"

namespace namm::worker::cli {

namespace {

struct GenerateOptions {
  ModelOptions model;
  PolicyOptions policy;
  InferenceOptions inference;
  std::string prompt, prompt_file, explain;
  std::vector<std::string> stop;
  int64_t max_new_tokens = 128;
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
  for (const auto& u : r.updates) {
    updates.push_back({{"sequence_length", u.sequence_length}, {"cache_sizes", u.cache_sizes},
                       {"end_of_prefill", u.end_of_prefill}});
  }
  j["memory_updates"] = updates;
  j["final_cache_sizes"] = r.final_cache_sizes;
  j["prefill_seconds"] = r.prefill_seconds;
  j["decode_seconds"] = r.decode_seconds;
  j["prefill_tokens_per_second"] = r.prefill_tokens_per_second();
  j["decode_tokens_per_second"] = r.decode_tokens_per_second();
  j["mean_kv_tokens"] = r.mean_kv_tokens;
  j["answer_kv_tokens"] = r.answer_kv_tokens;
  j["peak_kv_tokens"] = r.peak_kv_tokens;
  j["peak_kv_bytes"] = r.peak_kv_bytes;
  j["peak_policy_state_bytes"] = r.peak_policy_state_bytes;
  return j;
}

Status RunGenerate(const GenerateOptions& o) {
  std::string prompt = o.prompt;
  if (!o.prompt_file.empty()) {
    NAMM_ASSIGN_OR_RETURN(prompt, read_file(o.prompt_file));
  }
  ApplyThreads(o.inference);
  NAMM_ASSIGN_OR_RETURN(LoadedModelAndTokenizer loaded, LoadModelAndTokenizer(o.model));
  const LlamaModel& model = *loaded.model;
  const Tokenizer* tokenizer = loaded.tokenizer.get();
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<MemoryPolicy> policy, MakePolicyFactory(loaded).Make(o.policy.Spec()));

  const int64_t context = o.inference.max_context > 0 ? o.inference.max_context : model.config().context_length();
  std::vector<int64_t> ids;
  int64_t generation_context = context;
  if (o.truncate) {
    NAMM_ASSIGN_OR_RETURN(ContextPrompt fitted, truncate_to_context(*tokenizer, prompt, context, o.max_new_tokens));
    ids = std::move(fitted.ids);
    generation_context = fitted.context;
  } else {
    NAMM_ASSIGN_OR_RETURN(ids, tokenizer->EncodeForModel(prompt));
    if (static_cast<int64_t>(ids.size()) > context - o.max_new_tokens) {  // (their sum may overflow)
      return Status::InvalidArgument("the prompt has " + std::to_string(ids.size()) + " tokens, which with " +
                                     std::to_string(o.max_new_tokens) + " new tokens exceed the context of " +
                                     std::to_string(context) + "; pass --truncate to cut its middle");
    }
  }

  GenerationOptions options;
  options.max_new_tokens = o.max_new_tokens;
  options.stop_strings = o.stop;
  if (o.inference.chunk_size > 0) options.chunk_size = o.inference.chunk_size;
  if (o.inference.update_interval > 0) options.memory_update_interval = o.inference.update_interval;
  options.max_context = generation_context;
  options.eos_ids = model.config().eos_token_ids;
  for (int64_t id : tokenizer->eos_ids()) {
    if (std::find(options.eos_ids.begin(), options.eos_ids.end(), id) == options.eos_ids.end()) options.eos_ids.push_back(id);
  }
  options.record_retention = !o.explain.empty();
  Generator generator(model, *tokenizer);
  NAMM_ASSIGN_OR_RETURN(GenerationResult result, generator.Generate(ids, *policy, options));
  if (!o.explain.empty()) {
    ExplainInput explain{policy->name(), model.config().Describe(), {}, static_cast<int64_t>(ids.size()), &result};
    ids.insert(ids.end(), result.token_ids.begin(), result.token_ids.end());
    explain.token_texts = explain_token_texts(*tokenizer, ids);
    NAMM_RETURN_IF_ERROR(write_file_atomically(o.explain, {render_explain_page(explain)}));
    if (!o.json) std::cerr << "wrote " << o.explain << "\n";  // JSON output stays parseable with 2>&1
  }
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
  AddInferenceOptions(cmd, o->inference);
  cmd->add_flag("--truncate", o->truncate, "Cut the middle of a prompt that does not fit (as LongBench does)");
  cmd->add_flag("--json", o->json, "Print a JSON report instead of the text");
  cmd->add_option("--explain", o->explain,
                  "Also write FILE.html: every token shaded by how long it stayed in the cache, per layer, and the "
                  "cache size after every memory update");
  cmd->callback([o, prompt, &run] {
    if (o->prompt_file.empty() && o->prompt.empty()) {
      if (prompt->count() > 0) throw CLI::ValidationError("--prompt", "the prompt is empty");
      throw CLI::RequiredError("--prompt or --prompt-file");
    }
    for (const std::string& stop : o->stop) {  // (namm-api drops them, as OpenAI does; here one was asked for)
      if (stop.empty()) throw CLI::ValidationError("--stop", "an empty stop string would end every answer at once");
    }
    run = [o] {
      Status s = RunGenerate(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::worker::cli
