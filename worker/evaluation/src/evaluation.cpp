#include "namm/worker/evaluation.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <set>
#include <sstream>

#include "namm/file_util.h"
#include "namm/html_report.h"
#include "namm/option_spec.h"
#include "namm/tasks/task.h"
#include "namm/worker/policy_spec.h"

namespace namm::worker {

namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr int kConfigVersion = 1;

// ---- configuration
// ----------------------------------------------------------------------------------------------

template <typename T>
T Get(const YAML::Node& root, const char* key, const T& fallback) {
  return root[key] ? root[key].as<T>() : fallback;
}

// The settings that define what is evaluated, as (key, printed value) pairs in a fixed order.
std::vector<std::pair<std::string, std::string>> Identity(const EvalConfig& c) {
  const auto list = [](const std::vector<std::string>& items) {
    std::string out = "[";
    for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
    return out + "]";
  };
  std::string rows, fingerprints;
  for (const auto& [task, range] : c.task_rows) rows += task + "=" + range + " ";
  for (const auto& [input, fingerprint] : c.fingerprints) fingerprints += input + "=" + fingerprint + " ";
  return {{"model", c.model},
          {"tokenizer", c.tokenizer},
          {"fingerprints", fingerprints},
          {"rope_scaling", c.rope_scaling},
          {"device type", c.device.substr(0, c.device.find(':'))},
          {"dtype", c.dtype},
          {"chat", c.chat ? "true" : "false"},
          {"tasks", list(c.tasks)},
          {"rows", rows},
          {"policies", list(c.policies)},
          {"chunk_size", std::to_string(c.chunk_size)},
          {"update_interval", std::to_string(c.update_interval)},
          {"max_context", std::to_string(c.max_context)},
          {"tasks_dir", c.tasks_dir},
          {"data_dirs", list(c.data_dirs)},
          {"config_dirs", list(c.config_dirs)}};
}

// "budget=256" / "ratio=0.5" / "" (a NAMM's threshold= is no cache setting: its curve is the budgets').
std::string CacheSetting(const std::string& spec) {
  if (spec.rfind("namm:", 0) == 0) {
    const Result<NammSpec> namm = parse_namm_spec(spec);
    return namm.ok() && (namm->knob.budget || namm->knob.ratio) ? namm->setting : "";
  }
  const Result<OptionSpec> parsed = parse_option_spec(spec);
  if (!parsed.ok()) return "";
  for (const char* key : {"budget", "ratio"}) {
    if (const auto it = parsed->options.find(key); it != parsed->options.end())
      return std::string(key) + "=" + it->second;
  }
  return "";
}

// The spec without its cache setting ("fastgen:budget=16,recovery=0.5" -> "fastgen:recovery=0.5"): one curve.
std::string Family(const std::string& spec) {
  if (spec.rfind("namm:", 0) == 0) {
    Result<NammSpec> namm = parse_namm_spec(spec);
    if (!namm.ok() || CacheSetting(spec).empty()) return spec;
    namm->setting.clear();
    return namm->ToString();
  }
  Result<OptionSpec> parsed = parse_option_spec(spec);
  if (!parsed.ok()) return spec;
  parsed->options.erase("budget");
  parsed->options.erase("ratio");
  return parsed->ToString();
}

// ---- predictions
// ------------------------------------------------------------------------------------------------

Status SyncFd(int fd, const std::string& path) {
  if (::fsync(fd) != 0) return Status::IOError(path + ": fsync failed: " + std::strerror(errno));
  return Status::Ok();
}

}  // namespace

