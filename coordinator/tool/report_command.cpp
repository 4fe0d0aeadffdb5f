// report: a run's training curves (the paper's Figure 3 view) as a self-contained report.html and CSVs.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>

#include "commands.h"
#include "namm/file_util.h"
#include "namm/html_report.h"

namespace namm::coordinator::cli {

namespace {

struct ReportOptions {
  std::string db, out;
  std::string explain;  // a `namm-worker generate --explain` / `eval --explain-rows` page to show in the report
  int64_t run = 0;
};

// One generation's row of the report.
struct Row {
  const GenerationRecord* g = nullptr;
  std::map<std::string, double> metrics;
  GenerationActivity activity;
  double wall_seconds = 0;  // since the previous generation completed (the first: since the run was created)
  double evaluations_per_second = 0;
};

// Seconds since the epoch of an ISO-8601 UTC time as the store writes it, or -1.
double EpochSeconds(const std::string& iso) {
  std::tm tm{};
  std::istringstream in(iso);
  in >> std::get_time(&tm, "%Y-%m-%dT%H:%M:%SZ");
  return in.fail() ? -1.0 : static_cast<double>(timegm(&tm));
}

double Metric(const Row& row, const std::string& name) {
  const auto it = row.metrics.find(name);
  return it == row.metrics.end() ? std::nan("") : it->second;
}

std::string Csv(double v, int digits = 6) { return format_number(v, digits); }

std::string GenerationsCsv(const std::vector<Row>& rows) {
  std::ostringstream out;
  out << "generation,stage,fitness_best,fitness_mean,fitness_std,fitness_worst,eval_fitness,sigma,eigen_min,"
         "eigen_max,"
         "cache_size_mean,eval_cache_size_mean,evaluations,workers,wall_seconds,evaluations_per_second,"
         "completed_at\n";
  for (const Row& r : rows) {
    const GenerationRecord& g = *r.g;
    out << g.generation << ',' << g.stage << ',' << Csv(g.fitness_best) << ',' << Csv(g.fitness_mean) << ','
        << Csv(g.fitness_std) << ',' << Csv(g.fitness_worst) << ','
        << (g.eval_fitness ? Csv(*g.eval_fitness) : "") << ',' << Csv(g.sigma, 8) << ','
        << Csv(g.eigen_min, 10) << ',' << Csv(g.eigen_max, 10) << ',' << Csv(Metric(r, "cache_size_mean"), 2)
        << ',' << Csv(Metric(r, "eval_cache_size_mean"), 2) << ',' << r.activity.evaluations << ','
        << r.activity.workers << ',' << Csv(r.wall_seconds, 0) << ',' << Csv(r.evaluations_per_second, 2)
        << ',' << g.completed_at << '\n';
  }
  return out.str();
}

std::string EvalTasksCsv(const std::vector<Row>& rows) {
  std::ostringstream out;
  out << "generation,task,raw,normalized\n";
  for (const Row& r : rows) {
    for (const auto& [task, score] : r.g->eval_tasks) {
      out << r.g->generation << ',' << csv_field(task) << ',' << Csv(score.raw) << ','
          << Csv(score.normalized) << '\n';
    }
  }
  return out.str();
}

std::string StagesCsv(const std::vector<StageRecord>& stages) {
  std::ostringstream out;
  out << "stage,tasks,planned_generations,start_generation,end_generation,best_eval_fitness,best_eval_"
         "generation\n";
  for (const StageRecord& s : stages) {
    std::string tasks;
    for (const auto& t : s.tasks) tasks += (tasks.empty() ? "" : " ") + t;
    const auto opt = [](const std::optional<int64_t>& v) { return v ? std::to_string(*v) : std::string(); };
    out << s.stage << ',' << csv_field(tasks) << ',' << s.generations << ',' << opt(s.start_generation) << ','
        << opt(s.end_generation) << ',' << (s.best_eval_fitness ? Csv(*s.best_eval_fitness) : "") << ','
        << opt(s.best_eval_generation) << '\n';
  }
  return out.str();
}

// A chart of per-generation values; `value` returns NaN where a generation has none.
template <typename F>
ChartSeries Series(const std::string& name, const std::vector<Row>& rows, F value, bool dashed = false) {
  ChartSeries s{name, {}, dashed};
  for (const Row& r : rows) {
    const double v = value(r);
    if (std::isfinite(v)) s.points.emplace_back(static_cast<double>(r.g->generation), v);
  }
  return s;
}

// The stages' weights as the spec gave them, as HTML ("" when every task weighs the same).
std::string WeightsText(const RunSpec& spec) {
  std::string text;
  for (std::size_t k = 0; k < spec.stages.size(); ++k) {
    if (spec.stages[k].weights.empty()) continue;
    text += (text.empty() ? " Weights (tasks not named weigh 1): stage " : "; stage ") + std::to_string(k + 1);
    for (const auto& [task, w] : spec.stages[k].weights) text += " " + html_escape(task) + " " + format_number(w, 4);
  }
  return text.empty() ? text : text + ".";
}

// What the fitness curves show, as the run's spec computed it (run_spec.h), as HTML.
std::string FitnessRule(const RunSpec& spec) {
  const std::string normalized = "the score normalized by the base model's on the same prompts";
  const std::string weights = WeightsText(spec);
  const std::string mean = weights.empty() ? "mean" : "weighted mean";
  const std::string averaged = weights.empty() ? "averaged over tasks" : "a weighted mean over tasks";
  if (spec.rank_fitness) {
    return "A candidate's fitness is the " + mean + " over tasks of its rank among the generation's candidates by " +
           normalized + " (0 worst, 1 best); the evaluated mean's is " + normalized + ", " + averaged + "." + weights;
  }
  if (spec.cache_weight > 0) {
    return "Fitness is " + normalized + ", " + averaged + ", minus " + format_number(spec.cache_weight, 4) +
           " times the mean relative KV cache (cache_weight)." + weights;
  }
  return "Fitness is " + normalized + ", " + averaged + "." + weights;
}

std::string ReportHtml(const OpenedRun& opened, const std::vector<StageRecord>& stages,
                       const std::vector<Row>& rows, bool explained) {
  std::vector<std::pair<double, std::string>> boundaries;
  for (const StageRecord& s : stages) {
    if (s.start_generation && *s.start_generation > 0) {
      boundaries.emplace_back(static_cast<double>(*s.start_generation) - 0.5,
                              "stage " + std::to_string(s.stage + 1));
    }
  }
  const auto chart = [&](const std::string& title, const std::string& y_label,
                         std::vector<ChartSeries> series) {
    ChartOptions o;
    o.title = title;
    o.x_label = "generation";
    o.y_label = y_label;
    o.x_markers = boundaries;
    o.width = 660;
    return render_line_chart(series, o);
  };
  std::ostringstream body;
  const RunRecord& run = opened.run;
  body << "<h1>Training run " << run.id << ": " << html_escape(run.name) << "</h1>\n<p class=\"meta\">"
       << html_escape(run.status) << ", " << rows.size() << " generations, " << run.dimension
       << " parameters, model "
       << "<code>" << html_escape(run.model_fingerprint) << "</code>, created " << html_escape(run.created_at)
       << ". " << FitnessRule(opened.spec)
       << (opened.spec.init.empty() ? "" : " Started from the NAMM <code>" + html_escape(opened.spec.init) + "</code>.")
       << "</p>\n";

  std::vector<std::vector<std::string>> stage_rows;
  for (const StageRecord& s : stages) {
    std::string tasks;
    for (const auto& t : s.tasks) tasks += (tasks.empty() ? "" : ", ") + t;
    stage_rows.push_back({std::to_string(s.stage + 1), tasks, std::to_string(s.generations),
                          s.start_generation ? std::to_string(*s.start_generation) : "",
                          s.end_generation ? std::to_string(*s.end_generation) : "",
                          s.best_eval_fitness ? format_number(*s.best_eval_fitness, 4) : "",
                          s.best_eval_generation ? std::to_string(*s.best_eval_generation) : ""});
  }
  body << "<h2>Stages</h2>\n"
       << html_table({"stage", "tasks", "planned generations", "first generation", "end generation",
                      "best evaluation of the mean", "at generation"},
                     stage_rows);

  body << "<h2>Curves</h2>\n<div class=\"charts\">\n";
  body << chart("Fitness", "fitness",
                {Series("best candidate", rows, [](const Row& r) { return r.g->fitness_best; }),
                 Series("population mean", rows, [](const Row& r) { return r.g->fitness_mean; }),
                 Series("sampling mean (evaluated)", rows,
                        [](const Row& r) { return r.g->eval_fitness ? *r.g->eval_fitness : std::nan(""); })});
  std::vector<std::string> tasks;
  for (const Row& r : rows) {
    for (const auto& [task, score] : r.g->eval_tasks) {
      if (std::find(tasks.begin(), tasks.end(), task) == tasks.end()) tasks.push_back(task);
    }
  }
  std::vector<ChartSeries> per_task;
  for (const auto& task : tasks) {
    per_task.push_back(Series(task, rows, [&](const Row& r) {
      const auto it = r.g->eval_tasks.find(task);
      return it == r.g->eval_tasks.end() ? std::nan("") : it->second.normalized;
    }));
  }
  body << chart("Sampling mean per task (normalized)", "normalized score", per_task);
  body << chart("Step size", "sigma", {Series("sigma", rows, [](const Row& r) { return r.g->sigma; })});
  body << chart("KV-cache size", "tokens per layer",
                {Series("population mean", rows, [](const Row& r) { return Metric(r, "cache_size_mean"); }),
                 Series("sampling mean (evaluated)", rows,
                        [](const Row& r) { return Metric(r, "eval_cache_size_mean"); })});
  body << chart(
      "Throughput", "evaluations / s",
      {Series("evaluations per second", rows, [](const Row& r) { return r.evaluations_per_second; })});
  body << chart(
      "Workers", "workers reporting",
      {Series("workers", rows, [](const Row& r) { return static_cast<double>(r.activity.workers); })});
  body << "</div>\n<p class=\"meta\">Evaluations per second: the generation's recorded evaluations over the "
          "time "
          "since the previous generation completed (timestamps have one-second resolution). CSVs beside this "
          "page: "
          "generations.csv, eval_tasks.csv, stages.csv."
       << (rows.size() > 2000 ? " A curve of more than 2,000 points (each generation's, here) is drawn through the "
                                "first, lowest, highest and last value of each of 500 spans; the CSVs hold every "
                                "generation."
                              : "")
       << "</p>\n";
  if (explained) {
    body << "<h2>What the best NAMM keeps</h2>\n<p class=\"meta\">One prompt: every token shaded by how long it "
            "stayed in the cache, and the cache size after every memory update (<a href=\"explain.html\">"
            "explain.html</a>, made by namm-worker; the training script makes it for the stage's best NAMM on "
            "a training row).</p>\n<iframe src=\"explain.html\" title=\"what the best NAMM keeps\" "
            "style=\"width: 100%; height: 640px; border: 1px solid #ccc;\"></iframe>\n";
  }
  return html_page("namm run " + std::to_string(run.id) + ": " + run.name, body.str());
}

Status Report(const ReportOptions& o) {
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Open(o.db, OpenMode::kReadOnly));
  NAMM_ASSIGN_OR_RETURN(OpenedRun opened, OpenRun(*store, o.run));
  const int64_t run_id = opened.run.id;
  NAMM_ASSIGN_OR_RETURN(std::vector<StageRecord> stages, store->GetStages(run_id));
  NAMM_ASSIGN_OR_RETURN(std::vector<GenerationRecord> generations, store->GetGenerations(run_id));
  NAMM_ASSIGN_OR_RETURN(std::vector<GenerationActivity> activity, store->GetGenerationActivity(run_id));
  if (generations.empty()) {
    return Status::FailedPrecondition("run " + std::to_string(run_id) + " has no completed generation yet");
  }
  std::map<int64_t, GenerationActivity> activity_of;
  for (const auto& a : activity) activity_of[a.generation] = a;
  std::vector<Row> rows;
  double previous = EpochSeconds(opened.run.created_at);
  for (const GenerationRecord& g : generations) {
    Row row;
    row.g = &g;
    NAMM_ASSIGN_OR_RETURN(row.metrics, store->GetMetrics(run_id, g.generation));
    row.activity = activity_of[g.generation];
    const double completed = EpochSeconds(g.completed_at);
    row.wall_seconds = completed >= 0 && previous >= 0 ? completed - previous : std::nan("");
    row.evaluations_per_second =
        std::isfinite(row.wall_seconds)
            ? static_cast<double>(row.activity.evaluations) / std::max(1.0, row.wall_seconds)
            : std::nan("");
    if (completed >= 0) previous = completed;
    rows.push_back(std::move(row));
  }

