// The CPU kernels compiled for avx512 (flags in namm_core/CMakeLists.txt).
#define NAMM_KERNEL_NAMESPACE avx512
#define NAMM_KERNEL_ISA "avx512"
#define NAMM_KERNEL_LANES 16
#define NAMM_KERNEL_ROWS 8
#include "kernels.inc"
