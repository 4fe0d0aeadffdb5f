// export: a NAMM file from a run — the mean (the solution, spec §6.5) or the best candidate, at a generation,
// at the latest checkpoint, or at the best checkpoint — with its normalization statistics and provenance; or, with
// --format reference, the checkpoint's whole optimizer state as the reference's ckpt.pt (reference_checkpoint.h).
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>

#include "commands.h"
#include "namm/coordinator/reference_checkpoint.h"
#include "namm/namm_file.h"

namespace namm::coordinator::cli {

namespace {

struct ExportOptions {
  std::string db, out, params = "mean", format = "namm";
  int64_t run = 0;
  int64_t generation = -1;
  bool best = false, latest = false, force = false;
};

// What was picked from the run.
struct Picked {
  std::vector<double> params;
  int64_t stage = 0, generation = 0;
  std::optional<double> fitness;
  std::string source;
  std::optional<CmaesState> state;  // when picked from a checkpoint
};

Result<Picked> Pick(const Store& store, const OpenedRun& r, const ExportOptions& o) {
  const bool mean = o.params == "mean";
  Picked p;
  if (o.generation >= 0) {
    NAMM_ASSIGN_OR_RETURN(GenerationRecord g, store.GetGeneration(r.run.id, o.generation));
    p.params = mean ? g.mean : g.best_params;
    p.fitness = mean ? g.eval_fitness : std::optional<double>(g.fitness_best);
    p.stage = g.stage;
    p.generation = g.generation;
    p.source = mean ? "generation mean" : "generation best candidate";
    return p;
  }
  if (!mean && r.spec.rank_fitness) {
    // tell() keeps the candidate of the highest fitness seen, and ranks in one generation do not compare with
    // another's: the first generation's top candidate (rank 1) would stay "best" for the whole run.
    return Status::InvalidArgument(
        "run " + std::to_string(r.run.id) + " ranks its candidates within each generation (fitness: mean_rank), so no "
        "candidate is best across generations: export a generation's best with --generation G --params best, or "
        "the mean");
  }
  CheckpointRecord c;
  if (o.best) {
    // The best checkpoint of the latest stage that has one: what that stage handed (or will hand) over.
    NAMM_ASSIGN_OR_RETURN(std::vector<StageRecord> stages, store.GetStages(r.run.id));
    int64_t stage = -1;
    for (const StageRecord& s : stages) {
      if (s.best_eval_fitness) stage = s.stage;
    }
    if (stage < 0) {
      return Status::NotFound("run " + std::to_string(r.run.id) +
                              " has no best checkpoint yet (no eligible evaluation of the mean); use --latest");
    }
    NAMM_ASSIGN_OR_RETURN(c, store.GetCheckpoint(r.run.id, "stage_best", stage, r.params));
    p.source = "stage best checkpoint";
  } else {
    NAMM_ASSIGN_OR_RETURN(c, store.GetCheckpoint(r.run.id, "latest", 0, r.params));
    p.source = "latest checkpoint";
  }
  p.params = mean ? c.state.mean : c.state.best_member;
  p.fitness = mean ? c.eval_fitness
                   : (std::isfinite(c.state.best_fitness) ? std::optional<double>(c.state.best_fitness) : std::nullopt);
  p.stage = c.stage;
  p.generation = c.generation;
  p.source += mean ? " (mean)" : " (best member)";
  p.state = std::move(c.state);
  return p;
}

// The checkpoint's state with its covariance: checkpoints keep none, the snapshot of the same generation does.
Result<CmaesState> CompleteState(const Store& store, const OpenedRun& r, const Picked& p) {
  NAMM_ASSIGN_OR_RETURN(std::vector<SnapshotRecord> snapshots, store.ListSnapshots(r.run.id));
  std::string latest = "none";
  for (const SnapshotRecord& s : snapshots) {
    if (s.stage == p.stage && s.generation == p.generation) {
      NAMM_ASSIGN_OR_RETURN(SnapshotRecord full, store.GetSnapshot(r.run.id, s.id, r.params));
      return std::move(full.state);
    }
    latest = "stage " + std::to_string(s.stage) + " generation " + std::to_string(s.generation);
  }
  const std::string advice =
      r.run.status == "finished"
          ? "a finished run keeps the snapshot of its final state only: export --latest"
          : "a full-covariance run snapshots every few generations (and its final state when it finishes): export "
            "again once it has written one here, or pick the checkpoint that has it";
  return Status::NotFound("the run keeps no covariance snapshot of stage " + std::to_string(p.stage) +
                          " generation " + std::to_string(p.generation) + " (its latest: " + latest +
                          "); the reference's format needs C. " + advice);
}

int WriteReference(const Store& store, const ExportOptions& o, const OpenedRun& r, const Picked& p) {
  if (!p.state) {
    return Fail("--format reference writes the whole optimizer state, which only checkpoints keep: pick --latest or "
                "--best, not --generation");
  }
  auto state = CompleteState(store, r, p);
  if (!state.ok()) return Fail(state.status().message());
  state->best_member = p.state->best_member;  // tracked by the checkpoint, not the snapshot
  state->best_fitness = p.state->best_fitness;
  const Status written = write_reference_checkpoint(o.out, r.params, *state, r.run.norm_stats, p.generation,
                                                    p.fitness.value_or(0.0));
  if (!written.ok()) return Fail(written.message());
  std::cout << "wrote " << o.out << " (the reference's ckpt.pt): run " << r.run.id << " '" << r.run.name << "', "
            << p.source.substr(0, p.source.find(" (")) << ", generation " << p.generation << ", N = "
            << r.params.dimension << ", lambda = " << r.params.population
            << (r.run.norm_stats ? "" : " (no normalization statistics collected yet)") << "\n";
  return 0;
}

int RunExport(const ExportOptions& o) {
  if (o.params != "mean" && o.params != "best") return Fail("--params must be mean or best, got '" + o.params + "'");
  if (o.format != "namm" && o.format != "reference") {
    return Fail("--format must be namm or reference, got '" + o.format + "'");
  }
  if (!o.force && std::filesystem::exists(o.out)) return Fail(o.out + " exists; pass --force to overwrite it");
  auto store = Store::Open(o.db, OpenMode::kReadOnly);
  if (!store.ok()) return Fail(store.status().message());
  auto opened = OpenRun(**store, o.run);
  if (!opened.ok()) return Fail(opened.status().message());
  auto picked = Pick(**store, *opened, o);
  if (!picked.ok()) return Fail(picked.status().message());
  if (o.format == "reference") return WriteReference(**store, o, *opened, *picked);

  NammModel model;
  model.architecture = opened->spec.architecture;
  for (double v : picked->params) {
    if (!std::isfinite(v) || std::fabs(v) > std::numeric_limits<float>::max()) {
      return Fail("the picked parameters hold a value that is not a finite float32: " + std::to_string(v));
    }
    model.params.push_back(static_cast<float>(v));
  }
  if (opened->run.norm_stats) {
    model.norm_state = NormState::kFrozen;
    model.norm_stats = *opened->run.norm_stats;
  }
  model.metadata = {{"run", std::to_string(opened->run.id)},
                    {"run_name", opened->run.name},
                    {"database", o.db},
                    {"model_fingerprint", opened->run.model_fingerprint},
                    {"stage", std::to_string(picked->stage)},
                    {"generation", std::to_string(picked->generation)},
                    {"params", o.params},
                    {"source", picked->source}};
  if (picked->fitness) model.metadata["fitness"] = std::to_string(*picked->fitness);
  const Status written = write_namm_file(o.out, model);
  if (!written.ok()) return Fail(written.message());
  std::cout << "wrote " << o.out << ": run " << opened->run.id << " '" << opened->run.name << "', "
            << picked->source << ", stage " << picked->stage << ", generation " << picked->generation
            << (picked->fitness ? ", fitness " + std::to_string(*picked->fitness) : std::string()) << ", "
            << model.params.size() << " parameters"
            << (opened->run.norm_stats ? "" : " (no normalization statistics collected yet)") << "\n";
  return 0;
}

}  // namespace

void AddExportCommand(CLI::App& app, Action& run) {
  auto options = std::make_shared<ExportOptions>();
  CLI::App* cmd = app.add_subcommand("export", "Write a NAMM file (.safetensors) or a reference ckpt.pt from a run");
  cmd->add_option("--db", options->db, "Run database")->required();
  cmd->add_option("--run", options->run, "Run id (default: the newest run)")->check(RunIdNumber());
  auto* generation = cmd->add_option("--generation", options->generation,
                                     "A completed generation: its mean (as sampled around) or its best candidate")
                        ->check(CLI::Range(int64_t{0}, std::numeric_limits<int64_t>::max()));
  auto* best = cmd->add_flag("--best", options->best,
                             "The best checkpoint (best evaluation of the mean) of the latest stage that has one");
  auto* latest = cmd->add_flag("--latest", options->latest, "The latest checkpoint (the default)");
  generation->excludes(best)->excludes(latest);
  best->excludes(latest);
  cmd->add_option("--params", options->params, "mean (the solution, default) or best (best candidate seen)");
  cmd->add_option("--out", options->out, "Output file: a NAMM file (.safetensors), or ckpt.pt with --format reference")
      ->required();
  cmd->add_option("--format", options->format,
                  "namm (a NAMM file, the default) or reference (the reference's ckpt.pt: the checkpoint's whole "
                  "CMA-ES state and normalization statistics, for its Python code)");
  cmd->add_flag("--force", options->force, "Overwrite --out if it exists");
  cmd->callback([options, &run] { run = [options] { return RunExport(*options); }; });
}

}  // namespace namm::coordinator::cli
