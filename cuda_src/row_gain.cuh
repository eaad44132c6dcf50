// The per-column gain of the norm kernels (add_layer_norm.cu, joint_rms_norm.cu): v *= w[c .. c + N) where there is a
// gain (wp null: none), the gain stored in the kernel's T or in fp32 (`f32`, as common.cuh's load_any reads it).
#pragma once
#include "common.cuh"

template <typename T, int N>
__device__ __forceinline__ void mul_gain(const void* __restrict__ wp, i64 c, int f32, float (&v)[N]) {
    if (wp) {
        float w[N];
        load_any<T, N>(wp, c, f32, w);
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] *= w[j];
    }
}
