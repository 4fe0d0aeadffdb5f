// namm-tool info: describe a NAMM file.
#include <cmath>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "namm/namm_file.h"

namespace namm::tool {

namespace {

struct InfoOptions {
  std::string path;
  bool json = false;
};

int RunInfo(const InfoOptions& o) {
  auto model = read_namm_file(o.path);
  if (!model.ok()) return Fail(model.status().message());
  const auto& m = *model;
  double sum_sq = 0, max_abs = 0;
  int64_t nonzero = 0;
  for (float p : m.params) {
    sum_sq += static_cast<double>(p) * p;
    max_abs = std::max(max_abs, std::fabs(static_cast<double>(p)));
    nonzero += p != 0.0f;
  }
  const double l2 = std::sqrt(sum_sq);
  if (o.json) {
    nlohmann::ordered_json j;
    j["path"] = o.path;
    j["architecture"] = nlohmann::ordered_json::parse(m.architecture.ToJson());
    j["param_count"] = m.params.size();
    j["params"] = {{"l2_norm", l2}, {"max_abs", max_abs}, {"nonzero", nonzero}};
    j["normalization"] = {{"state", norm_state_name(m.norm_state)},
                          {"count", m.norm_stats.count},
                          {"mean", m.norm_stats.mean},
                          {"var", m.norm_stats.var}};
    j["metadata"] = m.metadata;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "file:          " << o.path << "\n"
            << "architecture:  " << m.architecture.Describe() << "\n"
            << "parameters:    " << m.params.size() << " (L2 norm " << l2 << ", max |p| " << max_abs << ", "
            << nonzero << " non-zero)\n"
            << "normalization: " << norm_state_name(m.norm_state) << ", " << m.norm_stats.count << " samples\n";
  std::cout << std::setprecision(6);
  std::cout << "  mean:";
  for (double v : m.norm_stats.mean) std::cout << " " << v;
  std::cout << "\n  var: ";
  for (double v : m.norm_stats.var) std::cout << " " << v;
  std::cout << "\nmetadata:" << (m.metadata.empty() ? " (none)" : "") << "\n";
  for (const auto& [key, value] : m.metadata) std::cout << "  " << key << ": " << value << "\n";
  return 0;
}

}  // namespace

void AddInfoCommand(CLI::App& app, Action& run) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* cmd = app.add_subcommand("info", "Describe a NAMM file: architecture, parameters, statistics, metadata");
  cmd->add_option("file", options->path, "NAMM file (.safetensors)")->required();
  cmd->add_flag("--json", options->json, "Print JSON instead of text");
  cmd->callback([options, &run] { run = [options] { return RunInfo(*options); }; });
}

}  // namespace namm::tool
