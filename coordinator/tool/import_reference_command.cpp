// import-reference: base-model per-prompt scores (the reference's JSON format) into a database.
#include <iostream>

#include "commands.h"
#include "namm/tasks/normalized_score.h"

namespace namm::coordinator::cli {

namespace {

struct ImportOptions {
  std::string db, fingerprint, json;
  bool replace = false;
};

int RunImport(const ImportOptions& o) {
  auto scores = tasks::ReferenceScores::Load(o.json);
  if (!scores.ok()) return Fail(scores.status().message());
  auto store = Store::Open(o.db, OpenMode::kCreate);
  if (!store.ok()) return Fail(store.status().message());
  auto summary = (*store)->ImportReferenceScores(o.fingerprint, *scores, o.json, o.replace);
  if (!summary.ok()) return Fail(summary.status().message());
  std::cout << "imported reference scores of " << scores->scores().size() << " tasks for model " << o.fingerprint
            << " into " << o.db << ": " << summary->added << " added, " << summary->unchanged << " unchanged, "
            << summary->replaced << " replaced\n";
  return 0;
}

}  // namespace

void AddImportReferenceCommand(CLI::App& app, Action& run) {
  auto options = std::make_shared<ImportOptions>();
  CLI::App* cmd = app.add_subcommand(
      "import-reference",
      "Import base-model (full cache) per-prompt scores: {\"<task>\": {\"<row>\": score}} or the reference's "
      "aggregate file");
  cmd->add_option("--db", options->db, "Run database (created if missing)")->required();
  cmd->add_option("--model-fingerprint", options->fingerprint,
                  "The model the scores belong to (a run spec's model.fingerprint)")
      ->required();
  cmd->add_option("--json", options->json, "Scores file")->required()->check(CLI::ExistingFile);
  cmd->add_flag("--replace", options->replace, "Overwrite stored scores that differ (default: refuse the import)");
  cmd->callback([options, &run] { run = [options] { return RunImport(*options); }; });
}

}  // namespace namm::coordinator::cli
