#include "namm/coordinator/trainer.h"

#include <SQLiteCpp/SQLiteCpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "../process_util.h"
#include "../temp_path.h"
#include "namm/coordinator/prompt_costs.h"
#include "namm/coordinator/prompt_sampler.h"
#include "namm/coordinator/spec_revision.h"
#include "namm/coordinator/stage_schedule.h"
#include "namm/namm_file.h"
#include "namm/tasks/task_variant.h"
#include "synthetic_run.h"

namespace namm::coordinator {
namespace {

using namespace namm::coordinator::testing;

using namm::testing::FreshDatabasePath;
using namm::testing::TempPath;

struct SyntheticRun {
  std::unique_ptr<Store> store;
  std::unique_ptr<Trainer> trainer;
};

SyntheticRun StartSyntheticRun(const std::string& db, const std::string& yaml = SyntheticSpecYaml()) {
  SyntheticRun r;
  r.store = Store::Open(db, OpenMode::kCreate).value();
  const RunSpec spec = *parse_run_spec(yaml, "spec");
  EXPECT_TRUE(r.store->ImportReferenceScores("synthetic-model", SyntheticReference(spec.architecture.param_count()),
                                             "test", false)
                  .ok());
  auto t = Trainer::Create(*r.store, spec, SyntheticTaskRows());
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  r.trainer = std::move(*t);
  return r;
}

TEST(StageSchedule, FollowsTheReferenceRecipe) {
  const StageSchedule s({300, 250, 120}, 10);
  EXPECT_EQ(s.total_generations(), 670);
  const ScheduledGeneration g0 = s.At(0), g10 = s.At(10), g299 = s.At(299), g300 = s.At(300), g305 = s.At(305),
                            g550 = s.At(550), g669 = s.At(669);
  EXPECT_TRUE(g0.evaluate_mean && g0.stage_start && !g0.eval_eligible);
  EXPECT_TRUE(g10.evaluate_mean && g10.eval_eligible);
  EXPECT_TRUE(g299.stage_end && !g299.evaluate_mean && g299.stage == 0);
  EXPECT_TRUE(g300.stage == 1 && g300.stage_start && g300.evaluate_mean && !g300.eval_eligible);
  EXPECT_FALSE(g305.evaluate_mean);
  EXPECT_EQ(g550.stage, 2);
  EXPECT_EQ(g550.index_in_stage, 0);
  EXPECT_TRUE(g669.stage_end && g669.stage == 2);
  // A stage start off the interval is still evaluated (forced), and not eligible.
  const StageSchedule odd({7, 5}, 10);
  EXPECT_TRUE(odd.At(7).evaluate_mean && !odd.At(7).eval_eligible);
  EXPECT_FALSE(odd.At(8).evaluate_mean);
}

TEST(PromptSampler, DrawsDistinctSortedPromptsAsAPureFunctionOfSeedGenerationAndTask) {
  const auto a = sample_prompts(1337, 4, "lb/dureader", 200, 64);
  ASSERT_EQ(a.size(), 64u);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_EQ(std::set<int64_t>(a.begin(), a.end()).size(), 64u);
  EXPECT_GE(a.front(), 0);
  EXPECT_LT(a.back(), 200);
  EXPECT_EQ(sample_prompts(1337, 4, "lb/dureader", 200, 64), a);
  EXPECT_NE(sample_prompts(1337, 5, "lb/dureader", 200, 64), a);
  EXPECT_NE(sample_prompts(1337, 4, "lb/narrativeqa", 200, 64), a);
  EXPECT_NE(sample_prompts(1338, 4, "lb/dureader", 200, 64), a);
  EXPECT_EQ(sample_prompts(1, 1, "t", 10, 64).size(), 10u);  // fewer rows than asked: all of them

  // Every prompt equally likely: over 2000 generations each of 200 rows is drawn 640 times on average
  // (binomial sd 21); a biased shuffle would leave rows far outside +-6 sd.
  std::vector<int> hits(200, 0);
  for (uint64_t g = 0; g < 2000; ++g) {
    for (int64_t row : sample_prompts(1337, g, "lb/passage_retrieval_en", 200, 64)) ++hits[static_cast<std::size_t>(row)];
  }
  for (int h : hits) {
    EXPECT_GT(h, 640 - 6 * 21);
    EXPECT_LT(h, 640 + 6 * 21);
  }
}

TEST(RunSpec, ParsesTheShippedSpecsAndNamesBadKeys) {
  for (const char* name : {"namm-bam-incremental.yaml", "stories-cpu.yaml"}) {
    auto spec = load_run_spec(std::string(NAMM_RUNS_DIR) + "/" + name);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->architecture.param_count(), 4172);
  }
  const RunSpec budgets = *load_run_spec(std::string(NAMM_RUNS_DIR) + "/interruption-budgets-cpu.yaml");
  EXPECT_EQ(budgets.stages[0].tasks,
            (std::vector<std::string>{"syn/interruption", "syn/interruption@budget=8", "syn/interruption@budget=16",
                                      "syn/interruption@budget=32", "syn/interruption@budget=64"}));
  const RunSpec paper = *load_run_spec(std::string(NAMM_RUNS_DIR) + "/namm-bam-incremental.yaml");
  EXPECT_EQ(paper.total_generations(), 670);
  EXPECT_EQ(paper.stages[2].tasks.size(), 3u);
  EXPECT_EQ(paper.cmaes.population, 32);
  EXPECT_EQ(paper.cmaes.sigma0, 0.065);
  EXPECT_EQ(paper.prompts_per_task, 64);
  EXPECT_EQ(paper.eval_prompts, 0);

  auto typo = parse_run_spec(SyntheticSpecYaml() + "eval_intervall: 3\n", "typo.yaml");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find("unknown key 'eval_intervall'"), std::string::npos);
  auto zero = parse_run_spec("name: x\nmodel: {path: p, fingerprint: f}\nstages: [{tasks: [a], generations: 0}]\n",
                             "zero.yaml");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("stages[0].generations must be in 1..1000000"), std::string::npos);
  auto no_fp = parse_run_spec("name: x\nmodel: {path: p}\nstages: [{tasks: [a], generations: 1}]\n", "fp.yaml");
  ASSERT_FALSE(no_fp.ok());
  EXPECT_NE(no_fp.status().message().find("missing 'fingerprint'"), std::string::npos);
  EXPECT_FALSE(parse_run_spec("name: x\nmodel: {path: p, fingerprint: f}\ncmaes: {population: 1}\n"
                              "stages: [{tasks: [a], generations: 1}]\n", "pop.yaml").ok());
  // A name that is not UTF-8 (it would be a protobuf string the workers cannot parse, and JSON's and HTML's).
  auto bytes = parse_run_spec("name: x\nmodel: {path: p, fingerprint: f}\nstages: [{tasks: [\"a\\xff\"], "
                              "generations: 1}]\n", "bytes.yaml");
  ASSERT_TRUE(bytes.ok()) << "an escape in a quoted string is the character U+00FF: valid";
  auto raw = parse_run_spec("name: \"bad\xff\xfename\"\nmodel: {path: p, fingerprint: f}\n"
                            "stages: [{tasks: [a], generations: 1}]\n", "raw.yaml");
  ASSERT_FALSE(raw.ok());
  EXPECT_EQ(raw.status().message(), "raw.yaml: name 'bad\xef\xbf\xbd\xef\xbf\xbdname' is not valid UTF-8");
  // Elsewhere (a comment) such bytes are no name: a stored spec from an older build still parses.
  EXPECT_TRUE(parse_run_spec("# caf\xe9\nname: x\nmodel: {path: p, fingerprint: f}\n"
                             "stages: [{tasks: [a], generations: 1}]\n", "comment.yaml").ok());
}

// The rows of every task of `spec`'s stages: a variant's are its base task's (SyntheticTaskRows).
std::map<std::string, int64_t> VariantRows(const RunSpec& spec) {
  std::map<std::string, int64_t> rows = SyntheticTaskRows();
  for (const StageSpec& stage : spec.stages) {
    for (const std::string& task : stage.tasks) rows.emplace(task, rows.at(tasks::base_task(task)));
  }
  return rows;
}