std::string EvalConfig::ToYaml() const {
  YAML::Emitter out;
  out << YAML::Comment("namm-worker eval configuration: `namm-worker eval` with these settings re-runs it")
      << YAML::Newline;
  out << YAML::BeginMap;
  out << YAML::Key << "version" << YAML::Value << kConfigVersion;
  out << YAML::Key << "commit" << YAML::Value << commit;
  out << YAML::Key << "model" << YAML::Value << model;
  out << YAML::Key << "tokenizer" << YAML::Value << tokenizer;
  out << YAML::Key << "rope_scaling" << YAML::Value << rope_scaling;
  out << YAML::Key << "device" << YAML::Value << device;
  out << YAML::Key << "dtype" << YAML::Value << dtype;
  out << YAML::Key << "chat" << YAML::Value << chat;
  out << YAML::Key << "fingerprints" << YAML::Value << YAML::BeginMap;
  for (const auto& [input, fingerprint] : fingerprints)
    out << YAML::Key << input << YAML::Value << fingerprint;
  out << YAML::EndMap;
  out << YAML::Key << "tasks" << YAML::Value << YAML::Flow << tasks;
  out << YAML::Key << "task_rows" << YAML::Value << YAML::BeginMap;
  for (const auto& [task, range] : task_rows)
    out << YAML::Key << task << YAML::Value << YAML::DoubleQuoted << range;
  out << YAML::EndMap;
  out << YAML::Key << "policies" << YAML::Value << YAML::BeginSeq;
  for (const auto& p : policies) out << YAML::DoubleQuoted << p;
  out << YAML::EndSeq;
  out << YAML::Key << "budgets" << YAML::Value << YAML::Flow << budgets;
  out << YAML::Key << "ratios" << YAML::Value << YAML::Flow << ratios;
  out << YAML::Key << "chunk_size" << YAML::Value << chunk_size;
  out << YAML::Key << "update_interval" << YAML::Value << update_interval;
  out << YAML::Key << "max_context" << YAML::Value << max_context;
  out << YAML::Key << "threads" << YAML::Value << threads;
  out << YAML::Key << "tasks_dir" << YAML::Value << tasks_dir;
  out << YAML::Key << "data_dirs" << YAML::Value << YAML::Flow << data_dirs;
  out << YAML::Key << "config_dirs" << YAML::Value << YAML::Flow << config_dirs;
  out << YAML::Key << "shard" << YAML::Value << YAML::DoubleQuoted
      << (std::to_string(shard_index) + "/" + std::to_string(shard_count));
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

Result<EvalConfig> EvalConfig::FromYaml(const std::string& text, const std::string& source) {
  EvalConfig c;
  try {
    const YAML::Node root = YAML::Load(text);
    if (!root.IsMap()) return Status::Corruption(source + ": not an evaluation configuration (a YAML map)");
    const int version = Get<int>(root, "version", 0);
    if (version != kConfigVersion) {
      return Status::Corruption(source + ": configuration version " + std::to_string(version) +
                                ", this build reads " + std::to_string(kConfigVersion));
    }
    c.commit = Get<std::string>(root, "commit", "");
    c.model = Get<std::string>(root, "model", "");
    c.tokenizer = Get<std::string>(root, "tokenizer", "");
    c.rope_scaling = Get<std::string>(root, "rope_scaling", "");
    c.device = Get<std::string>(root, "device", "cpu");
    c.dtype = Get<std::string>(root, "dtype", "");
    c.chat = Get<bool>(root, "chat", false);
    c.fingerprints = Get<std::map<std::string, std::string>>(root, "fingerprints", {});
    c.tasks = Get<std::vector<std::string>>(root, "tasks", {});
    c.task_rows = Get<std::map<std::string, std::string>>(root, "task_rows", {});
    c.policies = Get<std::vector<std::string>>(root, "policies", {});
    c.budgets = Get<std::vector<std::string>>(root, "budgets", {});
    c.ratios = Get<std::vector<std::string>>(root, "ratios", {});
    c.chunk_size = Get<int64_t>(root, "chunk_size", 0);
    c.update_interval = Get<int64_t>(root, "update_interval", 0);
    c.max_context = Get<int64_t>(root, "max_context", 0);
    c.threads = Get<int>(root, "threads", 0);
    c.tasks_dir = Get<std::string>(root, "tasks_dir", "");
    c.data_dirs = Get<std::vector<std::string>>(root, "data_dirs", {});
    c.config_dirs = Get<std::vector<std::string>>(root, "config_dirs", {});
    const std::string shard = Get<std::string>(root, "shard", "0/1");
    const auto slash = shard.find('/');
    if (slash == std::string::npos)
      return Status::Corruption(source + ": shard must be I/N, got '" + shard + "'");
    c.shard_index = std::stoll(shard.substr(0, slash));
    c.shard_count = std::stoll(shard.substr(slash + 1));
  } catch (const std::exception& e) {
    return Status::Corruption(source + ": malformed evaluation configuration: " + e.what());
  }
  if (c.model.empty() || c.tasks.empty() || c.policies.empty() || c.shard_count < 1 || c.shard_index < 0 ||
      c.shard_index >= c.shard_count) {
    return Status::Corruption(source +
                              ": an evaluation configuration needs a model, tasks, policies and a shard I/N "
                              "with 0 <= I < N");
  }
  for (const auto& task : c.tasks) {
    if (!c.task_rows.count(task)) return Status::Corruption(source + ": no row range for task " + task);
  }
  return c;
}

std::string EvalConfig::DifferenceFrom(const EvalConfig& other) const {
  const auto mine = Identity(*this), theirs = Identity(other);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].second != theirs[i].second) {
      return mine[i].first + ": " + mine[i].second + " vs " + theirs[i].second;
    }
  }
  return "";
}

Result<std::vector<int64_t>> EvalConfig::ShardRows(const std::string& task) const {
  const auto it = task_rows.find(task);
  if (it == task_rows.end()) return Status::InvalidArgument("the evaluation has no task " + task);
  const auto colon = it->second.find(':');
  int64_t begin = 0, end = 0;
  try {
    begin = std::stoll(it->second.substr(0, colon));
    end = std::stoll(it->second.substr(colon + 1));
  } catch (const std::exception&) {
    return Status::Corruption("row range '" + it->second + "' of task " + task + " is not A:B");
  }
  std::vector<int64_t> rows;
  for (int64_t k = 0; begin + k < end; ++k) {
    if (k % shard_count == shard_index) rows.push_back(begin + k);
  }
  return rows;
}

Result<std::vector<std::string>> split_policy_list(const std::vector<std::string>& values) {
  std::vector<std::string> specs;
  for (const auto& value : values) {
    std::stringstream pieces(value);
    std::string piece;
    while (std::getline(pieces, piece, ',')) {
      const bool continues = piece.find(':') == std::string::npos && piece.find('=') != std::string::npos;
      // A NAMM takes its knob (budget=, ratio=, threshold=), prompt= and heads= after a comma, and nothing else.
      const bool knob = piece.rfind("budget=", 0) == 0 || piece.rfind("ratio=", 0) == 0 ||
                        piece.rfind("threshold=", 0) == 0 || piece.rfind("prompt=", 0) == 0 ||
                        piece.rfind("heads=", 0) == 0;
      if (continues && !specs.empty() && (specs.back().rfind("namm:", 0) != 0 || knob)) {
        specs.back() += "," + piece;
        continue;
      }
      if (piece.empty() || continues) {
        return Status::InvalidArgument("--policies '" + value + "': '" + piece + "' is not a policy");
      }
      specs.push_back(piece);
    }
  }
  if (specs.empty()) return Status::InvalidArgument("--policies names no policy");
  return specs;
}

