// namm-worker build-synthetic: write the rows of the CPU-scale story-recall task (tasks/README.md).
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <iostream>

#include "commands.h"
#include "namm/file_util.h"
#include "namm/worker/synthetic_stories.h"
#include "setup.h"

namespace namm::worker::cli {

namespace {

struct BuildOptions {
  ModelOptions model;
  std::string family = "story_recall";
  StoryRecallOptions story;
  InterruptionOptions interruption;
  std::string kind = "mix", prefix, interruption_length, resume;
  bool continuation_given = false;
  std::string seed = "1", out;
  std::vector<std::string> given;  // the options given on the command line
};

// Options that only one family reads: given for the other, they were ignored.
constexpr std::pair<const char*, const char*> kFamilyOptions[] = {
    {"--prefix-tokens", "story_recall"},   {"--distractor-tokens", "story_recall"}, {"--kind", "interruption"},
    {"--prefix-range", "interruption"},    {"--interruption-range", "interruption"}, {"--resume-range", "interruption"}};

// A seed in 0..2^64-1, in decimal digits only (a parse into an unsigned integer wrapped "-1" and clamped larger
// numbers, so different seeds wrote the same rows).
Result<uint64_t> ParseSeed(const std::string& text) {
  const bool digits = !text.empty() && text.size() <= 20 &&
                      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  errno = 0;
  const unsigned long long seed = digits ? std::strtoull(text.c_str(), nullptr, 10) : 0;
  if (!digits || errno == ERANGE) {
    return Status::InvalidArgument("--seed expects an integer in 0.." + std::to_string(UINT64_MAX) + ", got '" + text + "'");
  }
  return static_cast<uint64_t>(seed);
}

// "A:B" or "N" -> [A, B].
Status ParseRange(const std::string& flag, const std::string& text, int64_t* lo, int64_t* hi) {
  if (text.empty()) return Status::Ok();
  try {
    const auto colon = text.find(':');
    std::size_t used = 0;
    *lo = std::stoll(text.substr(0, colon), &used);
    if (used != (colon == std::string::npos ? text.size() : colon)) throw std::invalid_argument(text);
    *hi = colon == std::string::npos ? *lo : std::stoll(text.substr(colon + 1), &used);
    if (colon != std::string::npos && used != text.size() - colon - 1) throw std::invalid_argument(text);
  } catch (const std::exception&) {
    return Status::InvalidArgument(flag + " expects MIN:MAX or N, got '" + text + "'");
  }
  return Status::Ok();
}

Status Build(BuildOptions o) {
  const auto progress = [](int64_t done, int64_t total) {
    if (done == total || done % 16 == 0) std::cerr << "sampled " << done << "/" << total << " stories\n";
  };
  for (const auto& [option, family] : kFamilyOptions) {
    if (family != o.family && std::find(o.given.begin(), o.given.end(), option) != o.given.end()) {
      return Status::InvalidArgument(std::string(option) + " applies to --family " + family + " only, not " + o.family);
    }
  }
  NAMM_ASSIGN_OR_RETURN(o.story.seed, ParseSeed(o.seed));
  std::vector<nlohmann::json> rows;
  if (o.family == "interruption") {
    NAMM_ASSIGN_OR_RETURN(o.interruption.kind, parse_interruption_kind(o.kind));
    NAMM_RETURN_IF_ERROR(ParseRange("--prefix-range", o.prefix, &o.interruption.prefix_min, &o.interruption.prefix_max));
    NAMM_RETURN_IF_ERROR(ParseRange("--interruption-range", o.interruption_length, &o.interruption.interruption_min,
                                    &o.interruption.interruption_max));
    NAMM_RETURN_IF_ERROR(ParseRange("--resume-range", o.resume, &o.interruption.resume_min, &o.interruption.resume_max));
    o.interruption.rows = o.story.rows;
    o.interruption.seed = o.story.seed;
    o.interruption.pool = o.story.pool;
    o.interruption.story_tokens = o.story.story_tokens;
    o.interruption.temperature = o.story.temperature;
    if (o.continuation_given) o.interruption.continuation_tokens = o.story.continuation_tokens;
    NAMM_ASSIGN_OR_RETURN(LoadedModelAndTokenizer loaded, LoadModelAndTokenizer(o.model));
    NAMM_ASSIGN_OR_RETURN(rows, build_interruption_rows(*loaded.model, *loaded.tokenizer, o.interruption, progress));
  } else {
    NAMM_ASSIGN_OR_RETURN(LoadedModelAndTokenizer loaded, LoadModelAndTokenizer(o.model));
    NAMM_ASSIGN_OR_RETURN(rows, build_story_recall_rows(*loaded.model, *loaded.tokenizer, o.story, progress));
  }
  std::string text;
  for (const auto& row : rows) text += row.dump() + "\n";
  // The data directory may not exist yet on a fresh checkout.
  NAMM_RETURN_IF_ERROR(make_directories(parent_directory(o.out)));
  NAMM_RETURN_IF_ERROR(write_file_atomically(o.out, {text}));
  std::cout << "wrote " << rows.size() << " rows to " << o.out << "\n";
  return Status::Ok();
}

}  // namespace

void AddBuildSyntheticCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<BuildOptions>();
  CLI::App* cmd = app.add_subcommand(
      "build-synthetic", "Sample the rows of a synthetic task (syn/* tasks) with the model: deterministic from --seed");
  AddModelOptions(cmd, o->model);
  cmd->add_option("--family", o->family, "story_recall (default: syn/story_recall*) or interruption (syn/interruption*)")
      ->check(CLI::IsMember({"story_recall", "interruption"}));
  cmd->add_option("--out", o->out, "Output JSONL, e.g. DIR/story_recall.jsonl (pass --data-dir synthetic=DIR to "
                                   "run-task)")->required();
  cmd->add_option("--rows", o->story.rows, "Rows (default 128)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--seed", o->seed, "Seed, 0..2^64-1 (default 1)");
  cmd->add_option("--pool", o->story.pool, "Stories to sample (default 64)")->check(CLI::Range(2, 100000));
  cmd->add_option("--story-tokens", o->story.story_tokens, "Tokens per story (default 300)")->check(CLI::PositiveNumber);
  cmd->add_option("--prefix-tokens", o->story.prefix_tokens, "Target story prefix in the prompt (default 200)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--continuation-tokens", o->story.continuation_tokens,
                  "Scored continuation (default 60; interruption: 48)")
      ->check(CLI::PositiveNumber)
      ->each([o](const std::string&) { o->continuation_given = true; });
  cmd->add_option("--distractor-tokens", o->story.distractor_tokens, "Distractor tokens in front (default 1400)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", o->story.temperature, "Sampling temperature, positive (default 0.7)");
  cmd->add_option("--kind", o->kind, "Interruption: random (tokens), stories (other stories) or mix (either, per row; "
                                     "default)");
  cmd->add_option("--prefix-range", o->prefix, "Interruption: story tokens before it, MIN:MAX (default 64:160)");
  cmd->add_option("--interruption-range", o->interruption_length, "Interruption: its length, MIN:MAX (default 128:256)");
  cmd->add_option("--resume-range", o->resume, "Interruption: story tokens after it, before the answer, MIN:MAX "
                                               "(default 0:32)");
  cmd->callback([o, cmd, &run] {
    for (const auto& [option, family] : kFamilyOptions) {
      if (cmd->count(option) > 0) o->given.push_back(option);
    }
    run = [o] {
      Status s = Build(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::worker::cli