TEST(Trainer, RunsTheStatisticsPhaseThenGenerationsThenHandsOverTheStageBest) {
  SyntheticRun r = StartSyntheticRun(FreshDatabasePath("trainer.db"));
  Trainer& t = *r.trainer;
  // Phase 1: only the zero mean on the 6 evaluation prompts, collecting statistics.
  ASSERT_TRUE(t.plan().collect_norm_stats);
  ASSERT_EQ(t.plan().units.size(), 6u);
  for (const WorkUnit& u : t.plan().units) EXPECT_EQ(u.candidate, kMeanCandidate);
  auto early = t.Advance();
  ASSERT_FALSE(early.ok());
  EXPECT_NE(early.status().message().find("6 units of generation 0 have no result yet"), std::string::npos);
  ASSERT_TRUE(DriveRun(t, 1).ok());
  ASSERT_FALSE(t.plan().collect_norm_stats);
  NormStats expected;
  for (int64_t prompt : t.plan().eval_prompts.at("t/a")) expected = expected.Merge(SyntheticNormStats("t/a", prompt));
  ASSERT_TRUE(r.store->GetRun(t.run_id())->norm_stats.has_value());
  EXPECT_EQ(r.store->GetRun(t.run_id())->norm_stats->mean, expected.mean);
  // Generation 0 then needs only the population: the mean's evaluation is already recorded.
  EXPECT_EQ(t.Missing()->size(), 8u * 4u);

  std::vector<CmaesState> starts;  // the state each generation starts from
  while (!t.finished()) {
    starts.push_back(t.settled_state());
    ASSERT_TRUE(DriveRun(t, 1).ok());
  }
  auto generations = *r.store->GetGenerations(t.run_id());
  ASSERT_EQ(generations.size(), 5u);
  // Evaluations at 0 (stage start), 2 (eligible), 3 (stage 1 start, forced), 4 (eligible).
  EXPECT_TRUE(generations[0].eval_fitness && generations[2].eval_fitness && generations[3].eval_fitness &&
              generations[4].eval_fitness);
  EXPECT_FALSE(generations[1].eval_fitness);
  EXPECT_EQ(generations[3].samples.size(), 2u);  // stage 1 adds t/b
  EXPECT_EQ(generations[0].samples.at("t/a").size(), 4u);

  // Stage 0's best checkpoint is generation 2's start state (its only eligible evaluation), and stage 1 started
  // from it: same mean, covariance and optimizer generation, with fresh noise (draw = run generation 3).
  const CmaesParams& p = t.params();
  auto best = r.store->GetCheckpoint(t.run_id(), "stage_best", 0, p);
  ASSERT_TRUE(best.ok()) << best.status().ToString();
  EXPECT_EQ(best->generation, 2);
  EXPECT_EQ(*best->eval_fitness, *generations[2].eval_fitness);
  // The stored checkpoint is light (no covariance); the hand-over continued from the complete state.
  EXPECT_TRUE(best->state.covariance.empty());
  EXPECT_EQ(best->state.mean, starts[2].mean);
  EXPECT_EQ(best->state.sigma, starts[2].sigma);
  EXPECT_EQ(best->state.path_c, starts[2].path_c);
  EXPECT_EQ(best->state.generation, starts[2].generation);
  EXPECT_TRUE(starts[3] == starts[2]);
  EXPECT_EQ(generations[3].cmaes_generation, 2);
  EXPECT_EQ(generations[3].draw, 3u);
  EXPECT_TRUE(best->norm_stats.has_value());
  EXPECT_EQ(r.store->GetStages(t.run_id())->at(0).end_generation, 3);

  // Normalized fitness: the zero mean scores the base model exactly, 1 on every task.
  EXPECT_DOUBLE_EQ(*generations[0].eval_fitness, 1.0);
  auto metrics = *r.store->GetMetrics(t.run_id(), 2);
  EXPECT_EQ(metrics.at("eval_fitness"), *generations[2].eval_fitness);
  EXPECT_EQ(metrics.at("fitness_best"), generations[2].fitness_best);
  EXPECT_TRUE(metrics.count("eval_normalized/t/a"));
  EXPECT_EQ(r.store->GetRun(t.run_id())->status, "finished");
  EXPECT_EQ(r.store->GetCandidates(t.run_id(), 4)->size(), 8u);
}

// `namm.init: FILE`: the run starts at that NAMM's parameters with its frozen statistics (no statistics phase), read
// once at creation; a file of another architecture, or none, is refused naming the key, and so is a changed init on
// resume.
TEST(Trainer, ARunStartsFromANammFilesParametersAndStatistics) {
  const std::string zeros_yaml = SyntheticSpecYaml();
  NammModel start;
  start.architecture = parse_run_spec(zeros_yaml, "spec")->architecture;
  for (int64_t i = 0; i < start.architecture.param_count(); ++i) {  // t/a's optimum (synthetic_run.h)
    start.params.push_back(static_cast<float>(0.01 * (static_cast<double>(i % 7) - 3.0)));
  }
  start.norm_state = NormState::kFrozen;
  start.norm_stats = SyntheticNormStats("t/a", 3);
  const std::string file = TempPath("init-namm.safetensors");
  ASSERT_TRUE(write_namm_file(file, start).ok());
  auto with_init = [&](const std::string& path) {
    std::string yaml = zeros_yaml;
    yaml.replace(yaml.find("selection: binary}"), 18, "selection: binary, init: '" + path + "'}");
    return yaml;
  };

  SyntheticRun r = StartSyntheticRun(FreshDatabasePath("init.db"), with_init(file));
  Trainer& t = *r.trainer;
  EXPECT_FALSE(t.plan().collect_norm_stats);
  ASSERT_TRUE(r.store->GetRun(t.run_id())->norm_stats.has_value());
  EXPECT_EQ(r.store->GetRun(t.run_id())->norm_stats->mean, start.norm_stats.mean);
  EXPECT_EQ(r.store->GetRun(t.run_id())->norm_stats->count, start.norm_stats.count);
  EXPECT_EQ(t.settled_state().mean, std::vector<double>(start.params.begin(), start.params.end()));
  ASSERT_TRUE(DriveRun(t, 1).ok());
  // The start scores t/a's optimum, far above the zero NAMM (which normalizes to exactly 1).
  EXPECT_GT(*r.store->GetGenerations(t.run_id())->at(0).eval_fitness, 1.05);
  // Read once: the run resumes with the file gone.
  std::filesystem::remove(file);
  const int64_t run_id = t.run_id();
  r.trainer.reset();
  auto resumed = Trainer::Resume(*r.store, run_id, SyntheticTaskRows());
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_FALSE((*resumed)->plan().collect_norm_stats);

  // On resume a changed (or dropped) init is refused: the run began from the stored one.
  const RunSpec stored = *parse_run_spec(with_init(file), "stored");
  const Status moved = check_spec_revision(stored, *parse_run_spec(with_init("/elsewhere/namm.safetensors"), "s"), false);
  EXPECT_NE(moved.message().find("namm.init"), std::string::npos) << moved.ToString();
  EXPECT_FALSE(check_spec_revision(stored, *parse_run_spec(zeros_yaml, "s"), false).ok());

  auto missing = Trainer::Create(*r.store, *parse_run_spec(with_init(file), "spec"), SyntheticTaskRows());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message().rfind("namm.init: ", 0), 0u) << missing.status().ToString();
  NammModel bam;
  bam.architecture.scorer = default_scorer_config(ScorerKind::kBam);
  bam.params = initial_params(bam.architecture);
  ASSERT_TRUE(write_namm_file(file, bam).ok());
  auto other = Trainer::Create(*r.store, *parse_run_spec(with_init(file), "spec"), SyntheticTaskRows());
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("namm.init: " + file + " is a NAMM of {\"scorer\":{\"kind\":\"bam\""),
            std::string::npos)
      << other.status().ToString();
  NammModel elsewhere = start;
  elsewhere.metadata["model_fingerprint"] = "another-model";
  ASSERT_TRUE(write_namm_file(file, elsewhere).ok());
  auto foreign = Trainer::Create(*r.store, *parse_run_spec(with_init(file), "spec"), SyntheticTaskRows());
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("was evolved on model another-model; this run's is synthetic-model"),
            std::string::npos)
      << foreign.status().ToString();
  EXPECT_EQ(r.store->ListRuns()->size(), 1u) << "a refused start leaves no run behind";
  // A NAMM without the budget input starts a spec with it, its embedding at zeros (scoring as the file does).
  ASSERT_TRUE(write_namm_file(file, start).ok());
  std::string budgeted = with_init(file);
  budgeted.replace(budgeted.find("init:"), 5, "budget_input: true, init:");
  budgeted.replace(budgeted.find("name: synthetic"), 15, "name: budgeted");
  auto padded = Trainer::Create(*r.store, *parse_run_spec(budgeted, "spec"), SyntheticTaskRows());
  ASSERT_TRUE(padded.ok()) << padded.status().ToString();
  std::vector<double> expected(start.params.begin(), start.params.end());
  expected.resize(expected.size() + kFeatureDim, 0.0);
  EXPECT_EQ((*padded)->settled_state().mean, expected);
  const Status empty = parse_run_spec(with_init(""), "spec").status();
  EXPECT_NE(empty.message().find("spec.namm.init: an empty path"), std::string::npos) << empty.ToString();
}

TEST(Trainer, RefusesResultsOutsideThePlan) {
  SyntheticRun r = StartSyntheticRun(FreshDatabasePath("refuse.db"));
  Trainer& t = *r.trainer;
  auto results = EvaluateUnits(t, {t.plan().units[0]});
  auto wrong_generation = results;
  wrong_generation[0].generation = 1;
  EXPECT_EQ(t.Record(wrong_generation).status().code(), Status::Code::kFailedPrecondition);
  auto unknown = results;
  unknown[0].prompt = 19;  // a row, but not one of the evaluation prompts
  if (!std::binary_search(t.plan().units.begin(), t.plan().units.end(), WorkUnit{kMeanCandidate, "t/a", 19})) {
    auto st = t.Record(unknown).status();
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
    EXPECT_NE(st.message().find("not a unit of the current plan"), std::string::npos);
  }
  auto no_stats = results;
  no_stats[0].norm_stats.reset();
  EXPECT_NE(t.Record(no_stats).status().message().find("needs the features' normalization statistics"),
            std::string::npos);
  EXPECT_EQ(t.Missing()->size(), t.plan().units.size());  // nothing was stored
  EXPECT_EQ(*t.Record(results), 1);
  EXPECT_EQ(*t.Record(results), 0);  // a duplicate is not counted twice
}

