#include "random_model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "namm/option_spec.h"
#include "namm/worker/llama_weights.h"

namespace namm::bench {

Result<worker::LlamaModel> RandomModel(const std::string& spec, int64_t context, at::ScalarType dtype, at::Device device) {
  NAMM_ASSIGN_OR_RETURN(OptionSpec shape, parse_option_spec("random:" + spec));
  NAMM_RETURN_IF_ERROR(shape.CheckKeys({"layers", "dim", "heads", "kv_heads", "ffn", "vocab"}));
  worker::LlamaConfig c;
  c.architecture = "random";
  NAMM_ASSIGN_OR_RETURN(c.n_layers, shape.GetInt("layers", 2));
  NAMM_ASSIGN_OR_RETURN(c.dim, shape.GetInt("dim", 2048));
  NAMM_ASSIGN_OR_RETURN(c.n_heads, shape.GetInt("heads", 16));
  NAMM_ASSIGN_OR_RETURN(c.n_kv_heads, shape.GetInt("kv_heads", 4));
  NAMM_ASSIGN_OR_RETURN(c.hidden_dim, shape.GetInt("ffn", 7168));
  NAMM_ASSIGN_OR_RETURN(c.vocab_size, shape.GetInt("vocab", 32000));
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  c.rope_theta = 500000;
  c.max_position_embeddings = context;
  NAMM_RETURN_IF_ERROR(c.Validate());
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  const auto gaussian = [&](std::vector<int64_t> shape_of) {
    return at::normal(0.0, 0.02, shape_of, generator, f32);
  };
  worker::LlamaWeights w;
  w.token_embedding = gaussian({c.vocab_size, c.dim});
  for (int64_t l = 0; l < c.n_layers; ++l) {
    worker::LlamaLayerWeights layer;
    layer.attention_norm = at::ones({c.dim}, f32);
    layer.wq = gaussian({c.n_heads * c.head_dim, c.dim});
    layer.wk = gaussian({c.n_kv_heads * c.head_dim, c.dim});
    layer.wv = gaussian({c.n_kv_heads * c.head_dim, c.dim});
    layer.wo = gaussian({c.dim, c.n_heads * c.head_dim});
    layer.ffn_norm = at::ones({c.dim}, f32);
    layer.w_gate = gaussian({c.hidden_dim, c.dim});
    layer.w_up = gaussian({c.hidden_dim, c.dim});
    layer.w_down = gaussian({c.dim, c.hidden_dim});
    w.layers.push_back(std::move(layer));
  }
  w.final_norm = at::ones({c.dim}, f32);
  w.lm_head = gaussian({c.vocab_size, c.dim});
  // Drawn in float32 on the CPU, so that every dtype and device runs the same model.
  const at::TensorOptions options = f32.dtype(dtype).device(device);
  for (at::Tensor* t : {&w.token_embedding, &w.final_norm, &w.lm_head}) *t = t->to(options);
  for (worker::LlamaLayerWeights& l : w.layers) {
    for (at::Tensor* t : {&l.attention_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down}) {
      *t = t->to(options);
    }
  }
  return worker::LlamaModel(worker::LoadedModel{c, std::move(w)}, options);
}

std::vector<int64_t> RandomPrompt(int64_t vocab, int64_t n) {
  uint64_t state = 0x2545F4914F6CDD1Dull;
  std::vector<int64_t> ids(static_cast<std::size_t>(n));
  for (int64_t& id : ids) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int64_t>((state >> 33) % static_cast<uint64_t>(vocab));
  }
  return ids;
}

}  // namespace namm::bench
