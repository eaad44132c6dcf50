// Fused backward rules of unary pointwise ops: one launch instead of the 2-4 a composed rule costs. fp32 math.
// g: upstream gradient, s: the saved tensor (the op's output y, or its input x for abs), out: the input gradient; `out`
// may be `g` (a backward writing into the gradient it was handed alone), so no __restrict__ on them.
#include "common.cuh"

#define FLAME_POINTWISE_GRAD(NAME, EXPR)                                                                     \
    template <typename T>                                                                                    \
    __global__ void NAME(const T* g, const T* __restrict__ s, T* out, i64 n) {                               \
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) { \
            float gv = to_f32(g[i]), v = to_f32(s[i]);                                                       \
            out[i] = from_f32<T>(EXPR);                                                                      \
        }                                                                                                    \
    }

FLAME_POINTWISE_GRAD(tanh_bwd, gv * (1.0f - v * v))             // s = y = tanh(x)
FLAME_POINTWISE_GRAD(sigmoid_bwd, gv * v * (1.0f - v))          // s = y = sigmoid(x)
FLAME_POINTWISE_GRAD(relu_bwd, v > 0.0f ? gv : 0.0f)            // s = y = relu(x)
FLAME_POINTWISE_GRAD(sqrt_bwd, gv * 0.5f / v)                   // s = y = sqrt(x)
FLAME_POINTWISE_GRAD(rsqrt_bwd, -0.5f * gv * v * v * v)         // s = y = rsqrt(x)
FLAME_POINTWISE_GRAD(abs_bwd, v > 0.0f ? gv : (v < 0.0f ? -gv : 0.0f))  // s = x
