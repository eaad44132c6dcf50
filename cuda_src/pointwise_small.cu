// Pointwise ops on SMALL contiguous arrays (the per-op host overhead path, flame_core/kernels/pointwise_small.py):
// one thread per element, fp32 math, one rounding to T. Launched through loader.PackedLaunch (arguments packed once),
// so the host cost per op is a dict hit and a driver launch instead of a CuPy ufunc dispatch.
//
// Results equal CuPy's ufuncs: the scalar arrives already rounded to T (as CuPy casts a Python scalar to the array
// dtype) and widened to float; a single +, -, * of two T values in fp32 rounded to T is the correctly rounded T
// result (fp32 has more than 2p+2 bits for fp16/bf16), so float32 is bit-identical and the half types too. The
// backward rules use the expressions of cuda_src/pointwise_grad.cu (same compiler, same contraction).
// Every kernel takes n <= 2^31 - 1 (the host sends at most 65536); grid = ceil(n / block).
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

// out[i] = x[i] OP s
template <typename T, int OP>
__device__ __forceinline__ void pw_scalar_body(const T* __restrict__ x, T* __restrict__ out, float s, int n) {
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
__device__ __forceinline__ void pw_unary_body(const T* __restrict__ x, T* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = from_f32<T>(pw_apply<OP>(to_f32(x[i]), 0.0f));
}

// Written out one by one (not through a macro) so that the loader instantiates them all in one compile per dtype.
template <typename T>
__global__ void pws_mul_scalar(const T* __restrict__ x, T* __restrict__ out, float s, int n) {
    pw_scalar_body<T, PW_MUL>(x, out, s, n);
}
template <typename T>
__global__ void pws_add_scalar(const T* __restrict__ x, T* __restrict__ out, float s, int n) {
    pw_scalar_body<T, PW_ADD>(x, out, s, n);
}
template <typename T>
__global__ void pws_sub_scalar(const T* __restrict__ x, T* __restrict__ out, float s, int n) {
    pw_scalar_body<T, PW_SUB>(x, out, s, n);
}
template <typename T>
__global__ void pws_rsub_scalar(const T* __restrict__ x, T* __restrict__ out, float s, int n) {
    pw_scalar_body<T, PW_RSUB>(x, out, s, n);
}

template <typename T>
__global__ void pws_mul(const T* a, const T* b, T* out, int n) { pw_binary_body<T, PW_MUL>(a, b, out, n); }
template <typename T>
__global__ void pws_add(const T* a, const T* b, T* out, int n) { pw_binary_body<T, PW_ADD>(a, b, out, n); }
template <typename T>
__global__ void pws_sub(const T* a, const T* b, T* out, int n) { pw_binary_body<T, PW_SUB>(a, b, out, n); }

template <typename T>
__global__ void pws_neg(const T* __restrict__ x, T* __restrict__ out, int n) { pw_unary_body<T, PW_NEG>(x, out, n); }
template <typename T>
__global__ void pws_tanh(const T* __restrict__ x, T* __restrict__ out, int n) { pw_unary_body<T, PW_TANH>(x, out, n); }

// First-order backward rules, the expressions of cuda_src/pointwise_grad.cu. g: upstream gradient, s: the saved
// tensor (the output y; the input x for abs).
#define PWS_GRAD_BODY(EXPR)                                           \
    int i = blockIdx.x * blockDim.x + threadIdx.x;                    \
    if (i < n) {                                                      \
        float gv = to_f32(g[i]), v = to_f32(s[i]);                    \
        out[i] = from_f32<T>(EXPR);                                   \
    }

template <typename T>
__global__ void pws_tanh_bwd(const T* __restrict__ g, const T* __restrict__ s, T* __restrict__ out, int n) {
    PWS_GRAD_BODY(gv * (1.0f - v * v))
}
template <typename T>
__global__ void pws_sigmoid_bwd(const T* __restrict__ g, const T* __restrict__ s, T* __restrict__ out, int n) {
    PWS_GRAD_BODY(gv * v * (1.0f - v))
}
template <typename T>
__global__ void pws_relu_bwd(const T* __restrict__ g, const T* __restrict__ s, T* __restrict__ out, int n) {
    PWS_GRAD_BODY(v > 0.0f ? gv : 0.0f)
}
template <typename T>
__global__ void pws_sqrt_bwd(const T* __restrict__ g, const T* __restrict__ s, T* __restrict__ out, int n) {
    PWS_GRAD_BODY(gv * 0.5f / v)
}
template <typename T>
__global__ void pws_rsqrt_bwd(const T* __restrict__ g, const T* __restrict__ s, T* __restrict__ out, int n) {
    PWS_GRAD_BODY(-0.5f * gv * v * v * v)
}
template <typename T>
__global__ void pws_abs_bwd(const T* __restrict__ g, const T* __restrict__ s, T* __restrict__ out, int n) {
    PWS_GRAD_BODY(v > 0.0f ? gv : (v < 0.0f ? -gv : 0.0f))
}
