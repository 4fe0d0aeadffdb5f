// A model's identity for a training run: runs refuse workers whose model differs from the run's, and base-model
// reference scores are stored per fingerprint.
#pragma once

#include <string>

#include "namm/status.h"

namespace namm::worker {

// "sha256:<64 hex>" over the files that decide the model's scores, each as its name, size and bytes: a llama2.c
// checkpoint; or a Hugging Face directory's *.safetensors, config.json, generation_config.json and tokenizer
// files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja), in name order; then
// the tokenizer given (when given): a tokenizer file (llama2.c's or a tokenizer.json) with the settings and chat
// template files beside it, or a directory's tokenizer files (a file already counted counts once). Reads every byte once (a few
// seconds per GB).
Result<std::string> model_fingerprint(const std::string& model_path, const std::string& tokenizer_path);

// "sha256:<64 hex>" over one file, as its name, size and bytes (e.g. a NAMM file or a task's rows).
Result<std::string> file_fingerprint(const std::string& path);
// "sha256:<64 hex>" over `text` (e.g. a task's resolved definition, tasks::task_definition_text).
Result<std::string> text_fingerprint(const std::string& text);

}  // namespace namm::worker
