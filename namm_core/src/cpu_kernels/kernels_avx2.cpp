// The CPU kernels compiled for avx2 (flags in namm_core/CMakeLists.txt).
#define NAMM_KERNEL_NAMESPACE avx2
#define NAMM_KERNEL_ISA "avx2"
#define NAMM_KERNEL_LANES 8
#define NAMM_KERNEL_ROWS 4
#include "kernels.inc"