Result<std::vector<std::string>> expand_policies(const std::vector<std::string>& specs,
                                                 const std::vector<std::string>& budgets,
                                                 const std::vector<std::string>& ratios) {
  std::vector<std::string> settings;
  for (const auto& b : budgets) settings.push_back("budget=" + b);
  for (const auto& r : ratios) settings.push_back("ratio=" + r);
  std::vector<std::string> out = {"full"};
  for (const auto& spec : specs) {
    NAMM_ASSIGN_OR_RETURN(std::string family, policy_family(spec));
    std::vector<std::string> expanded = {spec};
    if (family == "namm" && CacheSetting(spec).empty() && spec.find(",threshold=") == std::string::npos) {
      // A NAMM at its own threshold, then at each budget: its curve beside the baselines'.
      for (const auto& setting : settings) {
        NAMM_ASSIGN_OR_RETURN(std::string with, with_cache_setting(spec, setting));
        expanded.push_back(with);
      }
    } else if (is_budgeted_family(family) && CacheSetting(spec).empty()) {
      if (settings.empty()) {
        return Status::InvalidArgument("policy '" + spec +
                                       "' needs budget=N or ratio=R, or --budgets / --ratios to "
                                       "expand it over");
      }
      expanded.clear();
      for (const auto& setting : settings) {
        NAMM_ASSIGN_OR_RETURN(std::string with, with_cache_setting(spec, setting));
        expanded.push_back(with);
      }
    }
    for (const auto& e : expanded) {
      if (e == "full" && spec == "full") continue;  // already first
      if (std::find(out.begin(), out.end(), e) != out.end()) {
        return Status::InvalidArgument("policy '" + e + "' is listed twice");
      }
      out.push_back(e);
    }
  }
  // Each policy's directory must be its own.
  std::set<std::string> directories;
  for (const auto& p : out) {
    if (!directories.insert(output_directory_name(p)).second) {
      return Status::InvalidArgument("policies '" + p +
                                     "' and another one would share the output directory " +
                                     output_directory_name(p) + "; rename one of the files");
    }
  }
  return out;
}

std::string output_directory_name(const std::string& name) {
  std::string out;
  for (char c : name) {
    const bool keep =
        std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '=' || c == '-' || c == '_';
    out += keep ? c : '_';
  }
  if (out.empty() || out == "." || out == "..") out = "_" + out;
  return out;
}

std::string predictions_path(const std::string& dir, const std::string& task, const std::string& policy) {
  return dir + "/" + output_directory_name(task) + "/" + output_directory_name(policy) + "/predictions.jsonl";
}

std::string explain_path(const std::string& dir, const std::string& task, const std::string& policy, int64_t row) {
  return dir + "/" + output_directory_name(task) + "/" + output_directory_name(policy) + "/explain-row-" +
         std::to_string(row) + ".html";
}

std::optional<int64_t> explain_page_row(const std::string& name) {
  const std::string prefix = "explain-row-", suffix = ".html";
  if (name.size() <= prefix.size() + suffix.size() || name.size() > prefix.size() + suffix.size() + 18 ||
      name.rfind(prefix, 0) != 0 || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoll(digits);
}

OrderedJson PredictionRecord::ToJson() const {
  OrderedJson j;
  j["row"] = row;
  j["pred"] = pred;
  j["answers"] = answers;
  j["all_classes"] = all_classes;
  j["length"] = length;
  j["score"] = score;
  j["mean_kv_tokens"] = mean_kv_tokens;
  j["answer_kv_tokens"] = answer_kv_tokens;
  j["peak_kv_tokens"] = peak_kv_tokens;
  j["prompt_tokens"] = prompt_tokens;
  j["generated_tokens"] = generated_tokens;
  j["prefill_tokens"] = prefill_tokens;
  j["decode_tokens"] = decode_tokens;
  j["seconds"] = seconds;
  return j;
}

Result<PredictionRecord> PredictionRecord::FromJson(const Json& j, const std::string& where) {
  PredictionRecord r;
  try {
    r.row = j.at("row").get<int64_t>();
    r.pred = j.at("pred").get<std::string>();
    r.answers = j.at("answers");
    r.all_classes = j.value("all_classes", Json());
    r.length = j.value("length", Json());
    // JSON has no NaN: a non-finite number was written as null.
    const auto number = [&](const char* key) {
      const Json& v = j.at(key);
      return v.is_null() ? std::nan("") : v.get<double>();
    };
    r.score = number("score");
    r.mean_kv_tokens = number("mean_kv_tokens");
    r.answer_kv_tokens = j.contains("answer_kv_tokens") ? number("answer_kv_tokens") : 0.0;
    r.peak_kv_tokens = number("peak_kv_tokens");
    r.prompt_tokens = j.at("prompt_tokens").get<int64_t>();
    r.generated_tokens = j.at("generated_tokens").get<int64_t>();
    r.prefill_tokens = j.value("prefill_tokens", int64_t{0});
    r.decode_tokens = j.value("decode_tokens", int64_t{0});
    r.seconds = j.value("seconds", 0.0);
  } catch (const std::exception& e) {
    return Status::Corruption(where + ": not a prediction record: " + e.what());
  }
  return r;
}

Result<std::vector<PredictionRecord>> load_predictions(const std::string& path, bool repair) {
  std::vector<PredictionRecord> records;
  if (!path_exists(path)) return records;
  NAMM_ASSIGN_OR_RETURN(std::string text, read_file(path));
  std::size_t start = 0;
  int64_t line = 0;
  while (start < text.size()) {
    const std::size_t newline = text.find('\n', start);
    ++line;
    const std::string where = path + " line " + std::to_string(line);
    if (newline == std::string::npos) {
      // A last line without its newline: a complete record whose newline is missing keeps its place; anything
      // else is what a process stopped while writing, and is cut off.
      Json tail;
      bool complete = false;
      try {
        tail = Json::parse(text.begin() + static_cast<std::ptrdiff_t>(start), text.end());
        complete = PredictionRecord::FromJson(tail, where).ok();
      } catch (const std::exception&) {
      }
      if (!repair) return Status::Corruption(where + ": incomplete last line");
      if (complete) {
        NAMM_ASSIGN_OR_RETURN(PredictionRecord record, PredictionRecord::FromJson(tail, where));
        records.push_back(std::move(record));
        const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
        const bool ok = fd >= 0 && ::write(fd, "\n", 1) == 1 && ::fsync(fd) == 0;
        if (fd >= 0) ::close(fd);
        if (!ok) return Status::IOError(path + ": cannot end the last line: " + std::strerror(errno));
      } else if (::truncate(path.c_str(), static_cast<off_t>(start)) != 0) {
        return Status::IOError(path + ": cannot cut the incomplete last line: " + std::strerror(errno));
      }
      break;
    }
    Json j;
    try {
      j = Json::parse(text.begin() + static_cast<std::ptrdiff_t>(start),
                      text.begin() + static_cast<std::ptrdiff_t>(newline));
    } catch (const std::exception& e) {
      return Status::Corruption(where + ": invalid JSON: " + e.what());
    }
    NAMM_ASSIGN_OR_RETURN(PredictionRecord record, PredictionRecord::FromJson(j, where));
    records.push_back(std::move(record));
    start = newline + 1;
  }
  return records;
}

Result<PredictionWriter> PredictionWriter::Open(const std::string& path) {
  NAMM_RETURN_IF_ERROR(make_directories(parent_directory(path)));
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path + ": cannot open for appending: " + std::strerror(errno));
  return PredictionWriter(path, fd);
}

