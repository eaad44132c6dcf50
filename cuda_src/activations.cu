// GELU (erf and tanh forms) and SiLU, forward and backward, elementwise in fp32 with 16-byte vector accesses.
#include "common.cuh"

#define GELU_K0 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_K1 0.044715f
#define INV_SQRT2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

// tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float u = GELU_K0 * (x + GELU_K1 * x * x * x);
    return x / (1.f + expf(-2.f * u));
}

__device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float u = GELU_K0 * (x + GELU_K1 * x * x * x);
    const float s = 1.f / (1.f + expf(-2.f * u));
    const float du = GELU_K0 * (1.f + 3.f * GELU_K1 * x * x);
    return s + 2.f * x * s * (1.f - s) * du;
}

__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * INV_SQRT2)); }

__device__ __forceinline__ float gelu_erf_grad(float x) {
    return 0.5f * (1.f + erff(x * INV_SQRT2)) + x * INV_SQRT_2PI * expf(-0.5f * x * x);
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

__device__ __forceinline__ float silu_grad(float x) {
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
}

// approx: 0 = erf ("none"), 1 = tanh
template <typename T>
__global__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, i64 n, int approx) {
    if (approx)
        map1<T>(x, y, n, [](float v) { return gelu_tanh(v); });
    else
        map1<T>(x, y, n, [](float v) { return gelu_erf(v); });
}

template <typename T>
__global__ void gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n, int approx) {
    if (approx)
        map2<T>(dy, x, dx, n, [](float g, float v) { return g * gelu_tanh_grad(v); });
    else
        map2<T>(dy, x, dx, n, [](float g, float v) { return g * gelu_erf_grad(v); });
}

template <typename T>
__global__ void silu_fwd(const T* __restrict__ x, T* __restrict__ y, i64 n) {
    map1<T>(x, y, n, [](float v) { return silu(v); });
}

template <typename T>
__global__ void silu_bwd(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2<T>(dy, x, dx, n, [](float g, float v) { return g * silu_grad(v); });
}
