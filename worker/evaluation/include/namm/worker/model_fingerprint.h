// A model's identity for a training run: runs refuse workers whose model differs from the run's, and base-model
// reference scores are stored per fingerprint.
#pragma once

#include <string>

#include "namm/status.h"

namespace namm::worker {

// "sha256:<64 hex>" over the model's files — a llama2.c checkpoint, or a Hugging Face directory's config.json
// and *.safetensors — and the tokenizer file (when given), each as its name, size and bytes, in name order.
// Reads every byte once (a few seconds per GB).
Result<std::string> model_fingerprint(const std::string& model_path, const std::string& tokenizer_path);

// "sha256:<64 hex>" over one file, as its name, size and bytes (e.g. a NAMM file or a task's rows).
Result<std::string> file_fingerprint(const std::string& path);
// "sha256:<64 hex>" over `text` (e.g. a task's resolved definition, tasks::task_definition_text).
Result<std::string> text_fingerprint(const std::string& text);

}  // namespace namm::worker
