#include "random_model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

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
  // Every weight matrix from its own generator (seed 1 + its index), drawn in float32 on the CPU, so that every
  // dtype and device runs the same model, and on every core at once: Llama 3 8B's 8 billion weights take
  // seconds instead of a minute on one thread.
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  const at::TensorOptions options = f32.dtype(dtype).device(device);
  worker::LlamaWeights w;
  w.layers.resize(static_cast<std::size_t>(c.n_layers));
  std::vector<std::pair<at::Tensor*, std::vector<int64_t>>> gaussians = {{&w.token_embedding, {c.vocab_size, c.dim}},
                                                                         {&w.lm_head, {c.vocab_size, c.dim}}};
  for (worker::LlamaLayerWeights& layer : w.layers) {
    layer.attention_norm = at::ones({c.dim}, options);
    layer.ffn_norm = at::ones({c.dim}, options);
    gaussians.push_back({&layer.wq, {c.n_heads * c.head_dim, c.dim}});
    gaussians.push_back({&layer.wk, {c.n_kv_heads * c.head_dim, c.dim}});
    gaussians.push_back({&layer.wv, {c.n_kv_heads * c.head_dim, c.dim}});
    gaussians.push_back({&layer.wo, {c.dim, c.n_heads * c.head_dim}});
    gaussians.push_back({&layer.w_gate, {c.hidden_dim, c.dim}});
    gaussians.push_back({&layer.w_up, {c.hidden_dim, c.dim}});
    gaussians.push_back({&layer.w_down, {c.dim, c.hidden_dim}});
  }
  w.final_norm = at::ones({c.dim}, options);
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> threads;
  std::mutex failure_mutex;
  std::string failure;
  const unsigned n_threads = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 64));
  for (unsigned t = 0; t < n_threads; ++t) {
    threads.emplace_back([&] {
      try {
        for (std::size_t i = next++; i < gaussians.size(); i = next++) {
          at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(1 + i);
          *gaussians[i].first = at::normal(0.0, 0.02, gaussians[i].second, generator, f32).to(options);
        }
      } catch (const std::exception& e) {
        const std::lock_guard<std::mutex> lock(failure_mutex);
        failure = e.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (!failure.empty()) return Status::Internal("drawing the random model's weights: " + failure);
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