PredictionWriter::PredictionWriter(PredictionWriter&& other) noexcept
    : path_(std::move(other.path_)), fd_(other.fd_) {
  other.fd_ = -1;
}

PredictionWriter::~PredictionWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Status PredictionWriter::Append(const PredictionRecord& record) {
  const std::string line = record.ToJson().dump() + "\n";
  std::size_t written = 0;
  while (written < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + written, line.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IOError(path_ + ": write failed: " + std::strerror(errno));
    written += static_cast<std::size_t>(n);
  }
  return SyncFd(fd_, path_);
}

Result<std::vector<PolicyResult>> compute_results(const EvalConfig& config, const std::string& dir) {
  std::vector<PolicyResult> results;
  for (const auto& task : config.tasks) {
    NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> rows, config.ShardRows(task));
    std::map<std::string, std::map<int64_t, PredictionRecord>> by_policy;
    for (const auto& policy : config.policies) {
      const std::string path = predictions_path(dir, task, policy);
      NAMM_ASSIGN_OR_RETURN(std::vector<PredictionRecord> records, load_predictions(path, /*repair=*/false));
      auto& by_row = by_policy[policy];
      for (auto& r : records) by_row.emplace(r.row, std::move(r));
      for (int64_t row : rows) {
        if (!by_row.count(row)) {
          return Status::FailedPrecondition(path + ": row " + std::to_string(row) + " of task " + task +
                                            " has no prediction (the evaluation is incomplete)");
        }
      }
    }
    // Means over the configuration's rows (records of other rows, if any, are ignored).
    const auto mean_of = [&](const std::string& policy, double PredictionRecord::*field) {
      double sum = 0;
      for (int64_t row : rows) sum += by_policy[policy][row].*field;
      return rows.empty() ? 0.0 : sum / static_cast<double>(rows.size());
    };
    // Rows whose answer had no query (EOS first) have no answer-time cache.
    const auto answer_mean_of = [&](const std::string& policy) {
      double sum = 0;
      int64_t n = 0;
      for (int64_t row : rows) {
        const double v = by_policy[policy][row].answer_kv_tokens;
        if (v > 0) sum += v, ++n;
      }
      return n > 0 ? sum / static_cast<double>(n) : std::nan("");
    };
    // Against the full cache's over the same rows: a row where either answered nothing (EOS first) counts for
    // neither, else the ratio compared means over different rows.
    const auto answer_relative_to_full = [&](const std::string& policy) {
      double mine = 0, full = 0;
      for (int64_t row : rows) {
        const double a = by_policy[policy][row].answer_kv_tokens, f = by_policy["full"][row].answer_kv_tokens;
        if (a > 0 && f > 0) mine += a, full += f;
      }
      return full > 0 ? mine / full : std::nan("");
    };
    const double full_score = mean_of("full", &PredictionRecord::score);
    const double full_cache = mean_of("full", &PredictionRecord::mean_kv_tokens);
    for (const auto& policy : config.policies) {
      PolicyResult r;
      r.task = task;
      r.policy = policy;
      r.family = Family(policy);
      r.cache_setting = CacheSetting(policy);
      r.rows = static_cast<int64_t>(rows.size());
      r.score = mean_of(policy, &PredictionRecord::score);
      r.normalized_score = full_score > 0 ? r.score / full_score : std::nan("");
      r.mean_kv_tokens = mean_of(policy, &PredictionRecord::mean_kv_tokens);
      r.peak_kv_tokens = mean_of(policy, &PredictionRecord::peak_kv_tokens);
      r.relative_cache = full_cache > 0 ? r.mean_kv_tokens / full_cache : std::nan("");
      r.answer_kv_tokens = answer_mean_of(policy);
      r.answer_relative_cache = answer_relative_to_full(policy);
      double tokens = 0;
      for (int64_t row : rows) {
        const PredictionRecord& p = by_policy[policy][row];
        r.seconds += p.seconds;
        tokens += static_cast<double>(p.prefill_tokens + p.decode_tokens);
      }
      r.tokens_per_second = r.seconds > 0 ? tokens / r.seconds : 0;
      for (int64_t row : rows) r.row_scores.push_back(by_policy[policy][row].score);
      results.push_back(r);
    }
  }
  return results;
}

