// Pointwise ops on SMALL contiguous arrays (the per-op host overhead path, flame_core/kernels/pointwise_small.py):
// one thread per element, fp32 math, one rounding to T. Launched through launching.PackedLaunch (arguments packed
// once), so the host cost per op is a dict hit and a driver launch instead of a CuPy ufunc dispatch.
//
// A single +, -, * of two T values in fp32 rounded to T is the correctly rounded T result (fp32 has more than 2p+2
// bits for fp16/bf16): float32 is bit-identical to CuPy's ufuncs. A Python scalar arrives as float32 (PyTorch's
// arithmetic for a half-precision tensor and a scalar). The small-array backward rules are cuda_src/pointwise_grad.cu's
// own kernels. Every kernel takes n <= 2^31 - 1 (the host sends at most 65536); grid = ceil(n / block).
#include "common.cuh"

enum PwOp { PW_MUL, PW_ADD, PW_SUB, PW_RSUB, PW_NEG, PW_TANH };

template <int OP>
__device__ __forceinline__ float pw_apply(float a, float b) {
    if constexpr (OP == PW_MUL) return a * b;
    else if constexpr (OP == PW_ADD) return a + b;
    else if constexpr (OP == PW_SUB) return a - b;
    else if constexpr (OP == PW_RSUB) return b - a;
    else if constexpr (OP == PW_NEG) return -a;
    else return tanhf(a);
}

// out[i] = x[i] OP s; `out` may be `x` (a backward rule writing into the gradient it was handed), so no __restrict__
template <typename T, int OP>
__device__ __forceinline__ void pw_scalar_body(const T* x, T* out, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = from_f32<T>(pw_apply<OP>(to_f32(x[i]), s));
}

// out[i] = a[i] OP b[i]; `out` may be `a` (in-place accumulation), so no __restrict__ on the operands
template <typename T, int OP>
__device__ __forceinline__ void pw_binary_body(const T* a, const T* b, T* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = from_f32<T>(pw_apply<OP>(to_f32(a[i]), to_f32(b[i])));
}

template <typename T, int OP>
__device__ __forceinline__ void pw_unary_body(const T* x, T* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = from_f32<T>(pw_apply<OP>(to_f32(x[i]), 0.0f));
}

// Written out one by one (not through a macro) so that the loader instantiates them all in one compile per dtype.
template <typename T>
__global__ void pws_mul_scalar(const T* x, T* out, float s, int n) {
    pw_scalar_body<T, PW_MUL>(x, out, s, n);
}
template <typename T>
__global__ void pws_add_scalar(const T* x, T* out, float s, int n) {
    pw_scalar_body<T, PW_ADD>(x, out, s, n);
}
template <typename T>
__global__ void pws_sub_scalar(const T* x, T* out, float s, int n) {
    pw_scalar_body<T, PW_SUB>(x, out, s, n);
}
template <typename T>
__global__ void pws_rsub_scalar(const T* x, T* out, float s, int n) {
    pw_scalar_body<T, PW_RSUB>(x, out, s, n);
}

template <typename T>
__global__ void pws_mul(const T* a, const T* b, T* out, int n) { pw_binary_body<T, PW_MUL>(a, b, out, n); }
template <typename T>
__global__ void pws_add(const T* a, const T* b, T* out, int n) { pw_binary_body<T, PW_ADD>(a, b, out, n); }
template <typename T>
__global__ void pws_sub(const T* a, const T* b, T* out, int n) { pw_binary_body<T, PW_SUB>(a, b, out, n); }

template <typename T>
__global__ void pws_neg(const T* x, T* out, int n) { pw_unary_body<T, PW_NEG>(x, out, n); }
template <typename T>
__global__ void pws_tanh(const T* x, T* out, int n) { pw_unary_body<T, PW_TANH>(x, out, n); }

// clamp (min then max, as np.maximum / np.minimum: a NaN in x or a bound propagates, equal values give the bound --
// so -0 clamped at +0 is +0 --; lo = -inf / hi = +inf for a missing bound); the bounds arrive already rounded to T
// (the comparisons of a T tensor with its bounds in T). A NaN comes out as CUDA's canonical NaN.
template <typename T>
__global__ void pws_clamp(const T* x, T* out, float lo, float hi, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = to_f32(x[i]);
        v = (v > lo || v != v) ? v : lo;
        v = (v < hi || v != v) ? v : hi;
        out[i] = from_f32<T>(v);
    }
}

// clamp's backward: g times the mask lo <= x <= hi (as g * mask.to(T): 0 * inf or 0 * NaN stays NaN, -0 for g < 0)
template <typename T>
__global__ void pws_clamp_bwd(const T* g, const T* x, T* out, float lo, float hi, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = to_f32(x[i]);
        out[i] = from_f32<T>(to_f32(g[i]) * ((v >= lo && v <= hi) ? 1.0f : 0.0f));
    }
}