// budgets: [own, 8] turns each task into itself and its variant at budget 8; bad settings are named.
TEST(RunSpec, BudgetsTurnEachTaskIntoItsVariants) {
  std::string yaml = SyntheticSpecYaml();
  yaml.insert(yaml.find("stages:"), "budgets: [own, 8]\n");
  const RunSpec spec = parse_run_spec(yaml, "budgets.yaml").value();
  EXPECT_EQ(spec.stages[0].tasks, (std::vector<std::string>{"t/a", "t/a@budget=8"}));
  EXPECT_EQ(spec.stages[1].tasks, (std::vector<std::string>{"t/a", "t/a@budget=8", "t/b", "t/b@budget=8"}));
  std::string ratios = SyntheticSpecYaml();
  ratios.insert(ratios.find("stages:"), "ratios: [0.25]\n");
  EXPECT_EQ(parse_run_spec(ratios, "r.yaml")->stages[1].tasks, (std::vector<std::string>{"t/a@ratio=0.25", "t/b@ratio=0.25"}));
  for (const auto& [insert, says] : std::vector<std::pair<std::string, std::string>>{
           {"budgets: [8]\nratios: [0.5]\n", "give 'budgets' or 'ratios', not both"},
           {"budgets: [8, 8]\n", "budgets lists a value twice"},
           {"budgets: [0]\n", "stages[0].tasks: task 't/a@budget=0'"},
           {"ratios: [own, 2]\n", "(0, 1]"}}) {
    std::string bad = SyntheticSpecYaml();
    bad.insert(bad.find("stages:"), insert);
    const Result<RunSpec> parsed = parse_run_spec(bad, "bad.yaml");
    ASSERT_FALSE(parsed.ok()) << insert;
    EXPECT_NE(parsed.status().message().find(says), std::string::npos) << parsed.status().ToString();
  }
  // A task whose NAMM keeps the prompt (T@prompt=keep) keeps it at every budget.
  std::string keep = SyntheticSpecYaml();
  keep.insert(keep.find("stages:"), "budgets: [own, 8]\n");
  keep.replace(keep.find("[t/a]"), 5, "[t/a@prompt=keep]");
  EXPECT_EQ(parse_run_spec(keep, "keep.yaml")->stages[0].tasks,
            (std::vector<std::string>{"t/a@prompt=keep", "t/a@budget=8,prompt=keep"}));
  std::string own = SyntheticSpecYaml();  // and heads=own
  own.insert(own.find("stages:"), "budgets: [own, 8]\n");
  own.replace(own.find("[t/a]"), 5, "[t/a@heads=own]");
  EXPECT_EQ(parse_run_spec(own, "own.yaml")->stages[0].tasks,
            (std::vector<std::string>{"t/a@heads=own", "t/a@budget=8,heads=own"}));
  std::string named = SyntheticSpecYaml();
  named.replace(named.find("[t/a]"), 5, "[t/a@budget=x]");
  EXPECT_NE(parse_run_spec(named, "n.yaml").status().message().find("'t/a@budget=x'"), std::string::npos);
}

// What a hostile spec may cost is bounded before anything is copied or expanded: aliases mentioned many times,
// stages repeated by alias, budgets multiplying tasks, endless generations (issue 35).
TEST(RunSpec, RefusesSpecsThatWouldCostFarMoreThanTheirText) {
  const std::string head = "name: x\nmodel: {path: p, fingerprint: f}\n";
  std::string aliases = head + "stages: [{tasks: [&t " + std::string(300, 'a') + ", *t], generations: 1}]\n";
  std::string many_tasks = head + "stages: [{tasks: [";
  for (int i = 0; i < 1025; ++i) many_tasks += (i ? ", t" : "t") + std::to_string(i);
  many_tasks += "], generations: 1}]\n";
  std::string many_stages = head + "stages: [&s {tasks: [a], generations: 1}";
  for (int i = 0; i < 256; ++i) many_stages += ", *s";
  many_stages += "]\n";
  std::string product = head + "budgets: [";
  for (int i = 1; i <= 64; ++i) product += (i > 1 ? ", " : "") + std::to_string(i);
  product += "]\nstages: [{tasks: [";
  for (int i = 0; i < 17; ++i) product += (i ? ", t" : "t") + std::to_string(i);
  product += "], generations: 1}]\n";
  std::string run_tasks = head + "stages: [&s {tasks: [";
  for (int i = 0; i < 1000; ++i) run_tasks += (i ? ", t" : "t") + std::to_string(i);
  run_tasks += "], generations: 1}, *s, *s, *s, *s]\n";
  for (const auto& [yaml, says] : std::vector<std::pair<std::string, std::string>>{
           {aliases, "a name of 300 bytes, over the limit of 256"},
           {many_tasks, "stages[0].tasks lists 1025 items, over the limit of 1024"},
           {many_stages, "257 stages, over the limit of 256"},
           {product, "17 tasks at 64 budgets are over the limit of 1024 a stage"},
           {run_tasks, "the stages list 5000 tasks, over the limit of 4096"},
           {head + "stages: [{tasks: [a], generations: 1000000000000}]\n", "generations must be in 1..1000000"},
           {head + "stages: [{tasks: [a], generations: 600000}, {tasks: [a], generations: 600000}]\n",
            "the stages' generations must be in 1..1000000, got 1200000"},
           {head + "prompts_per_task: 10000000\nstages: [{tasks: [a], generations: 1}]\n",
            "prompts_per_task must be in 1..1000000"},
           {head + "eval_prompts: 10000000\nstages: [{tasks: [a], generations: 1}]\n", "eval_prompts must be in"},
           {std::string(2 << 20, '#'), "over a run spec's limit of 1048576"}}) {
    const Result<RunSpec> parsed = parse_run_spec(yaml, "hostile.yaml");
    ASSERT_FALSE(parsed.ok()) << says;
    EXPECT_NE(parsed.status().message().find(says), std::string::npos) << parsed.status().ToString();
  }
}

// Evolution over budgets: every candidate runs each task's variants on the base task's prompts (paired), its
// fitness is the mean of the variants' normalized scores, each stored as a task of its own, and the base
// model's reference runs once per base prompt.
TEST(Trainer, ARunOverBudgetsScoresEveryCandidateAtEachBudgetOnTheSamePrompts) {
  std::string yaml = SyntheticSpecYaml();
  yaml.insert(yaml.find("stages:"), "budgets: [own, 8]\n");
  const RunSpec spec = parse_run_spec(yaml, "spec").value();
  const std::map<std::string, int64_t> rows = VariantRows(spec);
  auto store = Store::Open(FreshDatabasePath("budgets.db"), OpenMode::kCreate).value();
  auto t = Trainer::Create(*store, spec, rows).value();
  std::set<std::string> reference_tasks;
  for (const auto& [task, prompt] : t->plan().missing_references) reference_tasks.insert(task);
  EXPECT_EQ(reference_tasks, (std::set<std::string>{"t/a"}));
  EXPECT_EQ(t->plan().missing_references.size(), 6u);
  ASSERT_TRUE(store->ImportReferenceScores("synthetic-model", SyntheticReference(spec.architecture.param_count()),
                                           "test", false).ok());
  // At budget 8 a candidate scores 0.8 of what it scores with its own selection.
  const Evaluator evaluate = [](const Trainer& trainer, const std::vector<WorkUnit>& units) {
    std::vector<EvaluationRecord> out = EvaluateUnits(trainer, units);
    for (EvaluationRecord& e : out) e.score *= e.task.find("@budget=8") != std::string::npos ? 0.8 : 1.0;
    return out;
  };
  ASSERT_TRUE(DriveRun(*t, 1, evaluate).ok());  // the statistics phase
  EXPECT_EQ(t->plan().samples.at("t/a"), t->plan().samples.at("t/a@budget=8"));
  ASSERT_TRUE(DriveRun(*t, 1, evaluate).ok());
  const std::vector<CandidateRecord> candidates = store->GetCandidates(t->run_id(), 0).value();
  ASSERT_EQ(candidates.size(), 8u);
  for (const CandidateRecord& c : candidates) {
    ASSERT_EQ(c.tasks.size(), 2u);
    const TaskScore& own = c.tasks.at("t/a");
    const TaskScore& eight = c.tasks.at("t/a@budget=8");
    EXPECT_NEAR(eight.raw, 0.8 * own.raw, 1e-12);
    EXPECT_DOUBLE_EQ(c.fitness, (own.normalized + eight.normalized) / 2);
  }
}

// A prompt that fails everywhere leaves every variant of its task: over budgets only, its failed reference unit
// names the base task, which is no planned task itself (the run stopped: "not part of generation 0"); with the
// task among its variants, one variant's failure takes the others' too, so that the budgets still pair.
TEST(Trainer, ADroppedPromptLeavesEveryVariantOfItsTask) {
  const std::vector<std::pair<std::string, std::string>> cases = {{"[8, 16]", "t/a"}, {"[own, 8]", "t/a@budget=8"}};
  int round = 0;
  for (const auto& [budgets, named] : cases) {
    SCOPED_TRACE(budgets);
    std::string yaml = SyntheticSpecYaml();
    yaml.insert(yaml.find("stages:"), "budgets: " + budgets + "\n");
    const RunSpec spec = parse_run_spec(yaml, "spec").value();
    const std::map<std::string, int64_t> rows = VariantRows(spec);
    auto store = Store::Open(FreshDatabasePath("variant_drop" + std::to_string(round++) + ".db"), OpenMode::kCreate).value();
    ASSERT_TRUE(store->ImportReferenceScores("synthetic-model", SyntheticReference(spec.architecture.param_count()),
                                             "test", false).ok());
    auto t = Trainer::Create(*store, spec, rows).value();
    ASSERT_TRUE(DriveRun(*t, 1).ok());  // the statistics phase
    const int64_t prompt = t->plan().samples.begin()->second.front();
    const Result<DropCounts> drops = t->Drop(named, prompt, "out of memory on every worker");
    ASSERT_TRUE(drops.ok()) << drops.status().ToString();
    EXPECT_EQ(drops->dropped, 2) << "both variants of t/a";
    const std::vector<WorkUnit> missing = t->Missing().value();
    for (const WorkUnit& u : missing) EXPECT_FALSE(u.prompt == prompt && u.task.rfind("t/a", 0) == 0) << u.task;
    EXPECT_EQ(store->GetDroppedPrompts(t->run_id())->size(), 2u);
    ASSERT_TRUE(DriveRun(*t).ok());
    EXPECT_TRUE(t->finished());
  }
}