namespace {

// JSON numbers for NaN are null.
Json Number(double v) { return std::isfinite(v) ? Json(v) : Json(); }

std::string ResultsJson(const EvalConfig& config, const std::vector<PolicyResult>& results) {
  OrderedJson j;
  j["commit"] = config.commit;
  j["model"] = config.model;
  j["tasks"] = config.tasks;
  j["policies"] = config.policies;
  j["results"] = OrderedJson::array();
  for (const auto& r : results) {
    j["results"].push_back({{"task", r.task},
                            {"policy", r.policy},
                            {"family", r.family},
                            {"cache_setting", r.cache_setting},
                            {"rows", r.rows},
                            {"score", Number(r.score)},
                            {"normalized_score", Number(r.normalized_score)},
                            {"mean_kv_tokens", Number(r.mean_kv_tokens)},
                            {"peak_kv_tokens", Number(r.peak_kv_tokens)},
                            {"relative_cache", Number(r.relative_cache)},
                            {"answer_kv_tokens", Number(r.answer_kv_tokens)},
                            {"answer_relative_cache", Number(r.answer_relative_cache)},
                            {"seconds", Number(r.seconds)},
                            {"tokens_per_second", Number(r.tokens_per_second)}});
  }
  j["matched_cache"] = OrderedJson::array();
  for (const auto& m : matched_cache_comparison(results)) {
    j["matched_cache"].push_back({{"task", m.task},
                                  {"policy", m.policy},
                                  {"family", m.family},
                                  {"relative_cache", Number(m.relative_cache)},
                                  {"score", Number(m.score)},
                                  {"family_score", Number(m.family_score)},
                                  {"note", m.note}});
  }
  j["paired"] = OrderedJson::array();
  for (const auto& p : paired_comparison(results)) {
    j["paired"].push_back({{"task", p.task},
                           {"policy", p.policy},
                           {"other", p.other},
                           {"cache_setting", p.cache_setting},
                           {"rows", p.rows},
                           {"mean_difference", Number(p.mean_difference)},
                           {"standard_error", Number(p.standard_error)},
                           {"t", Number(p.t)},
                           {"wins", p.wins}});
  }
  return j.dump(2) + "\n";
}

// paired_comparison() as table cells.
std::vector<std::vector<std::string>> PairedRows(const std::vector<PairedComparison>& comparisons) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& p : comparisons) {
    rows.push_back({p.task, p.policy, p.other, format_number(p.mean_difference, 4), format_number(p.standard_error, 4),
                    format_number(p.t, 2), std::to_string(p.wins) + " / " + std::to_string(p.rows)});
  }
  return rows;
}
const std::vector<std::string> kPairedHeader = {"task", "NAMM", "against", "mean difference", "standard error", "t",
                                                "NAMM higher on"};

std::string ResultsCsv(const std::vector<PolicyResult>& results) {
  std::ostringstream out;
  out << "task,policy,family,cache_setting,rows,score,normalized_score,mean_kv_tokens,peak_kv_tokens,"
         "relative_cache,"
         "answer_kv_tokens,answer_relative_cache,seconds,tokens_per_second\n";
  for (const auto& r : results) {
    out << csv_field(r.task) << ',' << csv_field(r.policy) << ',' << csv_field(r.family) << ','
        << csv_field(r.cache_setting) << ',' << r.rows << ',' << format_number(r.score, 6) << ','
        << format_number(r.normalized_score, 6) << ',' << format_number(r.mean_kv_tokens, 3) << ','
        << format_number(r.peak_kv_tokens, 3) << ',' << format_number(r.relative_cache, 6) << ','
        << format_number(r.answer_kv_tokens, 3) << ',' << format_number(r.answer_relative_cache, 6) << ','
        << format_number(r.seconds, 3) << ',' << format_number(r.tokens_per_second, 1) << '\n';
  }
  return out.str();
}

// Rows of Table 1: per policy, its score per task, the mean normalized score and the mean relative cache.
std::vector<std::vector<std::string>> TableRows(const EvalConfig& config,
                                                const std::vector<PolicyResult>& results) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& policy : config.policies) {
    std::vector<std::string> row = {policy};
    double normalized = 0, relative = 0;
    int64_t n = 0, normalized_n = 0;
    for (const auto& task : config.tasks) {
      const std::size_t cells = row.size();
      for (const auto& r : results) {
        if (r.task != task || r.policy != policy) continue;
        row.push_back(format_number(r.score, 4));
        // A task whose full cache scored 0 has no normalized score: left out of the mean, not making it NaN.
        if (std::isfinite(r.normalized_score)) normalized += r.normalized_score, ++normalized_n;
        relative += r.relative_cache;
        ++n;
      }
      if (row.size() == cells) row.emplace_back();  // no result for it: an empty cell keeps the columns
    }
    row.push_back(format_number(normalized_n ? normalized / static_cast<double>(normalized_n) : std::nan(""), 3));
    row.push_back(format_number(n ? relative / static_cast<double>(n) : std::nan(""), 3));
    rows.push_back(row);
  }
  return rows;
}

