// The windowed DFT basis the spectrogram features use (stft_features.cpp), for the CPU kernels and their
// tests.
#pragma once

#include <ATen/core/Tensor.h>

namespace namm {

// [32, 34] float32 on the CPU, contiguous: periodic-Hann-windowed cosines of bins 0..16, then negated sines.
const at::Tensor& windowed_dft_basis_cpu();

}  // namespace namm