// A prompt dropped because its base-model reference failed everywhere (the statistics phase, before any reference
// was stored) is not asked for again: neither when the phase ends nor by a resumed run.
TEST(Trainer, ADroppedPromptsReferenceIsNotAskedForAgain) {
  std::string yaml = SyntheticSpecYaml();
  yaml.insert(yaml.find("stages:"), "budgets: [8, 16]\n");
  const RunSpec spec = parse_run_spec(yaml, "spec").value();
  const std::map<std::string, int64_t> rows = VariantRows(spec);
  const std::string db = FreshDatabasePath("reference_dropped.db");
  auto store = Store::Open(db, OpenMode::kCreate).value();
  auto t = Trainer::Create(*store, spec, rows).value();
  ASSERT_FALSE(t->plan().missing_references.empty());
  const auto [task, prompt] = t->plan().missing_references.front();
  ASSERT_TRUE(t->Drop(task, prompt, "out of memory on every worker").ok());
  const auto asks = [&](const Trainer& trainer) {
    const auto& missing = trainer.plan().missing_references;
    return std::find(missing.begin(), missing.end(), std::make_pair(task, prompt)) != missing.end();
  };
  ASSERT_TRUE(t->Record(EvaluateUnits(*t, t->Missing().value())).ok());
  ASSERT_TRUE(t->Advance().ok());  // the statistics phase ends; generation 0 keeps its drops
  EXPECT_FALSE(asks(*t));
  EXPECT_FALSE(t->plan().missing_references.empty()) << "the other prompts' references are still wanted";
  auto resumed = Trainer::Resume(*store, t->run_id(), rows).value();
  EXPECT_FALSE(asks(*resumed));
}

// The statistics are gathered with the full cache (spec §7.6): over budgets with "own", from the zero mean at its own
// selection alone (which keeps everything), not from the budgets' evicted caches as well.
TEST(Trainer, NormalizationStatisticsComeFromTheTasksAtTheirOwnSelection) {
  std::string yaml = SyntheticSpecYaml();
  yaml.insert(yaml.find("stages:"), "budgets: [own, 8]\n");
  const RunSpec spec = parse_run_spec(yaml, "spec").value();
  const std::map<std::string, int64_t> rows = VariantRows(spec);
  auto store = Store::Open(FreshDatabasePath("own_stats.db"), OpenMode::kCreate).value();
  ASSERT_TRUE(store->ImportReferenceScores("synthetic-model", SyntheticReference(spec.architecture.param_count()),
                                           "test", false).ok());
  auto t = Trainer::Create(*store, spec, rows).value();
  ASSERT_TRUE(t->plan().collect_norm_stats);
  const std::vector<int64_t> prompts = t->plan().eval_prompts.at("t/a");
  // The budget's collection differs (evicted caches), so that mixing it in would show.
  const Evaluator evaluate = [](const Trainer& trainer, const std::vector<WorkUnit>& units) {
    std::vector<EvaluationRecord> out = EvaluateUnits(trainer, units);
    for (EvaluationRecord& e : out) {
      if (e.norm_stats && e.task.find('@') != std::string::npos) e.norm_stats = SyntheticNormStats("t/b", e.prompt);
    }
    return out;
  };
  ASSERT_TRUE(DriveRun(*t, 1, evaluate).ok());
  NormStats expected;
  for (int64_t prompt : prompts) expected = expected.Merge(SyntheticNormStats("t/a", prompt));
  const NormStats frozen = *store->GetRun(t->run_id())->norm_stats;
  EXPECT_EQ(frozen.count, expected.count);
  EXPECT_EQ(frozen.mean, expected.mean);
  EXPECT_EQ(frozen.var, expected.var);

  // A task planned at a budget only (t/b@budget=8 beside t/a) still counts: it has nothing else.
  std::string mixed = SyntheticSpecYaml();
  mixed.replace(mixed.find("tasks: [t/a]"), 12, "tasks: [t/a, t/b@budget=8]");
  const RunSpec mixed_spec = parse_run_spec(mixed, "spec").value();
  auto mixed_store = Store::Open(FreshDatabasePath("mixed_stats.db"), OpenMode::kCreate).value();
  ASSERT_TRUE(mixed_store->ImportReferenceScores("synthetic-model", SyntheticReference(spec.architecture.param_count()),
                                                 "test", false).ok());
  auto m = Trainer::Create(*mixed_store, mixed_spec, VariantRows(mixed_spec)).value();
  const std::vector<int64_t> a = m->plan().eval_prompts.at("t/a"), b = m->plan().eval_prompts.at("t/b@budget=8");
  ASSERT_TRUE(DriveRun(*m, 1, evaluate).ok());
  NormStats both;
  for (int64_t prompt : a) both = both.Merge(SyntheticNormStats("t/a", prompt));
  for (int64_t prompt : b) both = both.Merge(SyntheticNormStats("t/b", prompt));
  EXPECT_EQ(mixed_store->GetRun(m->run_id())->norm_stats->count, both.count);
  EXPECT_EQ(mixed_store->GetRun(m->run_id())->norm_stats->mean, both.mean);
}

// fitness: mean_rank: a candidate's fitness is the mean over tasks (budgets) of its rank among the candidates,
// in [0, 1], so a budget whose scores vary little weighs as much as one whose scores vary a lot.
TEST(Trainer, RankFitnessIsTheMeanOfEachCandidatesRanksOverTasks) {
  std::string yaml = SyntheticSpecYaml();
  yaml.insert(yaml.find("stages:"), "budgets: [own, 8]\nfitness: mean_rank\n");
  const RunSpec spec = parse_run_spec(yaml, "spec").value();
  EXPECT_TRUE(spec.rank_fitness);
  std::string bad = SyntheticSpecYaml();
  bad.insert(bad.find("stages:"), "fitness: best\n");
  EXPECT_NE(parse_run_spec(bad, "b.yaml").status().message().find("'best' is not mean or mean_rank"), std::string::npos);
  const std::map<std::string, int64_t> rows = VariantRows(spec);
  const std::string db = FreshDatabasePath("rank_fitness.db");
  auto store = Store::Open(db, OpenMode::kCreate).value();
  ASSERT_TRUE(store->ImportReferenceScores("synthetic-model", SyntheticReference(spec.architecture.param_count()),
                                           "test", false).ok());
  auto t = Trainer::Create(*store, spec, rows).value();
  // At budget 8 the order of the candidates is reversed (and compressed: a tenth of the spread).
  const Evaluator evaluate = [](const Trainer& trainer, const std::vector<WorkUnit>& units) {
    std::vector<EvaluationRecord> out = EvaluateUnits(trainer, units);
    for (EvaluationRecord& e : out) {
      if (e.task.find("@budget=8") != std::string::npos) e.score = 0.5 - 0.1 * (e.score - 0.5);
    }
    return out;
  };
  ASSERT_TRUE(DriveRun(*t, 2, evaluate).ok());
  const std::vector<CandidateRecord> candidates = store->GetCandidates(t->run_id(), 0).value();
  ASSERT_EQ(candidates.size(), 8u);
  for (const CandidateRecord& c : candidates) {
    double ranks = 0;
    for (const auto& [task, score] : c.tasks) {
      int below = 0;
      for (const CandidateRecord& other : candidates) below += other.tasks.at(task).normalized < score.normalized ? 1 : 0;
      ranks += below / 7.0;
    }
    EXPECT_DOUBLE_EQ(c.fitness, ranks / 2) << c.candidate;
  }
  // Reversed orders: every candidate's ranks sum to one, whatever the budget's spread.
  for (const CandidateRecord& c : candidates) EXPECT_NEAR(c.fitness, 0.5, 1e-12);
  // Ranks do not compare across generations, so export names no best candidate of the run (it exported the first
  // generation's rank-1 candidate as the run's best); a generation's best it does.
  const std::string out = namm::testing::TempPath("rank_best.safetensors");
  const auto best = namm::testing::RunProcess(std::string(NAMM_COORDINATOR_PATH) + " export --db " + db +
                                              " --latest --params best --force --out " + out);
  EXPECT_EQ(best.exit_code, 1) << best.output;
  EXPECT_NE(best.output.find("no candidate is best across generations"), std::string::npos) << best.output;
}

