// GELU (erf and tanh forms) and SiLU, forward and backward, elementwise in fp32 with 16-byte vector accesses.
// The formulas are in activations.cuh.
#include "activations.cuh"

#define ACT_UNROLL 4  // 16-byte vectors per thread and loop step; keep equal to _UNROLL in flame_core/kernels/activations.py

// approx: 0 = erf ("none"), 1 = tanh
template <typename T>
__global__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, i64 n, int approx) {
    if (approx)
        map1_unrolled<T, ACT_UNROLL>(x, y, n, [](float v) { return gelu_tanh(v); });
    else
        map1_unrolled<T, ACT_UNROLL>(x, y, n, [](float v) { return gelu_erf(v); });
}

template <typename T>
__global__ void gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n, int approx) {
    if (approx)
        map2_unrolled<T, ACT_UNROLL>(dy, x, dx, n, [](float g, float v) { return g * gelu_tanh_grad(v); });
    else
        map2_unrolled<T, ACT_UNROLL>(dy, x, dx, n, [](float g, float v) { return g * gelu_erf_grad(v); });
}

template <typename T>
__global__ void silu_fwd(const T* __restrict__ x, T* __restrict__ y, i64 n) {
    map1_unrolled<T, ACT_UNROLL>(x, y, n, [](float v) { return silu(v); });
}

template <typename T>
__global__ void silu_bwd(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2_unrolled<T, ACT_UNROLL>(dy, x, dx, n, [](float g, float v) { return g * silu_grad(v); });
}