  std::error_code ec;
  std::filesystem::create_directories(o.out, ec);
  if (ec) return Status::IOError(o.out + ": cannot create the directory: " + ec.message());
  NAMM_RETURN_IF_ERROR(write_file_atomically(o.out + "/generations.csv", {GenerationsCsv(rows)}));
  NAMM_RETURN_IF_ERROR(write_file_atomically(o.out + "/eval_tasks.csv", {EvalTasksCsv(rows)}));
  NAMM_RETURN_IF_ERROR(write_file_atomically(o.out + "/stages.csv", {StagesCsv(stages)}));
  if (!o.explain.empty()) {
    NAMM_ASSIGN_OR_RETURN(const std::string page, read_file(o.explain));
    if (page.find("<div id=\"tokens\">") == std::string::npos) {
      return Status::InvalidArgument("--explain " + o.explain + " is not a page of namm-worker generate --explain or "
                                     "eval --explain-rows");
    }
    NAMM_RETURN_IF_ERROR(write_file_atomically(o.out + "/explain.html", {page}));
  }
  NAMM_RETURN_IF_ERROR(
      write_file_atomically(o.out + "/report.html", {ReportHtml(opened, stages, rows, !o.explain.empty())}));
  std::cout << "wrote " << o.out << "/report.html (run " << run_id << ", " << rows.size()
            << " generations) and " << o.out << "/{generations,eval_tasks,stages}.csv\n";
  return Status::Ok();
}

}  // namespace

void AddReportCommand(CLI::App& app, Action& run) {
  auto o = std::make_shared<ReportOptions>();
  CLI::App* cmd = app.add_subcommand("report",
                                     "Training curves of a run: a self-contained report.html (fitness, "
                                     "sigma, per-task scores, cache size, throughput) and CSVs");
  cmd->add_option("--db", o->db, "The run's database")->required()->check(CLI::ExistingFile);
  cmd->add_option("--run", o->run, "Run id (default: the newest run)")->check(RunIdNumber());
  cmd->add_option("--out", o->out, "Output directory")->required();
  cmd->add_option("--explain", o->explain,
                  "A page of what a NAMM keeps (namm-worker generate --explain, eval --explain-rows) to show in the "
                  "report, e.g. the best NAMM's on a training row")
      ->check(CLI::ExistingFile);
  cmd->callback([o, &run] {
    run = [o] {
      Status s = Report(*o);
      return s.ok() ? 0 : Fail(s.message());
    };
  });
}

}  // namespace namm::coordinator::cli