std::vector<std::string> TableHeader(const EvalConfig& config) {
  std::vector<std::string> header = {"policy"};
  header.insert(header.end(), config.tasks.begin(), config.tasks.end());
  header.push_back("mean normalized");
  header.push_back("relative cache");
  return header;
}

// Score vs relative cache for one task: one series per family, its points sorted by cache.
std::string TaskChart(const std::string& task, const std::vector<PolicyResult>& results) {
  std::map<std::string, std::vector<std::pair<double, double>>> families;
  std::vector<std::string> order;
  for (const auto& r : results) {
    if (r.task != task) continue;
    if (!families.count(r.family)) order.push_back(r.family);
    // Points without a finite cache or score are not drawn (a NaN would also break the sort below).
    if (std::isfinite(r.relative_cache) && std::isfinite(r.score)) families[r.family].emplace_back(r.relative_cache, r.score);
  }
  std::vector<ChartSeries> series;
  for (const auto& family : order) {
    auto points = families[family];
    if (points.empty()) continue;
    std::sort(points.begin(), points.end());
    series.push_back({family, points, family == "full"});
  }
  ChartOptions options;
  options.title = task;
  options.x_label = "cache relative to full";
  options.y_label = "score";
  options.x_min = 0;
  return render_line_chart(series, options);
}

// Links to the explain pages under `dir` (eval --explain-rows), a row per (task, policy) that has any.
std::string ExplainLinks(const std::vector<PolicyResult>& results, const std::string& dir) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& r : results) {
    const std::string folder = output_directory_name(r.task) + "/" + output_directory_name(r.policy);
    Result<std::vector<std::string>> names = list_directory(dir + "/" + folder);
    if (!names.ok()) continue;
    std::vector<int64_t> explained;
    for (const std::string& name : *names) {
      if (const std::optional<int64_t> row = explain_page_row(name)) explained.push_back(*row);
    }
    if (explained.empty()) continue;
    std::sort(explained.begin(), explained.end());
    std::string links;
    for (int64_t row : explained) {
      links += (links.empty() ? "" : " ") + std::string("<a href=\"") + html_escape(folder) + "/explain-row-" +
               std::to_string(row) + ".html\">row " + std::to_string(row) + "</a>";
    }
    rows.push_back({r.task, r.policy, links});
  }
  if (rows.empty()) return "";
  return "<h2>What the policies keep</h2>\n<p class=\"meta\">Per row: every token shaded by how long it stayed in "
         "the cache, and the cache size after every memory update (eval --explain-rows).</p>\n" +
         html_table({"task", "policy", "rows"}, rows, /*raw_html_columns=*/{2});
}

std::string ResultsHtml(const EvalConfig& config, const std::vector<PolicyResult>& results, const std::string& dir) {
  std::ostringstream body;
  body << "<h1>namm-worker eval</h1>\n<p class=\"meta\">model <code>" << html_escape(config.model)
       << "</code>, commit <code>" << html_escape(config.commit)
       << "</code>. Score per task against the cache "
       << "kept, relative to the full cache (mean over every query of the cached tokens it attended to); one "
          "line per "
          "policy family, one point per cache setting.</p>\n";
  body << "<h2>Scores</h2>\n" << html_table(TableHeader(config), TableRows(config, results));
  body << "<h2>Score vs relative cache</h2>\n<div class=\"charts\">\n";
  for (const auto& task : config.tasks) body << TaskChart(task, results);
  body << "</div>\n";
  std::vector<std::vector<std::string>> matched;
  for (const auto& m : matched_cache_comparison(results)) {
    matched.push_back({m.task, m.policy, format_number(m.relative_cache, 3), format_number(m.score, 4),
                       m.family, format_number(m.family_score, 4), m.note});
  }
  if (!matched.empty()) {
    body << "<h2>At the same cache</h2>\n<p class=\"meta\">Each fixed-budget family's score interpolated "
            "linearly "
            "between its two cache settings that enclose the policy's relative cache.</p>\n"
         << html_table(
                {"task", "policy", "relative cache", "score", "family", "family at that cache", "note"},
                matched);
  }
  if (const auto paired = paired_comparison(results); !paired.empty()) {
    body << "<h2>Paired per row, at the same setting</h2>\n<p class=\"meta\">Each NAMM against every other policy "
            "at its cache setting (at its own threshold: the full cache), over the same rows: the mean of the NAMM's "
            "score minus the other's, its standard error and t = mean / standard error.</p>\n"
         << html_table(kPairedHeader, PairedRows(paired));
  }
  body << ExplainLinks(results, dir);
  body << "<h2>Every result</h2>\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& r : results) {
    rows.push_back({r.task, r.policy, std::to_string(r.rows), format_number(r.score, 4),
                    format_number(r.normalized_score, 3), format_number(r.mean_kv_tokens, 1),
                    format_number(r.peak_kv_tokens, 1), format_number(r.relative_cache, 3),
                    format_number(r.answer_relative_cache, 3), format_number(r.seconds, 1),
                    format_number(r.tokens_per_second, 0)});
  }
  body << html_table({"task", "policy", "rows", "score", "normalized", "mean KV tokens", "peak KV tokens",
                      "relative cache", "relative cache while answering", "seconds", "tokens/s"},
                     rows);
  return html_page("namm eval: " + config.model, body.str());
}

}  // namespace

