// namm-tool init: write a new NAMM file (zero, seeded-random or imported parameters).
#include <ATen/core/Tensor.h>

#include <cmath>
#include <iostream>
#include <optional>
#include <random>

#include "commands.h"
#include "namm/dtype.h"
#include "namm/file_util.h"
#include "namm/namm_file.h"
#include "namm/npy.h"

namespace namm::tool {

namespace {

struct InitOptions {
  std::string arch;
  int64_t hidden = 0;  // 0: the architecture's default
  bool no_bias = false;
  std::string selection = "binary";
  std::string precision = "bf16";
  bool budget_input = false;
  bool zero = false;
  std::optional<uint64_t> seed;
  double scale = 0.0;
  std::string params_path;
  std::string norm_mean_path, norm_var_path;
  int64_t norm_count = 1;
  std::vector<std::string> meta;
  std::string out;
  bool force = false;
};

// Reads a 1-D float32/float64 .npy of `expected` values.
Result<std::vector<double>> ReadVector(const std::string& path, int64_t expected, const std::string& what) {
  NAMM_ASSIGN_OR_RETURN(at::Tensor t, read_npy(path));
  if (t.dim() != 1 || t.size(0) != expected || (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble)) {
    return Status::InvalidArgument(path + ": " + what + " must be a float32 [" + std::to_string(expected) +
                                   "] array, got " + at::toString(t.scalar_type()) + " " +
                                   shape_to_string(t.sizes().vec()));
  }
  at::Tensor d = t.to(at::kDouble);
  std::vector<double> values(d.data_ptr<double>(), d.data_ptr<double>() + expected);
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return Status::InvalidArgument(path + ": " + what + " element " + std::to_string(i) + " is not finite");
    }
  }
  return values;
}

// N(0, 1) draws from a fully specified generator (std::normal_distribution differs between standard
// libraries; mt19937_64 does not), so a seed gives the same NAMM everywhere.
std::vector<float> GaussianParams(std::size_t n, uint64_t seed, double scale) {
  std::mt19937_64 bits(seed);
  auto uniform = [&bits] { return static_cast<double>(bits() >> 11) * 0x1.0p-53; };  // [0, 1)
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(1.0 - uniform()));  // 1 - u in (0, 1]
    const double angle = 2.0 * M_PI * uniform();
    out[i] = static_cast<float>(scale * radius * std::cos(angle));
    if (i + 1 < n) out[i + 1] = static_cast<float>(scale * radius * std::sin(angle));
  }
  return out;
}

Result<NammModel> BuildModel(const InitOptions& o) {
  NammModel model;
  if (o.arch == "bam") {
    model.architecture.scorer = default_scorer_config(ScorerKind::kBam);
  } else if (o.arch == "mlp") {
    model.architecture.scorer = default_scorer_config(ScorerKind::kMlp);
  } else {
    return Status::InvalidArgument("unknown --arch '" + o.arch + "' (known: bam, mlp)");
  }
  if (o.hidden != 0) model.architecture.scorer.hidden = o.hidden;
  if (o.no_bias) {
    // The reference's two switches: BAM without attention biases keeps its final bias (2026 parameters at
    // hidden 16); the MLP loses both of its biases (650 parameters).
    if (o.arch == "bam") model.architecture.scorer.attention_bias = false;
    if (o.arch == "mlp") model.architecture.scorer.mlp_bias = false;
  }
  NAMM_ASSIGN_OR_RETURN(model.architecture.selection, parse_selection_spec(o.selection));
  if (o.precision == "bf16") {
    model.architecture.attention_precision = AttentionPrecision::kBf16;
  } else if (o.precision == "f32") {
    model.architecture.attention_precision = AttentionPrecision::kF32;
  } else {
    return Status::InvalidArgument("unknown --attention-precision '" + o.precision + "' (known: bf16, f32)");
  }
  model.architecture.budget_input = o.budget_input;
  NAMM_RETURN_IF_ERROR(model.architecture.Validate());

  const int64_t n = model.architecture.param_count();
  model.params = initial_params(model.architecture);
  if (o.seed) {
    if (!std::isfinite(o.scale) || o.scale < 0) return Status::InvalidArgument("--scale must be finite and >= 0");
    const int64_t scorer_n = scorer_param_count(model.architecture.scorer);
    std::vector<float> random = GaussianParams(static_cast<std::size_t>(scorer_n), *o.seed, o.scale);
    std::copy(random.begin(), random.end(), model.params.begin());
    model.metadata["init"] = "gaussian seed=" + std::to_string(*o.seed) + " scale=" + std::to_string(o.scale);
  } else if (!o.params_path.empty()) {
    NAMM_ASSIGN_OR_RETURN(std::vector<double> values, ReadVector(o.params_path, n, "--params"));
    model.params.assign(values.begin(), values.end());
    model.metadata["init"] = "imported from " + o.params_path;
  } else {
    model.metadata["init"] = "zero";
  }

  if (!o.norm_mean_path.empty()) {
    NAMM_ASSIGN_OR_RETURN(std::vector<double> mean, ReadVector(o.norm_mean_path, kStftBins, "--norm-mean"));
    NAMM_ASSIGN_OR_RETURN(std::vector<double> var, ReadVector(o.norm_var_path, kStftBins, "--norm-var"));
    for (std::size_t f = 0; f < mean.size(); ++f) {
      if (var[f] < 0) {
        return Status::InvalidArgument(o.norm_var_path + ": variance of bin " + std::to_string(f) + " is negative");
      }
      model.norm_stats.mean[f] = mean[f];
      model.norm_stats.var[f] = var[f];
    }
    if (o.norm_count < 1) return Status::InvalidArgument("--norm-count must be at least 1");
    model.norm_stats.count = o.norm_count;
    model.norm_state = NormState::kFrozen;
  }
  model.metadata["created_by"] = "namm-tool init";
  for (const auto& kv : o.meta) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) return Status::InvalidArgument("--meta expects KEY=VALUE, got '" + kv + "'");
    model.metadata[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  NAMM_RETURN_IF_ERROR(model.Validate());
  return model;
}

