// Rotary embedding of N consecutive values (N even) held by one thread: N / 2 adjacent pairs (v[2p], v[2p + 1]), each
// by its 2x2 matrix at f + 4 p (fp32, row-major [[f0, f1], [f2, f3]]; Flux's [[cos, -sin], [sin, cos]]):
//   o[2p] = f0 v[2p] + f1 v[2p + 1],  o[2p + 1] = f2 v[2p] + f3 v[2p + 1]      (transpose: the transposed matrices,
// the backward's rotation). rope.cu (RoPE alone) and joint_rms_norm.cu (RoPE applied to the normalised rows, and to
// the incoming gradient of its backward) share it.
#pragma once
#include "common.cuh"

template <int N>
__device__ __forceinline__ void rope_pairs(const float* __restrict__ f, const float (&v)[N], float (&o)[N],
                                           int transpose) {
    static_assert(N % 2 == 0, "rope_pairs rotates whole pairs");
#pragma unroll
    for (int p = 0; p < N / 2; ++p) {
        float m[4];
        load_f32<float, 4>(f + p * 4, m);
        const float x0 = v[2 * p], x1 = v[2 * p + 1];
        if (transpose) {
            o[2 * p] = m[0] * x0 + m[2] * x1;
            o[2 * p + 1] = m[1] * x0 + m[3] * x1;
        } else {
            o[2 * p] = m[0] * x0 + m[1] * x1;
            o[2 * p + 1] = m[2] * x0 + m[3] * x1;
        }
    }
}
