#include "sim_executor.h"

#include <cmath>
#include <thread>

#include "namm/namm_model.h"
#include "namm/tasks/task_variant.h"

namespace namm::sim {

namespace {

// FNV-1a over the task name and the prompt: a stable per-prompt hash.
uint64_t PromptHash(const std::string& task, int64_t prompt) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](unsigned char c) { h = (h ^ c) * 1099511628211ull; };
  for (char c : task) mix(static_cast<unsigned char>(c));
  for (int i = 0; i < 8; ++i) mix(static_cast<unsigned char>(static_cast<uint64_t>(prompt) >> (8 * i)));
  return h;
}

double Unit(uint64_t h) { return static_cast<double>(h >> 11) * 0x1.0p-53; }

}  // namespace

double sim_reference_score(const std::string& task, int64_t prompt) {
  return 0.3 + 0.5 * Unit(PromptHash(task, prompt));
}

double sim_params_factor(const std::vector<float>& params) {
  // Rastrigin in z = (x - optimum) / 0.5 with its optimum at a fixed pattern of offsets: multimodal, and
  // neither the zero start nor any axis is special; at the NAMM's sigma0 (0.065) CMA-ES makes steady progress.
  constexpr double kPi = 3.14159265358979323846;
  double r = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const double optimum = 0.05 * (static_cast<double>(i % 7) - 3.0);
    const double z = (static_cast<double>(params[i]) - optimum) / 0.5;
    r += z * z - 10.0 * std::cos(2 * kPi * z) + 10.0;
  }
  const double n = std::max<double>(1, static_cast<double>(params.size()));
  return 1.0 / (1.0 + r / n);
}

double sim_score(const std::vector<float>& params, const std::string& task, int64_t prompt) {
  return sim_reference_score(task, prompt) * sim_params_factor(params);
}

NormStats sim_norm_stats(const std::string& task, int64_t prompt) {
  const double u = Unit(PromptHash(task, prompt));
  NormStats s;
  s.count = 100 + static_cast<int64_t>(u * 1000);
  for (std::size_t i = 0; i < s.mean.size(); ++i) {
    s.mean[i] = u + 0.1 * static_cast<double>(i);
    s.var[i] = 1.0 + u * static_cast<double>(i);
  }
  return s;
}

double sim_jitter(const std::string& task, int64_t prompt) {
  return 0.4 * Unit(PromptHash(task, prompt) * 0x9E3779B97F4A7C15ull) - 0.2;
}

SimExecutor::SimExecutor(coordinator::PromptCosts costs, SimOptions options, int slots)
    : costs_(std::move(costs)), options_(options), last_(static_cast<std::size_t>(slots)) {
  if (!options_.record.empty()) record_.reset(std::fopen(options_.record.c_str(), "a"));
}

Status SimExecutor::Prepare(const worker::RunInfo& run) {
  NAMM_ASSIGN_OR_RETURN(NammArchitecture architecture, NammArchitecture::FromJson(run.architecture_json));
  std::lock_guard<std::mutex> lock(mu_);
  param_count_ = architecture.param_count();
  return Status::Ok();
}

std::vector<Result<worker::PromptOutcome>> SimExecutor::RunPrompts(const std::vector<worker::PromptJob>& jobs,
                                                                    int slot) {
  std::vector<Result<worker::PromptOutcome>> outcomes;
  for (const worker::PromptJob& job : jobs) outcomes.push_back(RunPrompt(*job.lease, job.prompt, slot));
  return outcomes;
}

Result<worker::PromptOutcome> SimExecutor::RunPrompt(const worker::LeaseWork& lease, int64_t prompt, int slot) {
  const Clock::time_point start = Clock::now();
  const auto task = costs_.find(tasks::base_task(lease.task));  // a variant runs its base task's rows
  if (task == costs_.end() || prompt < 0 || prompt >= static_cast<int64_t>(task->second.size())) {
    return Status::InvalidArgument("the simulated worker knows no prompt " + std::to_string(prompt) + " of task " +
                                   lease.task);
  }
  if (!lease.reference && static_cast<int64_t>(lease.params->size()) != param_count_) {
    return Status::InvalidArgument("lease " + std::to_string(lease.id) + " has " +
                                   std::to_string(lease.params->size()) + " parameters, the run's NAMM " +
                                   std::to_string(param_count_));
  }
  if (options_.fail.count({lease.task, prompt}) > 0) {
    return Status::Internal("simulated failure of " + lease.task + " prompt " + std::to_string(prompt));
  }
  const double cost = task->second[static_cast<std::size_t>(prompt)];
  const double seconds =
      cost * options_.seconds_per_cost * (1.0 + sim_jitter(lease.task, prompt)) / std::max(1e-9, options_.speed);
  if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));

  double factor = 1;
  if (!lease.reference) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = factors_.find(lease.params);
    if (it == factors_.end()) {
      if (factors_.size() >= 256) factors_.clear();
      it = factors_.emplace(lease.params, sim_params_factor(*lease.params)).first;
    }
    factor = it->second;
  }
  worker::PromptOutcome out;
  out.score = options_.nan_score.count({lease.task, prompt}) > 0 ? std::nan("")
                                                                  : sim_reference_score(lease.task, prompt) * factor;
  out.prompt_tokens = static_cast<int64_t>(cost);
  out.cache_size_mean = lease.reference ? cost : cost * out.score;
  out.cache_size_final = static_cast<int64_t>(out.cache_size_mean);
  out.seconds = seconds;
  out.prefill_tokens = out.prompt_tokens;  // a simulated prompt is all prefill
  out.prefill_seconds = seconds;
  if (lease.collect_norm_stats) out.norm_stats = sim_norm_stats(lease.task, prompt);

  const Clock::time_point end = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  SlotHistory& last = last_.at(static_cast<std::size_t>(slot));
  if (last.lease != 0 && last.lease != lease.id && last.generation == lease.generation) {
    timing_.gaps.emplace_back(last.end, start);
  }
  last = {lease.id, lease.generation, end};
  if (!lease.reference && !lease.collect_norm_stats) timing_.first_prompt.emplace(lease.generation, start);
  if (record_) {
    std::fprintf(record_.get(), "%lld %lld %s %lld %s\n", static_cast<long long>(lease.generation),
                 static_cast<long long>(lease.candidate), lease.task.c_str(), static_cast<long long>(prompt),
                 lease.reference ? "reference" : lease.collect_norm_stats ? "statistics" : "candidate");
    std::fflush(record_.get());
  }
  ++timing_.prompts;
  timing_.busy_seconds += std::chrono::duration<double>(end - start).count();
  return out;
}

SimTiming SimExecutor::timing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timing_;
}

}  // namespace namm::sim