int RunInit(const InitOptions& o) {
  if (!o.force && path_exists(o.out)) {
    return Fail(o.out + " already exists (pass --force to overwrite it)");
  }
  auto model = BuildModel(o);
  if (!model.ok()) return Fail(model.status().message());
  Status written = write_namm_file(o.out, *model);
  if (!written.ok()) return Fail(written.message());
  std::cout << "wrote " << o.out << ": " << model->architecture.Describe() << ", " << model->params.size()
            << " parameters, normalization " << norm_state_name(model->norm_state) << "\n";
  return 0;
}

}  // namespace

void AddInitCommand(CLI::App& app, Action& run) {
  auto options = std::make_shared<InitOptions>();
  CLI::App* cmd = app.add_subcommand("init", "Write a new NAMM file");
  cmd->add_option("--arch", options->arch, "Scorer architecture: bam (the paper's NAMM) or mlp")->required();
  cmd->add_option("--hidden", options->hidden, "BAM attention width (default 32); the MLP's is fixed at 25");
  cmd->add_flag("--no-bias", options->no_bias,
                "BAM: no qkv/output biases (the final layer keeps its bias); MLP: no biases at all");
  cmd->add_option("--selection", options->selection,
                  "binary (keep score >= 0; default) | topk:budget=N | dynamic[:cap=N,init=LOG_THRESHOLD]");
  cmd->add_option("--attention-precision", options->precision,
                  "bf16 (round attention to bfloat16 like the reference; default) | f32");
  cmd->add_flag("--budget-input", options->budget_input,
                "The budget as an input: 25 more parameters, a learned embedding of the compression a budget asks "
                "(docs/namm-core.md); --seed leaves it at zeros, --params must hold it (its last 25 values)");
  auto* zero = cmd->add_flag("--zero", options->zero, "All-zero parameters: keeps every token (the base model)");
  auto* seed = cmd->add_option("--seed", options->seed, "Gaussian scorer parameters from this seed (needs --scale)");
  auto* scale = cmd->add_option("--scale", options->scale, "Standard deviation of the Gaussian parameters");
  auto* params = cmd->add_option("--params", options->params_path,
                                 "Import a float32 [N] vector in the reference's flat layout (.npy)");
  seed->needs(scale);
  scale->needs(seed);
  zero->excludes(seed)->excludes(params);
  seed->excludes(params);
  auto* mean = cmd->add_option("--norm-mean", options->norm_mean_path,
                               "float32 [17] normalization mean (.npy); stored frozen (needs --norm-var)");
  auto* var = cmd->add_option("--norm-var", options->norm_var_path, "float32 [17] normalization variance (.npy)");
  auto* count = cmd->add_option("--norm-count", options->norm_count,
                                "Number of samples behind --norm-mean/--norm-var (default 1; the reference's "
                                "token_embedding_0_output_num)");
  mean->needs(var);
  var->needs(mean);
  count->needs(mean);
  cmd->add_option("--meta", options->meta, "Provenance metadata KEY=VALUE (repeatable)");
  cmd->add_option("--out", options->out, "Output NAMM file (.safetensors)")->required();
  cmd->add_flag("--force", options->force, "Overwrite --out if it exists");
  cmd->callback([options, &run] {
    if (!options->zero && !options->seed && options->params_path.empty()) {
      throw CLI::RequiredError("one of --zero, --seed/--scale or --params");
    }
    run = [options] { return RunInit(*options); };
  });
}

}  // namespace namm::tool
