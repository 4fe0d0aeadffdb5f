// Options and loading shared by namm-worker's subcommands: model, tokenizer, device, memory policy.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <optional>
#include <string>

#include "namm/policies/memory_policy.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/policy_spec.h"
#include "namm/worker/task_runner.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker::cli {

struct ModelOptions {
  std::string model, tokenizer, rope_scaling, device = "cpu";
  std::string dtype;  // fp32 | bf16 | fp16; empty: fp32 on CPU, bf16 on CUDA
  bool chat = false;  // prompts as a user turn of the model's chat template
};
// --model (required unless said otherwise), --tokenizer, --rope-scaling, --device, --dtype, --chat.
void AddModelOptions(CLI::App* cmd, ModelOptions& options, bool required = true);

// The tokenizer a model fingerprint covers besides the model's own files: the one given, else the tokenizer.bin
// that a llama2.c model is loaded with from beside it ("" for a directory, whose files cover its tokenizer).
std::string FingerprintedTokenizer(const ModelOptions& options);

struct LoadedModelAndTokenizer {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};
// `default_rope`: the RoPE scaling to use when --rope-scaling is not given ("" = the checkpoint's).
Result<LoadedModelAndTokenizer> LoadModelAndTokenizer(const ModelOptions& options, const std::string& default_rope = "");

// How prompts are run: 0 means the task's setting (run-task, eval) or the reference's (generate).
struct InferenceOptions {
  int64_t chunk_size = 0, update_interval = 0, max_context = 0;
  int64_t batch = 8;  // rows generated together (eval, run-task): see AddBatchOption
  int threads = 0;  // the CPU thread budget; 0: one thread per core
};
// --chunk-size, --update-interval, --max-context, --threads.
void AddInferenceOptions(CLI::App* cmd, InferenceOptions& options);
// --batch N: rows run together through the batched engine (each row's result is the same bits as alone on the
// CPU in float32).
void AddBatchOption(CLI::App* cmd, InferenceOptions& options);
// The CPU thread budget (namm/cpu_threads.h: BLAS and our kernels' pool): --threads, else one thread per core.
void ApplyThreads(const InferenceOptions& options);

// The KV memory of namm-api and namm-worker serve: the caches' keys and values in blocks of one pool.
struct KvMemoryOptions {
  std::optional<uint64_t> max_kv_bytes;  // --max-kv-bytes (default: half the device's free memory at start)
  int64_t kv_block_tokens = 16;          // --kv-block-tokens (0: each cache one growing buffer)
};
// --max-kv-bytes SIZE (`use`: what the budget does in this program) and --kv-block-tokens N.
void AddKvMemoryOptions(CLI::App* cmd, KvMemoryOptions& options, const std::string& use);
// Puts the model's caches in blocks of a pool of --max-kv-bytes (use_kv_blocks); returns that budget (0: none).
Result<int64_t> ApplyKvMemory(LlamaModel& model, const KvMemoryOptions& options);

struct PolicyOptions {
  std::string namm, policy = "full";
  // The single spec these options stand for ("namm:F" for --namm F).
  std::string Spec() const { return namm.empty() ? policy : "namm:" + namm; }
};
// --namm F | --policy SPEC.
void AddPolicyOptions(CLI::App* cmd, PolicyOptions& options);
// A policy factory for the loaded model (its device, its tokenizer).
PolicyFactory MakePolicyFactory(const LoadedModelAndTokenizer& loaded);

// Rows indices[first, end) of a task, each with a fresh policy of `spec` (a policy serves one sequence, and the
// oracle reads what to evict from its row): what TaskRunner::RunBatch takes.
struct RowBatch {
  std::vector<std::unique_ptr<MemoryPolicy>> policies;
  std::vector<TaskRunner::Item> items;
};
Result<RowBatch> MakeRowBatch(PolicyFactory& factory, const std::string& spec, const std::vector<tasks::TaskRow>& rows,
                              const std::vector<int64_t>& indices, std::size_t first, std::size_t end);

}  // namespace namm::worker::cli