// A stage's weights: the candidates' fitness and the evaluation of the mean are the weighted means of the tasks'
// normalized scores (tasks not named weigh 1), and with mean_rank the weighted mean of the ranks; bad weights are
// refused naming the key; weights are part of the stage, so changing them is refused on resume.
TEST(Trainer, StageWeightsWeighEachTaskInTheFitnessAndInTheEvaluationOfTheMean) {
  std::string yaml = SyntheticSpecYaml();
  yaml.insert(yaml.find("stages:"), "budgets: [own, 8]\n");
  const std::string stage0 = "{tasks: [t/a], generations";
  yaml.replace(yaml.find(stage0), stage0.size(), "{tasks: [t/a], weights: {t/a@budget=8: 3}, generations");
  const RunSpec spec = parse_run_spec(yaml, "spec").value();
  EXPECT_EQ(spec.stages[0].weights, (tasks::TaskWeights{{"t/a@budget=8", 3.0}}));
  EXPECT_TRUE(spec.stages[1].weights.empty());
  for (const auto& [weights, says] : std::vector<std::pair<std::string, std::string>>{
           {"{t/b: 2}", "'t/b' is not one of the stage's tasks"},
           {"{t/a: 0}", "spec.stages[0].weights.t/a must be in 0.001..1000"},
           {"{t/a: -1}", "must be in 0.001..1000"},
           {"{t/a: 1e-300}", "must be in 0.001..1000"},
           {"{t/a: .inf}", "must be in 0.001..1000"},
           {"{t/a: heavy}", "'heavy' is not a number"},
           {"[3, 1]", "spec.stages[0].weights must map the stage's tasks to weights"}}) {
    std::string bad = yaml;
    bad.replace(bad.find("{t/a@budget=8: 3}"), 17, weights);
    const auto parsed = parse_run_spec(bad, "spec");
    ASSERT_FALSE(parsed.ok()) << weights;
    EXPECT_NE(parsed.status().message().find(says), std::string::npos) << parsed.status().message();
  }
  // A weight of 1 spelled out is no change; another weight changes the run's trajectory: refused, named.
  std::string spelled = yaml;
  spelled.replace(spelled.find("{t/a@budget=8: 3}"), 17, "{t/a@budget=8: 3, t/a: 1}");
  EXPECT_TRUE(check_spec_revision(spec, *parse_run_spec(spelled, "spelled"), false).ok());
  std::string reweighed = yaml;
  reweighed.replace(reweighed.find("{t/a@budget=8: 3}"), 17, "{t/a@budget=8: 2}");
  const Status refused = check_spec_revision(spec, *parse_run_spec(reweighed, "reweighed"), false);
  EXPECT_NE(refused.message().find("stages[0].weights"), std::string::npos) << refused.ToString();

  const std::map<std::string, int64_t> rows = VariantRows(spec);
  // At budget 8 a candidate's order is reversed and compressed, as in the rank test.
  const Evaluator evaluate = [](const Trainer& trainer, const std::vector<WorkUnit>& units) {
    std::vector<EvaluationRecord> out = EvaluateUnits(trainer, units);
    for (EvaluationRecord& e : out) {
      if (e.task.find("@budget=8") != std::string::npos) e.score = 0.5 - 0.1 * (e.score - 0.5);
    }
    return out;
  };
  for (const bool rank : {false, true}) {
    std::string text = yaml;
    if (rank) text.insert(text.find("stages:"), "fitness: mean_rank\n");
    const RunSpec weighted = parse_run_spec(text, "spec").value();
    auto store = Store::Open(FreshDatabasePath(rank ? "weights_rank.db" : "weights.db"), OpenMode::kCreate).value();
    ASSERT_TRUE(store->ImportReferenceScores("synthetic-model", SyntheticReference(spec.architecture.param_count()),
                                             "test", false).ok());
    auto t = Trainer::Create(*store, weighted, rows).value();
    // The statistics phase, stage 0's 3 generations, then one of stage 1.
    ASSERT_TRUE(DriveRun(*t, 5, evaluate).ok());
    // Stage 1 names no weights: its four tasks weigh the same.
    const std::vector<CandidateRecord> stage1 = store->GetCandidates(t->run_id(), 3).value();
    ASSERT_EQ(stage1.size(), 8u);
    for (const CandidateRecord& c : stage1) {
      ASSERT_EQ(c.tasks.size(), 4u);
      if (!rank) {
        double sum = 0;
        for (const auto& [task, score] : c.tasks) sum += score.normalized;
        EXPECT_NEAR(c.fitness, sum / 4, 1e-12) << c.candidate;
      }
    }
    const std::vector<CandidateRecord> candidates = store->GetCandidates(t->run_id(), 0).value();
    ASSERT_EQ(candidates.size(), 8u);
    for (const CandidateRecord& c : candidates) {
      const auto value = [&](const std::string& task) {
        if (!rank) return c.tasks.at(task).normalized;
        int below = 0;
        for (const CandidateRecord& o : candidates) below += o.tasks.at(task).normalized < c.tasks.at(task).normalized;
        return below / 7.0;
      };
      EXPECT_NEAR(c.fitness, (value("t/a") + 3 * value("t/a@budget=8")) / 4, 1e-12) << c.candidate;
    }
    const GenerationRecord g0 = store->GetGenerations(t->run_id()).value().at(0);
    ASSERT_TRUE(g0.eval_fitness);
    EXPECT_NEAR(*g0.eval_fitness,
                (g0.eval_tasks.at("t/a").normalized + 3 * g0.eval_tasks.at("t/a@budget=8").normalized) / 4, 1e-12);
    // With ranks, budget 8 (the order reversed) outweighs the task itself: its best candidate is the generation's.
    if (rank) {
      const auto best_at_8 = std::max_element(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
        return a.tasks.at("t/a@budget=8").normalized < b.tasks.at("t/a@budget=8").normalized;
      });
      EXPECT_EQ(g0.best_candidate, best_at_8->candidate);
    }
  }
}

// cache_weight: a candidate's fitness is its mean normalized score minus the weight times its mean relative cache
// (cache size over (n + 1) / 2 for n tokens fed); the evaluated mean is charged the same way; the task scores stay
// the normalized scores. Here the charge outweighs the scores' spread, so the smallest cache wins.
TEST(Trainer, CacheWeightChargesEachCandidateItsMeanRelativeCache) {
  std::string yaml = SyntheticSpecYaml();
  yaml.insert(yaml.find("stages:"), "cache_weight: 0.5\n");
  const RunSpec spec = parse_run_spec(yaml, "spec").value();
  EXPECT_EQ(spec.cache_weight, 0.5);
  EXPECT_EQ(parse_run_spec(SyntheticSpecYaml(), "spec")->cache_weight, 0);
  EXPECT_EQ(load_run_spec(std::string(NAMM_RUNS_DIR) + "/interruption-cache-weight-cpu.yaml")->cache_weight, 0.1);
  for (const std::string bad : {"cache_weight: -0.1\n", "cache_weight: .nan\n", "cache_weight: 11\n",
                                "cache_weight: lots\n", "cache_weight: 0.5\nfitness: mean_rank\n",
                                "cache_weight: 0.5\nbudgets: [own, 8]\n"}) {
    std::string text = SyntheticSpecYaml();
    text.insert(text.find("stages:"), bad);
    const auto parsed = parse_run_spec(text, "b.yaml");
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find("b.yaml.cache_weight"), std::string::npos) << parsed.status().message();
  }

  auto store = Store::Open(FreshDatabasePath("cache_weight.db"), OpenMode::kCreate).value();
  ASSERT_TRUE(store->ImportReferenceScores("synthetic-model", SyntheticReference(spec.architecture.param_count()),
                                           "test", false).ok());
  auto t = Trainer::Create(*store, spec, SyntheticTaskRows()).value();
  // Candidate k holds 0.1 (k + 1) of the full cache, the mean 0.05.
  const auto relative = [](int64_t candidate) { return candidate == kMeanCandidate ? 0.05 : 0.1 * (candidate + 1); };
  const Evaluator evaluate = [&](const Trainer& trainer, const std::vector<WorkUnit>& units) {
    std::vector<EvaluationRecord> out = EvaluateUnits(trainer, units);
    for (EvaluationRecord& e : out) {
      e.generated_tokens = 7;
      e.cache_size_mean = relative(e.candidate) * static_cast<double>(e.prompt_tokens + e.generated_tokens + 1) / 2;
    }
    return out;
  };
  ASSERT_TRUE(DriveRun(*t, 2, evaluate).ok());
  const std::vector<CandidateRecord> candidates = store->GetCandidates(t->run_id(), 0).value();
  ASSERT_EQ(candidates.size(), 8u);
  for (const CandidateRecord& c : candidates) {
    ASSERT_EQ(c.tasks.size(), 1u);
    EXPECT_NEAR(c.fitness, c.tasks.at("t/a").normalized - 0.5 * relative(c.candidate), 1e-12) << c.candidate;
  }
  const GenerationRecord g0 = store->GetGenerations(t->run_id()).value().at(0);
  EXPECT_EQ(g0.best_candidate, 0);
  ASSERT_TRUE(g0.eval_fitness);
  EXPECT_NEAR(*g0.eval_fitness, g0.eval_tasks.at("t/a").normalized - 0.5 * 0.05, 1e-12);
}

TEST(Trainer, ReportsMissingReferenceScoresAndCannotTellWithoutThem) {
  auto store = Store::Open(FreshDatabasePath("norefs.db"), OpenMode::kCreate).value();
  const RunSpec spec = *parse_run_spec(SyntheticSpecYaml(), "spec");
  auto t = Trainer::Create(*store, spec, SyntheticTaskRows()).value();
  EXPECT_EQ(t->plan().missing_references.size(), 6u);
  ASSERT_TRUE(DriveRun(*t, 1).ok());  // the statistics phase needs no reference
  ASSERT_TRUE(t->Record(EvaluateUnits(*t, *t->Missing())).ok());
  auto st = t->Advance();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("t/a"), std::string::npos) << st.status().message();
  EXPECT_EQ(store->GetRun(t->run_id())->generation, 0);
}

