// The CPU kernels compiled for baseline (flags in namm_core/CMakeLists.txt).
#define NAMM_KERNEL_NAMESPACE baseline
#define NAMM_KERNEL_ISA "baseline"
#define NAMM_KERNEL_LANES 4
#define NAMM_KERNEL_ROWS 2
#include "kernels.inc"
