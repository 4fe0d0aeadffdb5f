// The command-line flags that locate task definitions and data (--tasks-dir, --data-dir, --config-dir), shared
// by namm-worker and namm-coordinator. Header-only so that namm_tasks does not depend on CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include "namm/tasks/task.h"

namespace namm::tasks {

inline void add_task_path_options(CLI::App* cmd, TaskPathFlags& flags) {
  cmd->add_option("--tasks-dir", flags.tasks_dir, "Directory of task definitions (default: the repository's tasks/)");
  cmd->add_option("--data-dir", flags.data_dirs, "BENCHMARK=DIR holding <dataset>.jsonl (repeatable; longbench "
                                                 "defaults to ../shared/data/longbench)");
  cmd->add_option("--config-dir", flags.config_dirs, "BENCHMARK=DIR holding dataset2prompt.json and "
                                                     "dataset2maxlen.json (default: <data dir>/config)");
}

}  // namespace namm::tasks
