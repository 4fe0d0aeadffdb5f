#include "cpu_kernels/cpu_kernels.h"

namespace namm::cpu {

#if defined(NAMM_KERNELS_X86)
namespace avx512 {
extern const Kernels kKernels;
}
namespace avx2 {
extern const Kernels kKernels;
}
#endif
namespace baseline {
extern const Kernels kKernels;
}

std::vector<const Kernels*> runnable_kernels() {
  std::vector<const Kernels*> runnable;
#if defined(NAMM_KERNELS_X86)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"))
    runnable.push_back(&avx512::kKernels);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) runnable.push_back(&avx2::kKernels);
#endif
  runnable.push_back(&baseline::kKernels);
  return runnable;
}

const Kernels& kernels() {
  static const Kernels* const widest = runnable_kernels().front();
  return *widest;
}

}  // namespace namm::cpu
