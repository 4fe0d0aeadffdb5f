// Inputs the engine's stories260K tests share: a long prompt with structure, and NAMMs with seeded parameters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../namm_core/test_util.h"
#include "namm/namm_model.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

// A prompt of n tokens: the stories prompt repeated, so that the model's attention has structure.
inline std::vector<int64_t> LongPrompt(const Tokenizer& tokenizer, int64_t n) {
  std::string text;
  while (static_cast<int64_t>(tokenizer.Encode(text).value().size()) < n) {
    text += "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ";
    text += "One day, she saw a big, red ball and a dog named Max. ";
  }
  std::vector<int64_t> ids = tokenizer.EncodeForModel(text).value();
  ids.resize(static_cast<std::size_t>(n));
  return ids;
}

// The default BAM NAMM with N(0, scale^2) parameters from `seed` (all zero for scale 0).
inline NammModel NammWith(double scale, uint64_t seed) {
  NammModel model;
  model.params = initial_params(model.architecture);
  if (scale > 0) {
    const at::Tensor p = testing::RandomNormal({static_cast<int64_t>(model.params.size())}, seed, scale);
    model.params.assign(p.data_ptr<float>(), p.data_ptr<float>() + p.numel());
  }
  return model;
}

}  // namespace namm::worker