Status write_results(const EvalConfig& config, const std::vector<PolicyResult>& results,
                     const std::string& dir) {
  const std::string json = ResultsJson(config, results), csv = ResultsCsv(results),
                    html = ResultsHtml(config, results, dir);
  NAMM_RETURN_IF_ERROR(write_file_atomically(dir + "/results.json", {json}));
  NAMM_RETURN_IF_ERROR(write_file_atomically(dir + "/results.csv", {csv}));
  for (const auto& task : config.tasks) {
    const std::string svg = TaskChart(task, results);
    NAMM_RETURN_IF_ERROR(write_file_atomically(dir + "/plot_" + output_directory_name(task) + ".svg", {svg}));
  }
  return write_file_atomically(dir + "/results.html", {html});
}

namespace {

// Columns padded to their widest cell, the first left-aligned, the others right-aligned, a rule under the header.
std::string TextTable(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width(header.size());
  for (std::size_t c = 0; c < header.size(); ++c) {
    width[c] = header[c].size();
    for (const auto& row : rows) width[c] = std::max(width[c], row[c].size());
  }
  std::ostringstream out;
  const auto line = [&](const std::vector<std::string>& cells) {
    for (std::size_t c = 0; c < cells.size(); ++c) {
      out << (c ? "  " : "") << (c == 0 ? std::left : std::right) << std::setw(static_cast<int>(width[c]))
          << cells[c];
    }
    out << "\n";
  };
  line(header);
  std::size_t total = 0;
  for (std::size_t w : width) total += w + 2;
  out << std::string(total - 2, '-') << "\n";
  for (const auto& row : rows) line(row);
  return out.str();
}

}  // namespace

std::string results_table(const EvalConfig& config, const std::vector<PolicyResult>& results) {
  return TextTable(TableHeader(config), TableRows(config, results));
}

std::vector<MatchedComparison> matched_cache_comparison(const std::vector<PolicyResult>& results) {
  std::vector<MatchedComparison> out;
  for (const PolicyResult& p : results) {
    if (p.family == "full" || !p.cache_setting.empty() || !std::isfinite(p.relative_cache)) continue;
    // Other fixed-budget families: a NAMM's own budget settings are its family, not one to compare it with.
    std::vector<std::string> families;
    for (const PolicyResult& r : results) {
      if (r.task == p.task && !r.cache_setting.empty() && r.family != p.family &&
          std::find(families.begin(), families.end(), r.family) == families.end()) {
        families.push_back(r.family);
      }
    }
    for (const auto& family : families) {
      std::vector<const PolicyResult*> points;
      for (const PolicyResult& r : results) {
        if (r.task == p.task && r.family == family && !r.cache_setting.empty() && std::isfinite(r.relative_cache)) {
          points.push_back(&r);
        }
      }
      std::sort(points.begin(), points.end(), [](const PolicyResult* a, const PolicyResult* b) {
        return a->relative_cache < b->relative_cache;
      });
      MatchedComparison m{p.task, p.policy, family, p.relative_cache, p.score, std::nan(""), ""};
      if (points.empty()) {  // e.g. the full cache's size is unknown, so no relative one is either
        m.note = "no cache setting of it has a known relative cache";
        out.push_back(m);
        continue;
      }
      const auto describe = [](const PolicyResult* r) {
        return r->cache_setting + " at " + format_number(r->relative_cache, 3) + ": " +
               format_number(r->score, 4);
      };
      if (p.relative_cache < points.front()->relative_cache) {
        m.note = "below its smallest cache (" + describe(points.front()) + ")";
      } else if (p.relative_cache > points.back()->relative_cache) {
        m.note = "above its largest cache (" + describe(points.back()) + ")";
      } else {
        for (std::size_t i = 0; i + 1 < points.size() || i == 0; ++i) {
          const PolicyResult* lo = points[i];
          const PolicyResult* hi = points[std::min(i + 1, points.size() - 1)];
          if (p.relative_cache > hi->relative_cache) continue;
          const double span = hi->relative_cache - lo->relative_cache;
          const double t = span > 0 ? (p.relative_cache - lo->relative_cache) / span : 0.0;
          m.family_score = lo->score + t * (hi->score - lo->score);
          m.note = "between " + lo->cache_setting + " and " + hi->cache_setting;
          break;
        }
      }
      out.push_back(m);
    }
  }
  return out;
}

std::string matched_table(const std::vector<MatchedComparison>& comparisons) {
  std::ostringstream out;
  for (const auto& m : comparisons) {
    out << m.task << "  " << m.policy << " (score " << format_number(m.score, 4) << ", relative cache "
        << format_number(m.relative_cache, 3) << ") vs " << m.family << ": ";
    if (std::isfinite(m.family_score)) {
      out << format_number(m.family_score, 4) << " at the same cache (" << m.note
          << "): " << (m.score > m.family_score ? "above" : "not above") << "\n";
    } else {
      out << m.note << "\n";
    }
  }
  return out.str();
}

std::vector<PairedComparison> paired_comparison(const std::vector<PolicyResult>& results) {
  std::vector<PairedComparison> out;
  for (const PolicyResult& namm : results) {
    if (namm.family.rfind("namm:", 0) != 0) continue;
    for (const PolicyResult& other : results) {
      const bool same_setting = namm.cache_setting.empty() ? other.family == "full"
                                                           : other.cache_setting == namm.cache_setting &&
                                                                 other.family != namm.family;
      if (other.task != namm.task || !same_setting || other.row_scores.size() != namm.row_scores.size()) continue;
      PairedComparison p{namm.task, namm.policy, other.policy, namm.cache_setting,
                         static_cast<int64_t>(namm.row_scores.size()), 0, 0, 0, 0};
      if (p.rows == 0) continue;
      std::vector<double> d;
      for (std::size_t i = 0; i < namm.row_scores.size(); ++i) {
        d.push_back(namm.row_scores[i] - other.row_scores[i]);
        p.wins += d.back() > 0 ? 1 : 0;
        p.mean_difference += d.back();
      }
      const auto n = static_cast<double>(p.rows);
      p.mean_difference /= n;
      double squares = 0;
      for (double x : d) squares += (x - p.mean_difference) * (x - p.mean_difference);
      p.standard_error = p.rows > 1 ? std::sqrt(squares / (n - 1) / n) : std::nan("");
      p.t = p.standard_error > 0 ? p.mean_difference / p.standard_error : std::nan("");
      out.push_back(p);
    }
  }
  return out;
}

