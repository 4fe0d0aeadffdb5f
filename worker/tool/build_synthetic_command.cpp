// namm-worker build-synthetic: write the rows of the CPU-scale story-recall task (tasks/README.md).
#include <filesystem>
#include <iostream>

#include "commands.h"
#include "namm/file_util.h"
#include "namm/worker/synthetic_stories.h"
#include "setup.h"

namespace namm::worker::cli {

namespace {

struct BuildOptions {
  ModelOptions model;
  StoryRecallOptions story;
  std::string out;
};

Status Build(const BuildOptions& o) {
  NAMM_ASSIGN_OR_RETURN(LoadedModelAndTokenizer loaded, LoadModelAndTokenizer(o.model));
  NAMM_ASSIGN_OR_RETURN(std::vector<nlohmann::json> rows,
                        build_story_recall_rows(*loaded.model, *loaded.tokenizer, o.story, [](int64_t done, int64_t total) {
                          if (done == total || done % 16 == 0) std::cerr << "sampled " << done << "/" << total << " stories\n";
                        }));
  std::string text;
  for (const auto& row : rows) text += row.dump() + "\n";
  // The data directory may not exist yet on a fresh checkout.
  std::error_code ec;
  if (const auto dir = std::filesystem::path(o.out).parent_path(); !dir.empty()) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::IOError(dir.string() + ": cannot create the directory: " + ec.message());
  }
  NAMM_RETURN_IF_ERROR(write_file_atomically(o.out, {text}));
  std::cout << "wrote " << rows.size() << " rows to " << o.out << "\n";
  return Status::Ok();
}

}  // namespace

void AddBuildSyntheticCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<BuildOptions>();
  CLI::App* cmd = app.add_subcommand(
      "build-synthetic", "Sample the story-recall rows (syn/* tasks) with the model: deterministic from --seed");
  AddModelOptions(cmd, o->model);
  cmd->add_option("--out", o->out, "Output JSONL, e.g. DIR/story_recall.jsonl (pass --data-dir synthetic=DIR to "
                                   "run-task)")->required();
  cmd->add_option("--rows", o->story.rows, "Rows (default 128)")->check(CLI::PositiveNumber);
  cmd->add_option("--seed", o->story.seed, "Seed (default 1)");
  cmd->add_option("--pool", o->story.pool, "Stories to sample (default 64)")->check(CLI::Range(2, 100000));
  cmd->add_option("--story-tokens", o->story.story_tokens, "Tokens per story (default 300)")->check(CLI::PositiveNumber);
  cmd->add_option("--prefix-tokens", o->story.prefix_tokens, "Target story prefix in the prompt (default 200)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--continuation-tokens", o->story.continuation_tokens, "Scored continuation (default 60)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--distractor-tokens", o->story.distractor_tokens, "Distractor tokens in front (default 1400)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", o->story.temperature, "Sampling temperature (default 0.7)")->check(CLI::PositiveNumber);
  cmd->callback([o, &run] {
    run = [o] {
      Status s = Build(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::worker::cli
