#include "namm/tasks/task.h"

#include <gtest/gtest.h>

#include <set>

#include "../namm_core/test_util.h"
#include "../worker/shared_data.h"
#include "namm/file_util.h"
#include "namm/tasks/normalized_score.h"
#include "namm/tasks/task_variant.h"

namespace namm::tasks {
namespace {

TEST(TaskRegistry, DefinesAllBenchmarks) {
  auto tasks = list_tasks(default_task_paths());
  ASSERT_TRUE(tasks.ok()) << tasks.status().ToString();
  std::map<std::string, int> per_benchmark;
  for (const auto& t : *tasks) ++per_benchmark[t.benchmark];
  EXPECT_EQ(per_benchmark["longbench"], 21);
  EXPECT_EQ(per_benchmark["choubun"], 4);
  EXPECT_EQ(per_benchmark["infinitebench"], 12);
  EXPECT_GE(per_benchmark["synthetic"], 1);
}

TEST(TaskRegistry, LongBenchTemplatesComeFromTheConfigDirectory) {
  NAMM_REQUIRE_SHARED("data/longbench/config/dataset2prompt.json");
  auto task = find_task("lb/passage_retrieval_zh", default_task_paths());
  ASSERT_TRUE(task.ok()) << task.status().ToString();
  EXPECT_EQ(task->max_new_tokens, 32);
  EXPECT_EQ(task->metric, "retrieval_zh");
  EXPECT_NE(task->prompt_template.find("{context}"), std::string::npos);
  auto samsum = find_task("lb/samsum", default_task_paths());
  ASSERT_TRUE(samsum.ok());
  EXPECT_TRUE(samsum->first_line);
  EXPECT_EQ(samsum->stop_strings, std::vector<std::string>{"\n"});
  EXPECT_EQ(samsum->max_new_tokens, 128);
}

TEST(TaskRegistry, AllFiveSharedSubsetsLoadAndFormat) {
  NAMM_REQUIRE_SHARED("data/longbench/dureader.jsonl");
  for (const char* name : {"lb/dureader", "lb/multifieldqa_zh", "lb/passage_retrieval_zh", "lb/vcsum", "lb/lsht"}) {
    auto task = find_task(name, default_task_paths());
    ASSERT_TRUE(task.ok()) << task.status().ToString();
    auto rows = load_rows(*task);
    ASSERT_TRUE(rows.ok()) << rows.status().ToString();
    EXPECT_EQ(rows->size(), 50u) << name;
    for (const auto& row : *rows) {
      auto prompt = build_prompt(*task, row);
      ASSERT_TRUE(prompt.ok()) << prompt.status().ToString();
      // The row's question text appears verbatim in the prompt.
      EXPECT_NE(prompt->find(row.fields["input"].get<std::string>()), std::string::npos) << name << " " << row.index;
    }
    // The base answer scores itself perfectly (a sanity check of metric wiring per task).
    const auto& first = (*rows)[0];
    auto self = score_generation(*task, first, first.fields["answers"][0].get<std::string>());
    ASSERT_TRUE(self.ok()) << self.status().ToString();
    EXPECT_NEAR(*self, 1.0, 1e-7) << name;
  }
}

// InfiniteBench's code_debug and longbook_choice_eng rows hold the answer's text; its scorer reads
// [text, letter], which get_answer() builds from the options (scoring the raw field gave code_debug 0 everywhere).
TEST(TaskRegistry, InfiniteBenchChoicesAreScoredAgainstTheirOptionsLetter) {
  for (const char* name : {"ib/code_debug", "ib/longbook_choice_eng"}) {
    SCOPED_TRACE(name);
    TaskSpec task;
    task.name = name;
    task.metric = std::string(name) == "ib/code_debug" ? "ib_code_debug" : "ib_choice";
    task.answers_field = "answer";
    TaskRow row;
    row.fields = {{"answer", {"option two"}}, {"options", {"option one", "option two", "option three", "option four"}}};
    EXPECT_EQ(*score_generation(task, row, "B. because"), 1.0);
    EXPECT_EQ(*score_generation(task, row, "C. because"), 0.0);
    row.fields["answer"] = "option two";  // a plain string, as older releases store it
    EXPECT_EQ(*score_generation(task, row, "B. because"), 1.0);
    row.fields["answer"] = {"option two", "B"};  // already with its letter
    EXPECT_EQ(*score_generation(task, row, "B. because"), 1.0);
    row.fields["answer"] = {"nowhere"};
    const Result<double> unknown = score_generation(task, row, "B");
    ASSERT_FALSE(unknown.ok());
    EXPECT_NE(unknown.status().message().find("not among the first four of its 'options'"), std::string::npos)
        << unknown.status().ToString();
  }
}

// Under --chat, LongBench's pred.py (and the reference) leave its few-shot and code tasks plain.
TEST(TaskRegistry, LongBenchsFewShotAndCodeTasksStayOutOfTheChatTemplate) {
  const auto tasks = list_tasks(default_task_paths());
  ASSERT_TRUE(tasks.ok()) << tasks.status().ToString();
  const std::set<std::string> plain = {"lb/trec", "lb/triviaqa", "lb/samsum", "lb/lsht", "lb/lcc", "lb/repobench-p"};
  int64_t longbench = 0;
  for (const TaskSpec& task : *tasks) {
    if (task.benchmark != "longbench") continue;
    ++longbench;
    EXPECT_EQ(task.chat, plain.count(task.name) == 0) << task.name;
  }
  EXPECT_EQ(longbench, 21);
}

TEST(TaskRegistry, MissingFilesAreClearErrors) {
  TaskPaths paths = default_task_paths();
  paths.data_dirs["longbench"] = "/nonexistent/longbench";
  auto task = find_task("lb/narrativeqa", paths);
  ASSERT_FALSE(task.ok());
  EXPECT_NE(task.status().message().find("task lb/narrativeqa"), std::string::npos) << task.status().message();
  EXPECT_NE(task.status().message().find("/nonexistent/longbench/config/dataset2prompt.json"), std::string::npos);

  NAMM_REQUIRE_SHARED("data/longbench/config/dataset2prompt.json");
  auto narrativeqa = find_task("lb/narrativeqa", default_task_paths());  // config present, data absent
  ASSERT_TRUE(narrativeqa.ok());
  auto rows = load_rows(*narrativeqa);
  ASSERT_FALSE(rows.ok());
  EXPECT_NE(rows.status().message().find("narrativeqa.jsonl is missing"), std::string::npos);
  auto choubun = find_task("choubun/wiki_qa", default_task_paths());
  ASSERT_FALSE(choubun.ok());
  EXPECT_NE(choubun.status().message().find("no data directory for benchmark 'choubun'"), std::string::npos);
  EXPECT_FALSE(find_task("lb/does_not_exist", default_task_paths()).ok());
}

// Rows nest at most 64 levels: build_prompt's py_str and the metrics recurse over a row's fields, and a row
// of 100000 nested lists overflowed the stack there. The error names the line and the limit.
TEST(TaskRegistry, DeeplyNestedRowsAreRefusedWhenLoaded) {
  TaskSpec task;
  task.name = "t";
  task.data_path = testing::TempPath("deep_rows.jsonl");
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string text = std::string(R"({"input": [[["fine"]]]})") + "\n{\"input\": " + deep + "}\n";
  ASSERT_TRUE(write_file_atomically(task.data_path, {text}).ok());
  auto rows = load_rows(task);
  ASSERT_FALSE(rows.ok());
  EXPECT_EQ(rows.status().code(), Status::Code::kCorruption);
  EXPECT_NE(rows.status().message().find(
                "deep_rows.jsonl line 2: JSON nests arrays and objects more than 64 levels"),
            std::string::npos)
      << rows.status().message();
}

TEST(TaskRegistry, FirstLineRuleAndRowRanges) {
  TaskSpec trec;
  trec.first_line = true;
  EXPECT_EQ(scored_text(trec, "\n\nLocation\nQuestion: next"), "Location");
  TaskSpec plain;
  EXPECT_EQ(scored_text(plain, "\nA\nB"), "\nA\nB");
  EXPECT_EQ(*parse_row_range("0:3", 10), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(*parse_row_range("8:", 10), (std::vector<int64_t>{8, 9}));
  EXPECT_EQ(*parse_row_range("4", 10), (std::vector<int64_t>{4}));
  EXPECT_EQ(*parse_row_range(":2", 10), (std::vector<int64_t>{0, 1}));
  EXPECT_FALSE(parse_row_range("5:20", 10).ok());
  EXPECT_FALSE(parse_row_range("x", 10).ok());
  // Anything but whole numbers is refused, not read up to its first other character (each ran fewer rows).
  for (const char* bad : {"0-3", "1,4", "1:3:5", "2.9", "1:4abc", "-1", "+2", " 3", "", "99999999999999999999"}) {
    const Result<std::vector<int64_t>> rows = parse_row_range(bad, 10);
    ASSERT_FALSE(rows.ok()) << "'" << bad << "'";
    EXPECT_NE(rows.status().message().find("expected N, A:B, A: or :B"), std::string::npos) << rows.status().ToString();
  }
}

TEST(ReferenceScores, ImportsTheReferenceFilesAndRoundTrips) {
  NAMM_REQUIRE_SHARED("data/reference_scores/llama3-8b-32k-x2NTK2alpha-v2.json");
  auto per_request = ReferenceScores::Load(testing::SharedPath("data/reference_scores/llama3-8b-32k-x2NTK2alpha-v2.per_request.json"));
  ASSERT_TRUE(per_request.ok()) << per_request.status().ToString();
  auto aggregate = ReferenceScores::Load(testing::SharedPath("data/reference_scores/llama3-8b-32k-x2NTK2alpha-v2.json"));
  ASSERT_TRUE(aggregate.ok()) << aggregate.status().ToString();
  EXPECT_EQ(per_request->scores().size(), 21u);
  EXPECT_EQ(per_request->scores().at("lb/passage_retrieval_en").size(), 200u);
  EXPECT_EQ(per_request->scores(), aggregate->scores());
  // The aggregate file's 12.175 for passage_retrieval_en is 100 x the mean of its per-prompt scores.
  double sum = 0;
  for (const auto& [row, s] : per_request->scores().at("lb/passage_retrieval_en")) sum += s;
  EXPECT_NEAR(100 * sum / 200, 12.175, 1e-9);
  const std::string path = testing::TempPath("refs.json");
  ASSERT_TRUE(per_request->Save(path).ok());
  auto back = ReferenceScores::Load(path);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->scores(), per_request->scores());

  // Another spelling of a row would be the same row, its score chosen by the keys' order: refused, named.
  for (const std::string key : {" 5", "+5", "05", "-0", "5.0", "x"}) {
    const std::string odd = testing::TempPath("odd_refs.json");
    ASSERT_TRUE(write_file_atomically(odd, {"{\"lb/x\": {\"5\": 0.9, \"" + key + "\": 0.1}}"}).ok());
    const Status refused = ReferenceScores::Load(odd).status();
    EXPECT_EQ(refused.code(), Status::Code::kCorruption) << key;
    EXPECT_NE(refused.message().find("has a row '" + key + "'"), std::string::npos) << refused.ToString();
  }
}

TEST(NormalizedFitness, RatioOfMeansAveragedOverTasks) {
  ReferenceScores reference;
  ASSERT_TRUE(reference.Set("t1", 0, 0.5).ok());
  ASSERT_TRUE(reference.Set("t1", 1, 0.1).ok());
  ASSERT_TRUE(reference.Set("t2", 7, 0.0).ok());
  ASSERT_FALSE(reference.Set("t2", 8, 1.5).ok());  // outside [0, 1]
  // t1: candidate mean 0.45 / base mean 0.3 = 1.5 (a mean of ratios would give (0.8 + 1.0) / 2 = 0.9).
  PromptScores candidate = {{"t1", {{0, 0.4}, {1, 0.5}}}, {"t2", {{7, 0.2}}}};
  auto fitness = normalized_fitness(candidate, reference);
  ASSERT_TRUE(fitness.ok());
  EXPECT_DOUBLE_EQ(fitness->tasks[0].normalized, 0.45 / 0.3);
  EXPECT_DOUBLE_EQ(fitness->tasks[1].normalized, 1.2);  // base mean 0: 1 + candidate mean
  EXPECT_DOUBLE_EQ(fitness->value, (0.45 / 0.3 + 1.2) / 2);
  auto reference_rule = normalized_fitness(candidate, reference, ZeroBase::kReferenceEpsilon);
  EXPECT_DOUBLE_EQ(reference_rule->tasks[1].normalized, 20.0 / 1e-7);  // the blow-up namm avoids
  PromptScores unknown_row = {{"t1", {{5, 0.1}}}};
  auto missing = normalized_fitness(unknown_row, reference);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("t1 row 5"), std::string::npos);
}

// Evolution over budgets: "T@budget=N" / "T@ratio=R" name a task run with the NAMM's cache held to a budget.
TEST(TaskVariant, ParsesABudgetOrARatioAndRefusesAnythingElseNamingTheTask) {
  const TaskVariant plain = parse_task_variant("syn/interruption").value();
  EXPECT_EQ(plain.base, "syn/interruption");
  EXPECT_FALSE(plain.budget.has_value());
  const TaskVariant tokens = parse_task_variant("syn/interruption@budget=16").value();
  EXPECT_EQ(tokens.base, "syn/interruption");
  ASSERT_TRUE(tokens.budget.has_value());
  EXPECT_EQ(tokens.budget->ToString(), "budget=16");
  EXPECT_EQ(tokens.budget->Resolve(1000), 16);
  const TaskVariant share = parse_task_variant("lb/dureader@ratio=0.25").value();
  EXPECT_EQ(share.base, "lb/dureader");
  EXPECT_EQ(share.budget->Resolve(400), 100);
  EXPECT_FALSE(share.keep_prompt);
  const TaskVariant keep = parse_task_variant("syn/interruption@prompt=keep").value();
  EXPECT_EQ(keep.base, "syn/interruption");
  EXPECT_TRUE(keep.keep_prompt);
  EXPECT_FALSE(keep.budget.has_value());
  const TaskVariant both = parse_task_variant("syn/interruption@budget=8,prompt=keep").value();
  EXPECT_TRUE(both.keep_prompt);
  EXPECT_EQ(both.budget->Resolve(1000), 8);
  EXPECT_FALSE(both.own_head_counts);
  const TaskVariant own = parse_task_variant("syn/interruption@heads=own").value();
  EXPECT_TRUE(own.own_head_counts);
  EXPECT_FALSE(own.keep_prompt || own.budget.has_value());
  const TaskVariant all = parse_task_variant("syn/interruption@prompt=keep,budget=8,heads=own").value();
  EXPECT_TRUE(all.own_head_counts && all.keep_prompt);
  EXPECT_EQ(variant_flags(all), ",prompt=keep,heads=own");
  for (const auto& [bad, says] : std::vector<std::pair<std::string, std::string>>{
           {"syn/interruption@prompt=evict", "prompt= takes keep"},
           {"syn/interruption@heads=equal", "heads= takes own"},
           {"syn/interruption@budget=0", "budget > 0"},
           {"syn/interruption@ratio=1.5", "(0, 1]"},
           {"syn/interruption@threshold=0.5", "threshold"},
           {"syn/interruption@budget=8,ratio=0.5", "exactly one"},
           {"syn/interruption@", "syn/interruption@"},
           {"@budget=8", "no name before '@'"},
           {"syn/interruption@budget=eight", "eight"}}) {
    const Result<TaskVariant> parsed = parse_task_variant(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find(says), std::string::npos) << parsed.status().ToString();
    EXPECT_NE(parsed.status().message().find("'" + bad + "'"), std::string::npos) << parsed.status().ToString();
  }
}

// A variant's reference score is its base task's (the full cache does not depend on the NAMM's budget), so the
// fitness over variants normalizes each budget's mean against the same base mean; none is stored under a variant.
TEST(TaskVariant, NormalizesAgainstTheBaseTasksReferenceScores) {
  ReferenceScores reference;
  ASSERT_TRUE(reference.Set("t", 0, 0.5).ok());
  ASSERT_TRUE(reference.Set("t", 1, 0.3).ok());
  EXPECT_EQ(reference.Get("t@budget=8", 1), 0.3);
  EXPECT_FALSE(reference.Set("t@budget=8", 0, 0.4).ok());
  PromptScores candidate = {{"t@budget=8", {{0, 0.2}, {1, 0.2}}}, {"t@budget=64", {{0, 0.6}, {1, 0.4}}}};
  const Fitness fitness = normalized_fitness(candidate, reference).value();
  ASSERT_EQ(fitness.tasks.size(), 2u);
  EXPECT_EQ(fitness.tasks[0].task, "t@budget=64");
  EXPECT_DOUBLE_EQ(fitness.tasks[0].normalized, 0.5 / 0.4);
  EXPECT_DOUBLE_EQ(fitness.tasks[1].normalized, 0.2 / 0.4);
  EXPECT_DOUBLE_EQ(fitness.value, (0.5 / 0.4 + 0.2 / 0.4) / 2);
}

}  // namespace
}  // namespace namm::tasks