std::string paired_table(const std::vector<PairedComparison>& comparisons) {
  return comparisons.empty() ? "" : TextTable(kPairedHeader, PairedRows(comparisons));
}

Result<std::vector<PolicyResult>> merge_shards(const std::vector<std::string>& shard_dirs,
                                               const std::string& out) {
  if (shard_dirs.empty()) return Status::InvalidArgument("--merge needs the shards' output directories");
  std::vector<EvalConfig> configs;
  for (const auto& dir : shard_dirs) {
    NAMM_ASSIGN_OR_RETURN(std::string text, read_file(dir + "/config.yaml"));
    NAMM_ASSIGN_OR_RETURN(EvalConfig config, EvalConfig::FromYaml(text, dir + "/config.yaml"));
    configs.push_back(std::move(config));
  }
  const EvalConfig& first = configs.front();
  std::vector<int> seen(static_cast<std::size_t>(first.shard_count), 0);
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const EvalConfig& c = configs[i];
    if (const std::string diff = c.DifferenceFrom(first);
        !diff.empty() || c.shard_count != first.shard_count) {
      return Status::InvalidArgument(shard_dirs[i] + " is a shard of another evaluation than " +
                                     shard_dirs[0] + " (" + (diff.empty() ? "shard count" : diff) + ")");
    }
    if (seen[static_cast<std::size_t>(c.shard_index)]++) {
      return Status::InvalidArgument("shard " + std::to_string(c.shard_index) + "/" +
                                     std::to_string(c.shard_count) + " is given twice (" + shard_dirs[i] +
                                     ")");
    }
  }
  for (std::size_t s = 0; s < seen.size(); ++s) {
    if (!seen[s]) {
      return Status::InvalidArgument("shard " + std::to_string(s) + "/" + std::to_string(first.shard_count) +
                                     " is missing");
    }
  }
  EvalConfig merged = first;
  merged.shard_index = 0;
  merged.shard_count = 1;
  if (path_exists(out + "/config.yaml")) {
    return Status::InvalidArgument(out + " already holds an evaluation; merge into a new directory");
  }
  // Every shard must be complete before anything is written.
  std::map<std::pair<std::string, std::string>, std::vector<PredictionRecord>> joined;
  std::vector<std::pair<std::string, std::string>> explain_pages;  // (in a shard, in `out`) for the shard's rows
  for (std::size_t i = 0; i < configs.size(); ++i) {
    NAMM_RETURN_IF_ERROR(compute_results(configs[i], shard_dirs[i]).status());
    for (const auto& task : merged.tasks) {
      for (const auto& policy : merged.policies) {
        NAMM_ASSIGN_OR_RETURN(std::vector<PredictionRecord> records,
                              load_predictions(predictions_path(shard_dirs[i], task, policy), false));
        NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> own, configs[i].ShardRows(task));
        const std::set<int64_t> own_rows(own.begin(), own.end());
        std::set<int64_t> taken;
        auto& all = joined[{task, policy}];
        for (auto& r : records) {
          // Only the shard's own rows, once each (compute_results above checked that all are there).
          if (own_rows.count(r.row) && taken.insert(r.row).second) all.push_back(std::move(r));
        }
        // Its explain pages (eval --explain-rows), which the merged results page links.
        const std::string folder = parent_directory(predictions_path(shard_dirs[i], task, policy));
        const std::string merged_folder = parent_directory(predictions_path(out, task, policy));
        const Result<std::vector<std::string>> names = list_directory(folder);
        for (const std::string& name : names.ok() ? *names : std::vector<std::string>{}) {
          const std::optional<int64_t> row = explain_page_row(name);
          if (row && own_rows.count(*row)) explain_pages.emplace_back(folder + "/" + name, merged_folder + "/" + name);
        }
      }
    }
  }
  NAMM_RETURN_IF_ERROR(make_directories(out));
  for (auto& [key, records] : joined) {
    std::stable_sort(records.begin(), records.end(),
                     [](const PredictionRecord& a, const PredictionRecord& b) { return a.row < b.row; });
    std::string text;
    for (const auto& r : records) text += r.ToJson().dump() + "\n";
    const std::string path = predictions_path(out, key.first, key.second);
    NAMM_RETURN_IF_ERROR(make_directories(parent_directory(path)));
    NAMM_RETURN_IF_ERROR(write_file_atomically(path, {text}));
  }
  for (const auto& [from, to] : explain_pages) {
    NAMM_ASSIGN_OR_RETURN(const std::string page, read_file(from));
    NAMM_RETURN_IF_ERROR(write_file_atomically(to, {page}));
  }
  NAMM_ASSIGN_OR_RETURN(std::vector<PolicyResult> results, compute_results(merged, out));
  NAMM_RETURN_IF_ERROR(write_results(merged, results, out));
  NAMM_RETURN_IF_ERROR(write_file_atomically(out + "/config.yaml", {merged.ToYaml()}));
  return results;
}

}  // namespace namm::worker
