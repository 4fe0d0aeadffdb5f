#include "setup.h"

#include <ATen/Context.h>

#include "namm/cpu_threads.h"
#include "namm/file_util.h"
#include "namm/worker/chat_tokenizer.h"
#include "namm/worker/device_memory.h"
#include "namm/worker/policy_spec.h"

namespace namm::worker::cli {

std::string FingerprintedTokenizer(const ModelOptions& o) {
  if (!o.tokenizer.empty()) return o.tokenizer;
  const std::string beside = parent_directory(o.model) + "/tokenizer.bin";
  return !is_directory(o.model) && path_exists(beside) ? beside : "";
}

namespace {

// The tokenizer to use: --tokenizer, else the model directory, else a tokenizer.bin beside a llama2.c model.
Result<std::string> TokenizerPath(const ModelOptions& o) {
  const std::string file = FingerprintedTokenizer(o);
  if (!file.empty()) return file;
  if (is_directory(o.model)) return o.model;
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

}  // namespace

void AddModelOptions(CLI::App* cmd, ModelOptions& o, bool required) {
  cmd->add_option("--model", o.model, "Hugging Face model directory or llama2.c checkpoint (.bin)")->required(required);
  cmd->add_option("--tokenizer", o.tokenizer,
                  "tokenizer.json (or its directory) or llama2.c tokenizer .bin (default: the model directory, or a "
                  "tokenizer.bin beside a llama2.c model)");
  cmd->add_option("--rope-scaling", o.rope_scaling,
                  "Override RoPE scaling: none | ntk:factor=4,alpha=2 | linear:factor=F | "
                  "llama3:factor=F,low_freq_factor=L,high_freq_factor=H,original_max_position_embeddings=N | "
                  "yarn:factor=F[,original_max_position_embeddings=N,beta_fast=B,beta_slow=B,attention_factor=A] | "
                  "dynamic:factor=F");
  cmd->add_option("--device", o.device, "cpu (default) or cuda:N");
  cmd->add_option("--dtype", o.dtype,
                  "Compute dtype of the model: fp32, bf16 or fp16 (default: fp32 on CPU, bf16 on CUDA); NAMM "
                  "features are computed in fp32 whatever it is")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  cmd->add_flag("--chat", o.chat,
                "Format every prompt as a user turn of the model's chat template (chat_template.jinja or "
                "tokenizer_config.json beside the tokenizer), as LongBench does for chat models (not its few-shot "
                "and code tasks: chat: false in their definitions); the reference does not");
}

Result<LoadedModelAndTokenizer> LoadModelAndTokenizer(const ModelOptions& o, const std::string& default_rope) {
  NAMM_ASSIGN_OR_RETURN(at::Device device, ParseDevice(o.device));
  LoadOptions load;
  load.device = device;
  const std::string dtype = o.dtype.empty() ? (device.is_cuda() ? "bf16" : "fp32") : o.dtype;
  load.dtype = dtype == "bf16" ? at::kBFloat16 : dtype == "fp16" ? at::kHalf : at::kFloat;
  if (load.dtype == at::kHalf && !device.is_cuda()) {
    // torch 1.13 has no float16 matrix products on the CPU.
    return Status::InvalidArgument("--dtype fp16 needs a CUDA device; on the CPU use bf16 or fp32");
  }
  const std::string rope = o.rope_scaling.empty() ? default_rope : o.rope_scaling;
  if (!rope.empty()) {
    NAMM_ASSIGN_OR_RETURN(RopeScaling scaling, RopeScaling::Parse(rope));
    load.rope_scaling = scaling;
  }
  LoadedModelAndTokenizer out;
  NAMM_ASSIGN_OR_RETURN(std::string tokenizer_path, TokenizerPath(o));
  NAMM_ASSIGN_OR_RETURN(out.tokenizer, load_tokenizer(tokenizer_path));
  if (o.chat) {
    const std::string dir = is_directory(tokenizer_path) ? tokenizer_path : parent_directory(tokenizer_path);
    NAMM_ASSIGN_OR_RETURN(LoadedChatTemplate chat, load_chat_template(dir));
    NAMM_ASSIGN_OR_RETURN(out.tokenizer, with_chat_template(std::move(out.tokenizer), std::move(chat)));
  }
  NAMM_ASSIGN_OR_RETURN(LlamaModel model, LlamaModel::Load(o.model, load));
  out.model = std::make_unique<LlamaModel>(std::move(model));
  return out;
}

void AddBatchOption(CLI::App* cmd, InferenceOptions& o) {
  cmd->add_option("--batch", o.batch,
                  "Rows generated together in one batched forward pass per step (default 8); a row's result does not "
                  "depend on it on the CPU in float32")
      ->check(CLI::Range(int64_t{1}, int64_t{256}));
}

void AddInferenceOptions(CLI::App* cmd, InferenceOptions& o) {
  cmd->add_option("--chunk-size", o.chunk_size,
                  "Prefill chunk length; must divide --update-interval (default: the task's, else 128)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--update-interval", o.update_interval, "Memory update every N tokens (default: the task's, else 512)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-context", o.max_context,
                  "Longest prompt + answer to run (default: the task's max_context, else the model's context; larger "
                  "values run beyond the trained length)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--threads", o.threads, "CPU threads: BLAS's and our kernels' alike (default: one per core)")
      ->check(CLI::Range(1, 1024));  // (100,000 failed in thread creation: "Resource temporarily unavailable")
}

void ApplyThreads(const InferenceOptions& o) {
  set_cpu_threads(o.threads > 0 ? o.threads : cpu_threads());  // the default budget: one thread per core
}

void AddKvMemoryOptions(CLI::App* cmd, KvMemoryOptions& o, const std::string& use) {
  cmd->add_option("--max-kv-bytes", o.max_kv_bytes,
                  "Keys and values the KV caches may hold together, e.g. 2GiB: " + use +
                      " (default: half the device's free memory at start, printed then)")
      ->transform(CLI::AsSizeValue(false));
  cmd->add_option("--kv-block-tokens", o.kv_block_tokens,
                  "Keys and values in blocks of this many tokens per layer and KV head, from one pool of "
                  "--max-kv-bytes: a cache takes whole blocks as it grows, and those an eviction empties serve others "
                  "at once (a power of two; default 16; 0: each cache one buffer that grows by doubling)")
      ->check(CLI::NonNegativeNumber);
}

Result<int64_t> ApplyKvMemory(LlamaModel& model, const KvMemoryOptions& o) {
  const int64_t budget =
      o.max_kv_bytes ? static_cast<int64_t>(*o.max_kv_bytes) : device_memory(model.options().device()).free / 2;
  NAMM_RETURN_IF_ERROR(use_kv_blocks(model, o.kv_block_tokens, budget));
  return budget;
}

void AddPolicyOptions(CLI::App* cmd, PolicyOptions& o) {
  auto* namm = cmd->add_option("--namm", o.namm, "NAMM file (.safetensors) to use as the memory policy")
                   ->check(CLI::ExistingFile);
  auto* policy = cmd->add_option("--policy", o.policy,
                                 "Memory policy (default full): full | h2o|l2|streaming|tova|snapkv|fastgen:budget=N or "
                                 ":ratio=R[,options] | namm:FILE | oracle (synthetic rows)");
  namm->excludes(policy);
}

PolicyFactory MakePolicyFactory(const LoadedModelAndTokenizer& loaded) {
  return PolicyFactory(loaded.model->options().device(), loaded.tokenizer.get());
}

Result<RowBatch> MakeRowBatch(PolicyFactory& factory, const std::string& spec, const std::vector<tasks::TaskRow>& rows,
                              const std::vector<int64_t>& indices, std::size_t first, std::size_t end) {
  RowBatch batch;
  for (std::size_t i = first; i < end; ++i) {
    const tasks::TaskRow& row = rows[static_cast<std::size_t>(indices[i])];
    NAMM_ASSIGN_OR_RETURN(std::unique_ptr<MemoryPolicy> policy, factory.Make(spec, &row.fields));
    batch.policies.push_back(std::move(policy));
    batch.items.push_back({&row, batch.policies.back().get()});
  }
  return batch;
}

}  // namespace namm::worker::cli
