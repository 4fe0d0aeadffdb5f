// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a counter-based
// generator. Each output block is a pure function of a 64-bit key and a 128-bit counter, so the k-th draw of
// any stream can be computed without generating the ones before it and a generator has no state to save:
// "the samples of generation g" are simply the blocks whose counter names g.
#pragma once

#include <array>
#include <cstdint>

namespace namm {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxBlock = std::array<uint32_t, 4>;

// The 4 x 32 random bits for `counter` under `key` (key words: low 32 bits, high 32 bits).
PhiloxBlock philox4x32_10(const PhiloxCounter& counter, uint64_t key);

// Two independent standard normal draws from one block (Box-Muller on two 53-bit uniforms in (0, 1]).
std::array<double, 2> philox_normal_pair(const PhiloxCounter& counter, uint64_t key);

// A uniform 53-bit double in [0, 1) from the first two words of the block.
double philox_uniform(const PhiloxCounter& counter, uint64_t key);

}  // namespace namm
