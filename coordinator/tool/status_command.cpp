// status: where each run of a database stands.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"

namespace namm::coordinator::cli {

namespace {

using nlohmann::json;

struct StatusOptions {
  std::string db;
  int64_t run = 0;  // 0: every run
  bool as_json = false;
  bool generations = false;  // every generation, not only the last
};

json OptionalJson(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

Result<json> RunStatus(const Store& store, const RunRecord& run, bool every_generation) {
  NAMM_ASSIGN_OR_RETURN(std::vector<StageRecord> stages, store.GetStages(run.id));
  if (run.stage < 0 || run.stage >= static_cast<int64_t>(stages.size())) {
    return Status::Corruption("run " + std::to_string(run.id) + " is at stage " + std::to_string(run.stage) +
                              " but has " + std::to_string(stages.size()) + " stage(s): the database is inconsistent");
  }
  NAMM_ASSIGN_OR_RETURN(std::vector<GenerationRecord> generations, store.GetGenerations(run.id));
  NAMM_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> checkpoints, store.ListCheckpoints(run.id));
  int64_t total = 0;
  for (const StageRecord& s : stages) total += s.generations;
  json j = {{"run", run.id},
            {"name", run.name},
            {"status", run.status},
            {"created_at", run.created_at},
            {"model_fingerprint", run.model_fingerprint},
            {"dimension", run.dimension},
            {"stage", run.stage},
            {"stages", stages.size()},
            {"stage_tasks", stages[static_cast<std::size_t>(run.stage)].tasks},
            {"generations_done", run.generation},
            {"generations_total", total},
            {"norm_stats_frozen", run.norm_stats.has_value()}};
  if (!generations.empty()) {
    const GenerationRecord& g = generations.back();
    j["last_generation"] = {{"generation", g.generation}, {"stage", g.stage},
                            {"fitness_best", g.fitness_best}, {"fitness_mean", g.fitness_mean},
                            {"fitness_std", g.fitness_std}, {"sigma", g.sigma},
                            {"completed_at", g.completed_at}};
    for (auto it = generations.rbegin(); it != generations.rend(); ++it) {
      if (it->eval_fitness) {
        j["last_evaluation"] = {{"generation", it->generation}, {"fitness", *it->eval_fitness}};
        break;
      }
    }
  }
  if (every_generation) {
    json rows = json::array();
    for (const GenerationRecord& g : generations) {
      rows.push_back({{"generation", g.generation}, {"stage", g.stage}, {"fitness_best", g.fitness_best},
                      {"fitness_mean", g.fitness_mean}, {"fitness_std", g.fitness_std}, {"sigma", g.sigma},
                      {"eval_fitness", OptionalJson(g.eval_fitness)}, {"completed_at", g.completed_at}});
    }
    j["generations"] = rows;
  }
  json cps = json::array();
  for (const CheckpointRecord& c : checkpoints) {
    cps.push_back({{"role", c.role}, {"stage", c.stage}, {"generation", c.generation},
                   {"eval_fitness", OptionalJson(c.eval_fitness)}, {"checksum", c.checksum},
                   {"created_at", c.created_at}});
  }
  j["checkpoints"] = cps;
  return j;
}

void PrintText(const json& j) {
  std::printf("run %lld '%s' (%s), model %s, %lld parameters, created %s\n", j["run"].get<long long>(),
              j["name"].get<std::string>().c_str(), j["status"].get<std::string>().c_str(),
              j["model_fingerprint"].get<std::string>().c_str(), j["dimension"].get<long long>(),
              j["created_at"].get<std::string>().c_str());
  std::string tasks;
  for (const auto& t : j["stage_tasks"]) tasks += (tasks.empty() ? "" : ", ") + t.get<std::string>();
  std::printf("  stage %lld of %lld [%s], %lld of %lld generations done%s\n", j["stage"].get<long long>() + 1,
              j["stages"].get<long long>(), tasks.c_str(), j["generations_done"].get<long long>(),
              j["generations_total"].get<long long>(),
              j["norm_stats_frozen"].get<bool>() ? "" : " (normalization statistics not collected yet)");
  if (j.contains("generations")) {
    std::printf("  %10s %5s %10s %10s %10s %10s %10s\n", "generation", "stage", "best", "mean", "std", "sigma",
                "eval mean");
    for (const json& g : j["generations"]) {
      const std::string eval = g["eval_fitness"].is_null() ? "" : std::to_string(g["eval_fitness"].get<double>());
      std::printf("  %10lld %5lld %10.4f %10.4f %10.4f %10.5f %10.10s\n", g["generation"].get<long long>(),
                  g["stage"].get<long long>(), g["fitness_best"].get<double>(), g["fitness_mean"].get<double>(),
                  g["fitness_std"].get<double>(), g["sigma"].get<double>(), eval.c_str());
    }
  }
  if (j.contains("last_generation")) {
    const json& g = j["last_generation"];
    std::printf("  generation %lld: fitness best %.6f, mean %.6f +- %.6f, sigma %.6g\n",
                g["generation"].get<long long>(), g["fitness_best"].get<double>(), g["fitness_mean"].get<double>(),
                g["fitness_std"].get<double>(), g["sigma"].get<double>());
  }
  if (j.contains("last_evaluation")) {
    std::printf("  mean evaluated at generation %lld: fitness %.6f\n",
                j["last_evaluation"]["generation"].get<long long>(), j["last_evaluation"]["fitness"].get<double>());
  }
  for (const json& c : j["checkpoints"]) {
    std::printf("  checkpoint %-10s stage %lld, starts generation %lld%s, crc32 %08llx, %s\n",
                c["role"].get<std::string>().c_str(), c["stage"].get<long long>(), c["generation"].get<long long>(),
                c["eval_fitness"].is_null() ? ""
                                            : (", evaluated " + std::to_string(c["eval_fitness"].get<double>())).c_str(),
                c["checksum"].get<unsigned long long>(), c["created_at"].get<std::string>().c_str());
  }
}

int RunStatusCommand(const StatusOptions& o) {
  auto store = Store::Open(o.db, OpenMode::kReadOnly);
  if (!store.ok()) return Fail(store.status().message());
  std::vector<RunRecord> runs;
  if (o.run != 0) {
    auto run = (*store)->GetRun(o.run);
    if (!run.ok()) return Fail(run.status().message());
    runs.push_back(*run);
  } else {
    auto all = (*store)->ListRuns();
    if (!all.ok()) return Fail(all.status().message());
    runs = *all;
  }
  // A run that cannot be shown is named and the others are still listed; the exit code says one failed.
  json out = json::array();
  int exit_code = 0;
  for (const RunRecord& r : runs) {
    auto j = RunStatus(**store, r, o.generations);
    if (!j.ok()) {
      exit_code = Fail(j.status().message());
      continue;
    }
    out.push_back(*j);
  }
  if (o.as_json) {
    std::cout << out.dump(2, ' ', false, json::error_handler_t::replace) << "\n";  // a name from an older build
  } else if (out.empty()) {
    std::cout << o.db << " holds no run yet\n";
  } else {
    for (const json& j : out) PrintText(j);
  }
  return exit_code;
}

}  // namespace

void AddStatusCommand(CLI::App& app, Action& run) {
  auto options = std::make_shared<StatusOptions>();
  CLI::App* cmd = app.add_subcommand("status", "Runs, stage, generation, fitness, sigma and checkpoints");
  cmd->add_option("--db", options->db, "Run database")->required();
  cmd->add_option("--run", options->run, "Only this run (default: every run)")->check(RunIdNumber());
  cmd->add_flag("--json", options->as_json, "Machine-readable output");
  cmd->add_flag("--generations", options->generations, "Every generation's fitness and sigma, not only the last");
  cmd->callback([options, &run] { run = [options] { return RunStatusCommand(*options); }; });
}

}  // namespace namm::coordinator::cli
