// GELU (erf and tanh forms), SiLU and QuickGELU, forward and backward, elementwise in fp32 with 16-byte vector
// accesses (the backwards of 2-byte types: 8-byte, *_bwd_step; the SiLU forward of 2-byte types on sm_90: bulk
// copies, silu_fwd_bulk).
// The formulas are in activations.cuh.
#include "activations.cuh"

// U: 16-byte vectors per thread and loop step (map1_unrolled / map2_unrolled), a template argument: Python picks it per
// kernel and form (flame_core/kernels/activations.py, _PLANS) and asks for "gelu_fwd<T, U>" etc.

// *_bwd_step: the backwards as one loop step per thread with 8-byte vectors (map2_step8), for float16 / bfloat16 (the
// arrays are 16-byte aligned: loader.contiguous); the caller does the n % 4 elements past the last vector with *_bwd.
// (One-step forwards only tied the loop kernels or lost when measured at commit 58de458, so there are none.)

// approx: 0 = erf ("none"), 1 = tanh
template <typename T, int U>
__global__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, i64 n, int approx) {
    if (approx)
        map1_unrolled<T, U>(x, y, n, [](float v) { return gelu_tanh(v); });
    else
        map1_unrolled<T, U>(x, y, n, [](float v) { return gelu_erf(v); });
}

template <typename T, int U>
__global__ void gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n, int approx) {
    if (approx)
        map2_unrolled<T, U>(dy, x, dx, n, [](float g, float v) { return g * gelu_tanh_grad(v); });
    else
        map2_unrolled<T, U>(dy, x, dx, n, [](float g, float v) { return g * gelu_erf_grad(v); });
}

template <typename T, int U>
__global__ void gelu_bwd_step(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n,
                              int approx) {
    if (approx)
        map2_step8<T, U>(dy, x, dx, n, [](float g, float v) { return g * gelu_tanh_grad(v); });
    else
        map2_step8<T, U>(dy, x, dx, n, [](float g, float v) { return g * gelu_erf_grad(v); });
}

template <typename T, int U>
__global__ void silu_fwd(const T* __restrict__ x, T* __restrict__ y, i64 n) {
    map1_unrolled<T, U>(x, y, n, [](float v) { return silu(v); });
}

template <typename T, int U>
__global__ void silu_bwd(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2_unrolled<T, U>(dy, x, dx, n, [](float g, float v) { return g * silu_grad(v); });
}

template <typename T, int U>
__global__ void silu_bwd_step(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2_step8<T, U>(dy, x, dx, n, [](float g, float v) { return g * silu_grad(v); });
}

template <typename T, int U>
__global__ void qgelu_fwd(const T* __restrict__ x, T* __restrict__ y, i64 n) {
    map1_unrolled<T, U>(x, y, n, [](float v) { return quick_gelu(v); });
}

template <typename T, int U>
__global__ void qgelu_bwd(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2_unrolled<T, U>(dy, x, dx, n, [](float g, float v) { return g * quick_gelu_grad(v); });
}

template <typename T, int U>
__global__ void qgelu_bwd_step(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2_step8<T, U>(dy, x, dx, n, [](float g, float v) { return g * quick_gelu_grad(v); });
}

// silu_fwd_bulk (sm_90): the SiLU forward as one CHUNK-byte chunk per block through the bulk-copy engine (map1_bulk),
// for float16 / bfloat16; n: whole 16-byte vectors, the caller does the n % 8 elements past them with silu_fwd.
template <typename T, int CHUNK>
__global__ void silu_fwd_bulk(const T* __restrict__ x, T* __restrict__ y, i64 n) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    map1_bulk<T, CHUNK>(x, y, n, [](float v) { return silu(v); });
#endif
}
