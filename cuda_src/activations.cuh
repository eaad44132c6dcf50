// The GELU (erf / tanh) and SiLU formulas and their derivatives, in fp32, shared by the elementwise kernels of
// activations.cu and the strided-row GELU of gelu_rows.cu (the same numbers either way).
// The exponentials run on the fast-math unit (ex2.approx: relative error ~2 ulp + |arg| * 2^-24, ~1e-6 for
// |arg| <= 20) and the quotients on rcp.approx (__fdividef, 2 ulp): the kernels stay memory-bound where full-precision
// expf + IEEE division cost ~20 instructions per element. erff stays exact (a branch-free polynomial).
#ifndef FLAME_ACTIVATIONS_CUH
#define FLAME_ACTIVATIONS_CUH
#include "common.cuh"

#define GELU_K0 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_K1 0.044715f
#define INV_SQRT2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

// e^x as 2^(x log2 e) on ex2.approx.ftz (results below 2^-126 flush to 0; __expf adds denormal fix-ups).
__device__ __forceinline__ float exp_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}

// (s, q) = (sigmoid(z), 1 - sigmoid(z)) = (1, e) / (1 + e), e = exp(-z). The exponent is capped at 80 (e^80 ~ 5.5e34,
// 1 + e finite): s is then ~1e-35 instead of the true <1e-35 and q = e * s stays 1, with no inf * 0.
__device__ __forceinline__ void sigmoid_pair(float z, float& s, float& q) {
    const float e = exp_fast(fminf(-z, 80.f));
    s = __fdividef(1.f, 1.f + e);
    q = e * s;
}

// tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float u = GELU_K0 * (x + GELU_K1 * x * x * x);
    return __fdividef(x, 1.f + exp_fast(fminf(-2.f * u, 80.f)));
}

// d/dx [x s(2u)] = s + 2 x s (1 - s) u'
__device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float u = GELU_K0 * (x + GELU_K1 * x * x * x);
    float s, q;
    sigmoid_pair(2.f * u, s, q);
    const float du = GELU_K0 * (1.f + 3.f * GELU_K1 * x * x);
    return s + 2.f * x * s * q * du;
}

__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * INV_SQRT2)); }

__device__ __forceinline__ float gelu_erf_grad(float x) {
    return 0.5f * (1.f + erff(x * INV_SQRT2)) + x * INV_SQRT_2PI * exp_fast(-0.5f * x * x);
}

__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.f + exp_fast(fminf(-x, 80.f))); }

// d/dx [x s(x)] = s (1 + x (1 - s))
__device__ __forceinline__ float silu_grad(float x) {
    float s, q;
    sigmoid_pair(x, s, q);
    return s * (1.f + x * q);
}

// QuickGELU (OpenAI CLIP): x sigmoid(1.702 x).
#define QGELU_K 1.702f
__device__ __forceinline__ float quick_gelu(float x) {
    return __fdividef(x, 1.f + exp_fast(fminf(-QGELU_K * x, 80.f)));
}

// d/dx [x s(kx)] = s (1 + k x (1 - s))
__device__ __forceinline__ float quick_gelu_grad(float x) {
    float s, q;
    sigmoid_pair(QGELU_K * x, s, q);
    return s * (1.f + QGELU_K * x * q);
}

#endif  // FLAME_ACTIVATIONS_CUH