// With decompositions every few generations, delayed or not: every stop (after any advance, and mid-generation)
// resumes by rebuilding the complete state from a snapshot and the tell log, bit for bit; storage stays bounded.
TEST(Trainer, ResumingAnywhereRebuildsTheCompleteStateFromSnapshotsAndTheTellLog) {
  for (const std::string delay : {"0", "2"}) {
    const std::string yaml =
        SyntheticSpecYaml("rebuild", 12, 10, ", eigen_gap_factor: 0.02, eigen_delay: " + delay);
    SyntheticRun straight = StartSyntheticRun(FreshDatabasePath("rebuild_straight.db"), yaml);
    std::vector<CmaesState> starts;  // the complete state each phase starts from
    while (!straight.trainer->finished()) {
      starts.push_back(straight.trainer->settled_state());
      ASSERT_TRUE(DriveRun(*straight.trainer, 1).ok());
    }
    const auto snapshots = *straight.store->ListSnapshots(1);
    // A finished run keeps what rebuilding its final state needs (export --format reference reads its C), the
    // snapshot at its latest checkpoint among them.
    const RunRecord run = *straight.store->GetRun(1);
    ASSERT_FALSE(snapshots.empty());
    EXPECT_LE(snapshots.size(), 2u);
    EXPECT_TRUE(std::any_of(snapshots.begin(), snapshots.end(), [&](const SnapshotRecord& s) {
      return s.stage == run.stage && s.generation == run.generation;
    })) << "stage " << run.stage << " generation " << run.generation;
    // Stop after every phase, resume in a new trainer (a new process would do the same), and compare.
    const std::string db = FreshDatabasePath("rebuild_resumed.db");
    { StartSyntheticRun(db, yaml); }
    std::size_t requests = 0;
    for (std::size_t phase = 0; phase < starts.size(); ++phase) {
      auto store = Store::Open(db, OpenMode::kExisting).value();
      auto resumed = Trainer::Resume(*store, 1, SyntheticTaskRows());
      ASSERT_TRUE(resumed.ok()) << "phase " << phase << ": " << resumed.status().ToString();
      EXPECT_TRUE((*resumed)->state() == starts[phase]) << "delay " << delay << ", phase " << phase;
      const auto listed = *store->ListSnapshots(1);
      EXPECT_LE(listed.size(), 4u) << "old snapshots are deleted";
      requests = std::max(requests, listed.size());
      ASSERT_TRUE(DriveRun(**resumed, 1).ok());
    }
    EXPECT_GE(requests, 2u) << "decompositions were requested and snapshotted";
    const CmaesParams& p = straight.trainer->params();
    auto store = Store::Open(db, OpenMode::kExisting).value();
    EXPECT_TRUE(store->GetCheckpoint(1, "latest", 0, p)->state == straight.store->GetCheckpoint(1, "latest", 0, p)->state);
  }
}

// A server starts background work once a phase is handed out (the last tell's covariance update, a requested
// decomposition and its snapshot): the run is the same, bit for bit, as one that does everything on the way.
TEST(Trainer, BackgroundWorkLeavesTheRunUnchanged) {
  const std::string yaml = SyntheticSpecYaml("background", 12, 10, kFrequentDecompositions);
  SyntheticRun plain = StartSyntheticRun(FreshDatabasePath("background_plain.db"), yaml);
  SyntheticRun server = StartSyntheticRun(FreshDatabasePath("background_server.db"), yaml);
  int started = 0;
  const auto background = [&](Trainer& t) {
    if (t.BeginBackgroundWork()) ++started;
    return Status::Ok();
  };
  while (!plain.trainer->finished()) {
    ASSERT_TRUE(DriveRun(*plain.trainer, 1).ok());
    ASSERT_TRUE(DriveRun(*server.trainer, 1, EvaluateUnits, background).ok());
    // Not the covariance: settling it here would take the background's work away. It shows in every later
    // generation's mean, through the decompositions (and the hand-over's copy of the stage's best).
    const CmaesState &a = server.trainer->state(), &b = plain.trainer->state();
    EXPECT_TRUE(a.mean == b.mean && a.sigma == b.sigma && a.path_sigma == b.path_sigma && a.generation == b.generation &&
                a.eigen.generation == b.eigen.generation && a.pending_generation == b.pending_generation)
        << "generation " << plain.trainer->plan().generation;
  }
  EXPECT_TRUE(server.trainer->finished());
  EXPECT_GE(started, 3) << "decompositions ran in the background";
  const CmaesParams& p = plain.trainer->params();
  EXPECT_TRUE(server.store->GetCheckpoint(1, "latest", 0, p)->state == plain.store->GetCheckpoint(1, "latest", 0, p)->state);
}

// A run keeps the optimizer revision it was created with: stored as revision 1 (an older build's), it continues
// with revision 1's arithmetic bit for bit across stops, as revision 2 does with its own; a revision this build
// does not know is refused by name.
TEST(Trainer, ARunKeepsItsOptimizerRevision) {
  const std::string yaml = SyntheticSpecYaml("revision", 12, 10, kFrequentDecompositions);
  const auto latest_after = [&](int64_t revision, bool stop_every_phase) {
    const std::string db = FreshDatabasePath("revision.db");
    { StartSyntheticRun(db, yaml); }
    {
      SQLite::Database raw(db, SQLite::OPEN_READWRITE);
      raw.exec("UPDATE runs SET optimizer_revision = " + std::to_string(revision));
    }
    for (bool finished = false; !finished;) {
      auto store = Store::Open(db, OpenMode::kExisting).value();
      auto t = Trainer::Resume(*store, 1, SyntheticTaskRows());
      EXPECT_TRUE(t.ok()) << t.status().ToString();
      if (!t.ok()) return CmaesState();
      EXPECT_TRUE(DriveRun(**t, stop_every_phase ? 1 : 1 << 30).ok());
      finished = (*t)->finished();
      if (finished) return store->GetCheckpoint(1, "latest", 0, (*t)->params())->state;
    }
    return CmaesState();
  };
  const CmaesState old_straight = latest_after(1, false), old_stopped = latest_after(1, true);
  const CmaesState current = latest_after(kOptimizerRevision, false);
  const CmaesState current_stopped = latest_after(kOptimizerRevision, true);
  EXPECT_TRUE(old_stopped == old_straight);
  EXPECT_TRUE(current_stopped == current);
  // Rounding differs from the first decomposition on, and a candidate's rank can flip with it: the trajectories
  // part, so only their difference is checked.
  EXPECT_FALSE(current == old_straight) << "the revisions compute differently";

  const std::string db = FreshDatabasePath("revision_future.db");
  { StartSyntheticRun(db, yaml); }
  {
    SQLite::Database raw(db, SQLite::OPEN_READWRITE);
    raw.exec("UPDATE runs SET optimizer_revision = 99");
  }
  auto store = Store::Open(db, OpenMode::kExisting).value();
  auto refused = Trainer::Resume(*store, 1, SyntheticTaskRows());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("optimizer revision 99"), std::string::npos) << refused.status().ToString();
}

// Stopping anywhere (between any two calls) and resuming from the database gives the same run, bit for bit.
TEST(Trainer, AResumedRunEqualsAnUninterruptedOne) {
  SyntheticRun straight = StartSyntheticRun(FreshDatabasePath("straight.db"));
  ASSERT_TRUE(DriveRun(*straight.trainer).ok());
  const CmaesParams p = straight.trainer->params();
  const CheckpointRecord expected = *straight.store->GetCheckpoint(1, "latest", 0, p);

  const std::string db = FreshDatabasePath("resumed.db");
  std::size_t remaining = 0;
  {
    SyntheticRun first = StartSyntheticRun(db);
    ASSERT_TRUE(DriveRun(*first.trainer, 3).ok());  // statistics, generations 0 and 1
    // Half of generation 2's results arrive, then the process goes away.
    auto missing = *first.trainer->Missing();
    remaining = missing.size() - missing.size() / 2;
    missing.resize(missing.size() / 2);
    ASSERT_TRUE(first.trainer->Record(EvaluateUnits(*first.trainer, missing)).ok());
  }
  auto store = Store::Open(db, OpenMode::kExisting).value();
  auto resumed = Trainer::Resume(*store, 1, SyntheticTaskRows());
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ((*resumed)->plan().generation, 2);
  EXPECT_EQ((*resumed)->Missing()->size(), remaining);
  ASSERT_TRUE(DriveRun(**resumed).ok());
  const CheckpointRecord got = *store->GetCheckpoint(1, "latest", 0, p);
  EXPECT_TRUE(got.state == expected.state);
  const auto a = *straight.store->GetGenerations(1), b = *store->GetGenerations(1);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t g = 0; g < a.size(); ++g) {
    EXPECT_EQ(a[g].fitness_best, b[g].fitness_best);
    EXPECT_EQ(a[g].samples, b[g].samples);
    EXPECT_EQ(a[g].eval_fitness, b[g].eval_fitness);
  }
}

// A store that fails GetSnapshot() while `failing` is set, and otherwise is the real one.
class SnapshotReadsFail final : public TrainingStore {
 public:
  explicit SnapshotReadsFail(Store& real) : real_(real) {}
  bool failing = false;
  int failed = 0;

