// The roofline beside the benches' figures: a matrix-product peak measured in the same run on the same threads,
// and the floating-point work of a generation counted from the model's shape and what the generation did, so
// that a bench can print the FLOP rate of its step and that rate's share of the peak.
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "namm/worker/generator.h"
#include "namm/worker/llama_config.h"

namespace namm::bench {

// GFLOP/s of the faster of libtorch's matrix product (BLAS) and our row-invariant linear kernel (what the engine's
// float32 CPU products run) on [256, 1024] x [1024, 1024], best of several calls, on the process's CPU thread
// budget as it is set now (namm/cpu_threads.h). On a GPU, libtorch's product in `dtype` there (cuBLAS), on
// [4096, 4096] x [4096, 4096].
struct MatmulPeak {
  double gflops = 0;
  std::string source;  // "BLAS sgemm", "our linear kernel" or "cuBLAS"
};
MatmulPeak MeasureMatmulPeak(at::Device device = at::kCPU, at::ScalarType dtype = at::kFloat);

// What a generation computed, 2 FLOPs per multiply-add: the dense products of every token it ran (attention
// projections, feed-forward), the head's product for `logit_rows` rows, attention over the keys each query saw
// (GenerationResult::mean_kv_tokens), and with a NAMM (namm_hidden > 0: the BAM's width) its observation (the GQA
// mean and the 32 x 34 windowed DFT of each token at each hop) and its memory updates (the BAM scorer over the
// tokens cached before each update). An estimate from shapes: the NAMM's recomputed query-history rows and
// element-wise work are left out.
double GenerationFlops(const worker::LlamaConfig& config, const worker::GenerationResult& result, int64_t logit_rows,
                       int64_t namm_hidden);

// "R GFLOP/s | S% of peak" for `flops` done in `seconds`.
std::string RooflineCells(double flops, double seconds, const MatmulPeak& peak);

}  // namespace namm::bench
