// The register image of one 16-byte vector access (N elements of T: 16 / sizeof(T) for a single
// load or store instruction), shared by the elementwise and row kernels. alignas(16) lets a
// reinterpret_cast of a 16-byte aligned address load or store it whole; the element-by-element
// paths fill the same slots, so the arithmetic after a load never depends on the path.
#pragma once

namespace rl_align {

template <typename T, int N>
struct alignas(16) Pack {
  T v[N];
};

}  // namespace rl_align