  Result<int64_t> CreateRun(const NewRun& run) override { return real_.CreateRun(run); }
  Result<RunRecord> GetRun(int64_t id) const override { return real_.GetRun(id); }
  Result<std::vector<StageRecord>> GetStages(int64_t id) const override { return real_.GetStages(id); }
  Status ReviseRunSpec(int64_t id, const std::string& yaml, const std::vector<StageRecord>& stages) override {
    return real_.ReviseRunSpec(id, yaml, stages);
  }
  Status FreezeNormStats(int64_t id, const NormStats& stats) override { return real_.FreezeNormStats(id, stats); }
  Result<int64_t> RecordEvaluations(int64_t id, const std::vector<EvaluationRecord>& records,
                                    Durability durability) override {
    return real_.RecordEvaluations(id, records, durability);
  }
  Result<std::vector<EvaluationRecord>> GetEvaluations(int64_t id, int64_t g) const override {
    return real_.GetEvaluations(id, g);
  }
  Status RecordDroppedPrompt(int64_t id, const DroppedPrompt& d) override { return real_.RecordDroppedPrompt(id, d); }
  Result<std::vector<DroppedPrompt>> GetDroppedPrompts(int64_t id) const override { return real_.GetDroppedPrompts(id); }
  Result<CommitOutcome> CommitGeneration(const GenerationCommit& c) override { return real_.CommitGeneration(c); }
  Result<std::vector<GenerationRecord>> GetGenerations(int64_t id) const override { return real_.GetGenerations(id); }
  Result<std::vector<CandidateRecord>> GetCandidates(int64_t id, int64_t g) const override {
    return real_.GetCandidates(id, g);
  }
  Result<CheckpointRecord> GetCheckpoint(int64_t id, const std::string& role, int64_t stage,
                                         const CmaesParams& p) const override {
    return real_.GetCheckpoint(id, role, stage, p);
  }
  Result<std::vector<SnapshotRecord>> ListSnapshots(int64_t id) const override { return real_.ListSnapshots(id); }
  Result<SnapshotRecord> GetSnapshot(int64_t id, int64_t snapshot, const CmaesParams& p) const override {
    if (failing) {
      ++const_cast<SnapshotReadsFail*>(this)->failed;
      return Status::IOError("reading snapshot " + std::to_string(snapshot) + " failed (injected)");
    }
    return real_.GetSnapshot(id, snapshot, p);
  }
  Result<int64_t> AddSnapshot(int64_t id, const NewSnapshot& n) override { return real_.AddSnapshot(id, n); }
  Result<int64_t> AddSnapshotConcurrently(int64_t id, const NewSnapshot& n) const override {
    return real_.AddSnapshotConcurrently(id, n);
  }
  Status DropIncompleteSnapshots(int64_t id) override { return real_.DropIncompleteSnapshots(id); }
  Status DropSnapshotsConcurrently(int64_t id, const std::vector<int64_t>& ids) const override {
    return real_.DropSnapshotsConcurrently(id, ids);
  }
  Result<tasks::ReferenceScores> GetReferenceScores(const std::string& f) const override {
    return real_.GetReferenceScores(f);
  }

 private:
  Store& real_;
};

// Whatever fails after tell() moved the state on (here: rebuilding the stage's best start state for the hand-over
// of a resumed run, not only the commit) leaves the trainer refusing to advance; a trainer resumed from the store
// then ends the run as an uninterrupted one.
TEST(Trainer, AnErrorAfterTellLeavesTheTrainerRefusingToAdvance) {
  // Stage 0: generations 0 to 3, its mean evaluated at 0 (not eligible: the stage's start) and 2.
  const std::string yaml = SyntheticSpecYaml("synthetic", 4, 2);
  SyntheticRun straight = StartSyntheticRun(FreshDatabasePath("straight_broken.db"), yaml);
  ASSERT_TRUE(DriveRun(*straight.trainer).ok());
  const CmaesParams p = straight.trainer->params();
  const CheckpointRecord expected = *straight.store->GetCheckpoint(1, "latest", 0, p);

  const std::string db = FreshDatabasePath("broken.db");
  { ASSERT_TRUE(DriveRun(*StartSyntheticRun(db, yaml).trainer, 4).ok()); }  // statistics, generations 0 to 2
  auto store = Store::Open(db, OpenMode::kExisting).value();
  SnapshotReadsFail flaky(*store);
  auto resumed = Trainer::Resume(flaky, 1, SyntheticTaskRows());
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  Trainer& t = **resumed;
  ASSERT_EQ(t.plan().generation, 3);
  ASSERT_TRUE(t.plan().schedule.stage_end) << "generation 3 ends stage 0: its hand-over rebuilds the stage's best";
  ASSERT_TRUE(t.Record(EvaluateUnits(t, *t.Missing())).ok());
  flaky.failing = true;
  const auto first = t.Advance();
  ASSERT_FALSE(first.ok());
  EXPECT_GT(flaky.failed, 0) << "the failure came from the rebuild, after tell()";
  EXPECT_NE(first.status().message().find("failed (injected)"), std::string::npos) << first.status().ToString();
  flaky.failing = false;
  const auto again = t.Advance();
  ASSERT_FALSE(again.ok()) << "a trainer whose state moved on must not advance again";
  EXPECT_NE(again.status().message().find("the trainer must be resumed from the store"), std::string::npos)
      << again.status().ToString();
  EXPECT_EQ(store->GetRun(1)->generation, 3) << "nothing was committed";
  auto fresh = Trainer::Resume(*store, 1, SyntheticTaskRows());
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  ASSERT_TRUE(DriveRun(**fresh).ok());
  EXPECT_TRUE(store->GetCheckpoint(1, "latest", 0, p)->state == expected.state);
}

// The ETA's weights: every remaining generation at its stage's tasks and mean prompt costs, evaluations of
// the mean (at stage starts here) included.
TEST(PromptCosts, RemainingCostWeighsEachGenerationByItsStage) {
  const RunSpec spec = *parse_run_spec("name: x\nmodel: {path: p, fingerprint: f}\ncmaes: {population: 4}\n"
                                       "prompts_per_task: 2\neval_interval: 1000\neval_prompts: 1\n"
                                       "stages: [{tasks: [a], generations: 3}, {tasks: [a, b], generations: 2}]\n",
                                       "spec");
  const PromptCosts costs = {{"a", {1, 3}}, {"b", {10}}};  // a: mean 2; b: one row of 10
  // Stage 0: 4 candidates x 2 prompts x 2 = 16 (+ 2 for the mean on 1 prompt); stage 1: a 16 + b 4 x 1 row x 10
  // = 56 (+ 2 + 10).
  EXPECT_DOUBLE_EQ(remaining_cost(spec, costs, 0), 18 + 16 + 16 + 68 + 56);
  EXPECT_DOUBLE_EQ(remaining_cost(spec, costs, 3), 68 + 56);
  EXPECT_DOUBLE_EQ(remaining_cost(spec, costs, 5), 0);
  EXPECT_DOUBLE_EQ(remaining_cost(spec, {{"a", {1, 3}}}, 4), 16 + 4 * 2);  // b unknown: 1 per prompt
}

TEST(SpecRevision, ComparesParsedSpecsAndListsEveryChangedKey) {
  const RunSpec stored = *parse_run_spec(SyntheticSpecYaml(), "stored");
  // Comments, layout and a default spelled out are no change.
  const RunSpec same = *parse_run_spec("# moved to the new cluster\n" + SyntheticSpecYaml() + "zero_base: one_plus_candidate\n", "same");
  EXPECT_TRUE(diff_run_specs(stored, same).empty());
  EXPECT_TRUE(check_spec_revision(stored, same, /*finished=*/true).ok());

  const RunSpec changed = *parse_run_spec(SyntheticSpecYaml("synthetic", 3, 2, ", elite_ratio: 0.25") +
                                              "  - {tasks: [t/b], generations: 2}\n",
                                          "changed");
  const std::vector<SpecDifference> d = diff_run_specs(stored, changed);
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0].key, "cmaes.elite_ratio");
  EXPECT_EQ(d[0].stored, "0.5");
  EXPECT_EQ(d[0].given, "0.25");
  EXPECT_EQ(d[1].key, "stages[2].tasks");
  EXPECT_EQ(d[1].stored, "(none)");
  EXPECT_EQ(d[1].given, "[\"t/b\"]");
  EXPECT_EQ(d[2].key, "stages[2].generations");
  const Status refused = check_spec_revision(stored, changed, false);
  EXPECT_EQ(refused.code(), Status::Code::kFailedPrecondition);
  EXPECT_NE(refused.message().find("cmaes.elite_ratio: 0.5 -> 0.25"), std::string::npos) << refused.ToString();
  EXPECT_EQ(refused.message().find("stages[2]"), std::string::npos) << "the extension itself is acceptable";

  // Where workers find the model may move; what it is may not.
  std::string moved = SyntheticSpecYaml();
  moved.replace(moved.find("/nowhere/model.bin"), 18, "/mnt/new/model.bin");
  EXPECT_TRUE(check_spec_revision(stored, *parse_run_spec(moved, "moved"), true).ok());
  std::string other = SyntheticSpecYaml();
  other.replace(other.find("synthetic-model"), 15, "another-model");
  EXPECT_FALSE(check_spec_revision(stored, *parse_run_spec(other, "other"), false).ok());

  // Stages: only extended, and only while the run is running.
  const RunSpec longer = *parse_run_spec(SyntheticSpecYaml("synthetic", 3, 5), "longer");
  EXPECT_TRUE(check_spec_revision(stored, longer, false).ok());
  const Status finished = check_spec_revision(stored, longer, true);
  EXPECT_NE(finished.message().find("stages[1].generations: 2 -> 5"), std::string::npos) << finished.ToString();
  EXPECT_NE(finished.message().find("finished"), std::string::npos);
  for (const auto& [a, b] : {std::pair{4, 2}, std::pair{3, 1}}) {
    const Status s = check_spec_revision(stored, *parse_run_spec(SyntheticSpecYaml("synthetic", a, b), "s"), false);
    EXPECT_NE(s.message().find("may only be extended"), std::string::npos) << s.ToString();
  }
}

