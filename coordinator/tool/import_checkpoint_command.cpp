// import-checkpoint: a NAMM file from the reference's ckpt.pt (reference_checkpoint.h) — its CMA-ES mean (the
// solution, spec §6.5) or best member, with its normalization statistics, in the reference's architecture.
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>

#include "commands.h"
#include "namm/coordinator/reference_checkpoint.h"
#include "namm/namm_file.h"

namespace namm::coordinator::cli {

namespace {

struct ImportCheckpointOptions {
  std::string checkpoint, out, params = "mean";
  bool force = false;
};

int RunImportCheckpoint(const ImportCheckpointOptions& o) {
  if (o.params != "mean" && o.params != "best") return Fail("--params must be mean or best, got '" + o.params + "'");
  if (!o.force && std::filesystem::exists(o.out)) return Fail(o.out + " exists; pass --force to overwrite it");
  auto checkpoint = read_reference_checkpoint(o.checkpoint);
  if (!checkpoint.ok()) return Fail(checkpoint.status().message());
  NammModel model;  // the reference's architecture (BAM scorer, binary selection)
  const std::vector<double>& params = o.params == "mean" ? checkpoint->mean : checkpoint->best_member;
  if (static_cast<int64_t>(params.size()) != model.architecture.param_count()) {
    return Fail(o.checkpoint + " holds " + std::to_string(params.size()) + " parameters; the reference's NAMM (" +
                model.architecture.Describe() + ") has " + std::to_string(model.architecture.param_count()));
  }
  for (double v : params) {
    if (std::fabs(v) > std::numeric_limits<float>::max()) return Fail(o.checkpoint + " holds a parameter beyond float32");
    model.params.push_back(static_cast<float>(v));
  }
  if (checkpoint->norm_stats) {
    model.norm_state = NormState::kFrozen;
    model.norm_stats = *checkpoint->norm_stats;
  }
  model.metadata = {{"source", "reference checkpoint " + o.checkpoint},
                    {"params", o.params},
                    {"iter_num", std::to_string(checkpoint->iter_num)},
                    {"best_val_loss", std::to_string(checkpoint->best_val_loss)}};
  if (const Status written = write_namm_file(o.out, model); !written.ok()) return Fail(written.message());
  std::cout << "wrote " << o.out << ": the " << o.params << " of " << o.checkpoint << " (iteration "
            << checkpoint->iter_num << ", sigma " << checkpoint->sigma << "), " << model.params.size() << " parameters"
            << (checkpoint->norm_stats ? "" : " (no normalization statistics: they will be collected)") << "\n";
  return 0;
}

}  // namespace

void AddImportCheckpointCommand(CLI::App& app, Action& run) {
  auto options = std::make_shared<ImportCheckpointOptions>();
  CLI::App* cmd = app.add_subcommand("import-checkpoint", "Write a NAMM file from the reference's ckpt.pt");
  cmd->add_option("--checkpoint", options->checkpoint, "The reference's ckpt.pt (torch.save format)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--params", options->params, "mean (the solution, default) or best (best member)");
  cmd->add_option("--out", options->out, "Output NAMM file (.safetensors)")->required();
  cmd->add_flag("--force", options->force, "Overwrite --out if it exists");
  cmd->callback([options, &run] { run = [options] { return RunImportCheckpoint(*options); }; });
}

}  // namespace namm::coordinator::cli