// Extending a running run's last stage (with its model moved) continues it exactly as a run started with the
// longer schedule; a refused revision leaves the stored spec as it was.
TEST(Trainer, ARunResumedWithAnExtendedScheduleEqualsOneStartedWithIt) {
  SyntheticRun straight = StartSyntheticRun(FreshDatabasePath("long.db"), SyntheticSpecYaml("synthetic", 3, 4));
  ASSERT_TRUE(DriveRun(*straight.trainer).ok());
  const CmaesParams p = straight.trainer->params();
  const CheckpointRecord expected = *straight.store->GetCheckpoint(1, "latest", 0, p);

  const std::string db = FreshDatabasePath("extended.db");
  {
    SyntheticRun first = StartSyntheticRun(db);
    ASSERT_TRUE(DriveRun(*first.trainer, 4).ok());  // statistics, generations 0-2
  }
  auto store = Store::Open(db, OpenMode::kExisting).value();
  const std::string stored_yaml = store->GetRun(1)->spec_yaml;
  const Result<std::vector<SpecDifference>> refused =
      Trainer::ReviseSpec(*store, 1, *parse_run_spec(SyntheticSpecYaml("synthetic", 3, 4, ", c_m: 0.5"), "x"));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("cmaes.c_m: 1.0 -> 0.5"), std::string::npos);
  EXPECT_EQ(store->GetRun(1)->spec_yaml, stored_yaml);

  std::string revised = "# two more generations\n" + SyntheticSpecYaml("synthetic", 3, 4);
  revised.replace(revised.find("/nowhere/model.bin"), 18, "/mnt/new/model.bin");
  const Result<std::vector<SpecDifference>> accepted = Trainer::ReviseSpec(*store, 1, *parse_run_spec(revised, "r"));
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  ASSERT_EQ(accepted->size(), 2u);
  EXPECT_EQ((*accepted)[0].key, "model.path");
  EXPECT_EQ((*accepted)[1].key, "stages[1].generations");
  EXPECT_EQ(store->GetRun(1)->spec_yaml, revised);
  EXPECT_EQ(store->GetStages(1)->at(1).generations, 4);

  auto resumed = Trainer::Resume(*store, 1, SyntheticTaskRows());
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ((*resumed)->spec().model.path, "/mnt/new/model.bin");
  ASSERT_TRUE(DriveRun(**resumed).ok());
  EXPECT_EQ(store->GetRun(1)->generation, 7);
  EXPECT_TRUE(store->GetCheckpoint(1, "latest", 0, p)->state == expected.state);

  // Finished: nothing is stored any more, and the schedule cannot grow.
  EXPECT_TRUE(Trainer::ReviseSpec(*store, 1, *parse_run_spec(revised + "# note\n", "r")).ok());
  EXPECT_EQ(store->GetRun(1)->spec_yaml, revised);
  EXPECT_FALSE(Trainer::ReviseSpec(*store, 1, *parse_run_spec(SyntheticSpecYaml("synthetic", 3, 6), "r")).ok());
}

// A prompt that fails everywhere leaves each generation that samples it, for every candidate and the mean; the
// rest of the run goes on, the drops are stored, and a resumed run drops exactly the same.
TEST(Trainer, ADroppedPromptLeavesItsGenerationForEveryCandidateAndTheRunGoesOn) {
  SyntheticRun straight = StartSyntheticRun(FreshDatabasePath("dropping.db"));
  Trainer& t = *straight.trainer;
  // A prompt of t/a that generation 0 samples for its candidates.
  ASSERT_TRUE(DriveRun(t, 1).ok());  // the statistics phase
  const int64_t prompt = t.plan().samples.at("t/a").front();
  const int64_t eval_prompt = t.plan().eval_prompts.at("t/a").front();  // planned by every evaluation
  EXPECT_FALSE(t.Drop("t/b", 0, "x").ok()) << "t/b is not part of stage 0";
  const auto drops = t.Drop("t/a", prompt, "out of memory on every worker");
  ASSERT_TRUE(drops.ok()) << drops.status().ToString();
  EXPECT_EQ(drops->dropped, 1);
  EXPECT_EQ(t.Drop("t/a", prompt, "again")->dropped, 1) << "idempotent";
  const std::vector<WorkUnit> missing = t.Missing().value();
  for (const WorkUnit& u : missing) EXPECT_FALSE(u.task == "t/a" && u.prompt == prompt);
  // A result that raced the drop is not stored.
  std::vector<WorkUnit> units = t.plan().units;
  ASSERT_TRUE(t.Record(EvaluateUnits(t, units)).ok());
  ASSERT_TRUE(t.Advance().ok());
  const std::vector<EvaluationRecord> recorded = straight.store->GetEvaluations(1, 0).value();
  for (const EvaluationRecord& e : recorded) EXPECT_NE(e.prompt, prompt);
  const GenerationRecord g0 = *straight.store->GetGeneration(1, 0);
  EXPECT_EQ(std::count(g0.samples.at("t/a").begin(), g0.samples.at("t/a").end(), prompt), 0);
  EXPECT_EQ(g0.samples.at("t/a").size(), t.spec().prompts_per_task - 1);
  EXPECT_EQ((*straight.store->GetMetrics(1, 0)).at("prompts_dropped"), 1);
  const auto stored = *straight.store->GetDroppedPrompts(1);
  ASSERT_EQ(stored.size(), 1u);
  EXPECT_EQ(stored[0].error, "out of memory on every worker");
  // Only the current generation's prompts can be dropped.
  EXPECT_FALSE(straight.store->RecordDroppedPrompt(1, DroppedPrompt{0, "t/a", prompt, "late", ""}).ok());

  // The same run with a prompt dropped wherever it is planned, straight and resumed in the middle.
  SyntheticRun all = StartSyntheticRun(FreshDatabasePath("dropping_all.db"));
  ASSERT_TRUE(DriveRun(*all.trainer, 1 << 30, EvaluateUnits, DropEverywhere("t/a", eval_prompt)).ok());
  const DropCounts counts = all.trainer->drop_counts();
  EXPECT_GT(counts.dropped, 1);
  const std::string db = FreshDatabasePath("dropping_resumed.db");
  {
    SyntheticRun first = StartSyntheticRun(db);
    ASSERT_TRUE(DriveRun(*first.trainer, 3, EvaluateUnits, DropEverywhere("t/a", eval_prompt)).ok());
  }
  auto store = Store::Open(db, OpenMode::kExisting).value();
  auto resumed = Trainer::Resume(*store, 1, SyntheticTaskRows()).value();
  ASSERT_TRUE(DriveRun(*resumed, 1 << 30, EvaluateUnits, DropEverywhere("t/a", eval_prompt)).ok());
  EXPECT_EQ(resumed->drop_counts().dropped, counts.dropped);
  EXPECT_EQ(resumed->drop_counts().planned, counts.planned);
  const CmaesParams& p = all.trainer->params();
  EXPECT_TRUE(store->GetCheckpoint(1, "latest", 0, p)->state == all.store->GetCheckpoint(1, "latest", 0, p)->state);
  // Planned prompts: each generation's distinct (task, prompt) pairs, samples and evaluation prompts.
  EXPECT_GT(counts.planned, 5 * t.spec().prompts_per_task);
}

// Evaluations of the mean that lost prompts (dropped: they failed on every worker) are compared over the prompts
// both kept. Stage 0 evaluates at generations 2 and 4; the mean scores 0 on its hardest prompt X, and on the others
// 0.75 (generation 2) or 0.70 (generation 4) of the base model. Dropping X at generation 4 alone raised its
// evaluation over the rest above generation 2's over all (0.70 against ~0.6), and it became the stage's best; over
// the prompts both kept, generation 2 is better. X dropped at every generation still leaves the stage a best.
TEST(Trainer, EvaluationsOfTheMeanThatLostPromptsAreComparedOverThePromptsBothKept) {
  const std::string yaml = SyntheticSpecYaml("synthetic", 5, 2);
  const RunSpec spec = parse_run_spec(yaml, "spec").value();
  const std::vector<double> zero(static_cast<std::size_t>(spec.architecture.param_count()), 0.0);
  const auto stage0_best = [&](const std::string& name, double factor4, bool drop_everywhere) {
    SyntheticRun r = StartSyntheticRun(FreshDatabasePath(name), yaml);
    Trainer& t = *r.trainer;
    const std::vector<int64_t> eval = t.plan().eval_prompts.at("t/a");
    const int64_t x = *std::max_element(eval.begin(), eval.end(), [&](int64_t a, int64_t b) {
      return SyntheticScore(zero, "t/a", a) < SyntheticScore(zero, "t/a", b);
    });
    const Evaluator evaluate = [&](const Trainer& trainer, const std::vector<WorkUnit>& units) {
      std::vector<EvaluationRecord> out = EvaluateUnits(trainer, units);
      const int64_t g = trainer.plan().generation;
      if (trainer.plan().collect_norm_stats) return out;
      for (EvaluationRecord& e : out) {
        if (e.candidate != kMeanCandidate) continue;
        const double factor = g == 2 ? 0.75 : g == 4 ? factor4 : 0.5;
        e.score = e.prompt == x ? 0.0 : factor * SyntheticScore(zero, e.task, e.prompt);
      }
      return out;
    };
    const auto drop = [&](Trainer& trainer) -> Status {
      const bool due = drop_everywhere || trainer.plan().generation == 4;
      if (!due || trainer.plan().collect_norm_stats) return Status::Ok();
      for (const WorkUnit& u : trainer.plan().units) {
        if (u.task == "t/a" && u.prompt == x) return trainer.Drop("t/a", x, "out of memory everywhere").status();
      }
      return Status::Ok();
    };
    EXPECT_TRUE(DriveRun(t, 1 << 30, evaluate, drop).ok());
    return r.store->GetStages(t.run_id())->at(0).best_eval_generation;
  };
  EXPECT_EQ(stage0_best("lost_once.db", 0.70, false), 2);
  EXPECT_EQ(stage0_best("lost_once_better.db", 0.80, false), 4) << "better over the prompts both kept";
  EXPECT_EQ(stage0_best("lost_always.db", 0.80, true), 4);
  EXPECT_EQ(stage0_best("lost_always_worse.db", 0.70, true), 2);
}

}  // namespace
}  // namespace namm::coordinator
