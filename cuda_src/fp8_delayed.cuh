// Delayed fp8 (e4m3) scaling, shared by the kernels that cast to fp8 with a site's factor (fp8_tensor.cu's
// fp8_quantize_delayed / _parts_delayed, fp8_gelu.cu's GELU-fused casts): the e4m3 cast and the end of a launch that
// folds its amax into the site's history. state: float[3 + H] = {dequantisation scale, cast factor, this call's amax
// bits (0 between calls), history of amaxes, newest first} (flame_core/kernels/fp8_tensor.py, DelayedScaling).
#ifndef FLAME_FP8_DELAYED_CUH
#define FLAME_FP8_DELAYED_CUH
#include "common.cuh"
#include <cuda_fp8.h>

#define FP8_MAX 448.f

__device__ __forceinline__ unsigned char e4m3_sat(float v) {
    return (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ bool finite_positive(float a) { return a > 0.f && a < __int_as_float(0x7f800000); }

// Blocks of the running delayed launch that have folded their amax in; the last one leaves it 0 again. One counter
// per module: one delayed launch at a time per module and device (FLAME quantises on the compute stream only).
__device__ unsigned int g_fp8_delayed[1];

// The end of a delayed-scaling launch, thread 0 of each block with its block's amax: block 0 hands out the pair this
// call used, every block folds its amax in, and the last block moves the site's history and sets the next pair.
__device__ __forceinline__ void fp8_delayed_fold(float* state, float* __restrict__ scale_out, int hist, float amax,
                                                 float inv) {
    if (blockIdx.x == 0) {
        scale_out[0] = state[0];
        scale_out[1] = inv;
    }
    atomicMax(reinterpret_cast<unsigned int*>(state + 2), __float_as_uint(amax));
    __threadfence();
    if (atomicAdd(g_fp8_delayed, 1u) == gridDim.x - 1) {
        atomicExch(g_fp8_delayed, 0u);
        __threadfence();
        float a = __uint_as_float(atomicExch(reinterpret_cast<unsigned int*>(state + 2), 0u));
        if (!(a >= 0.f && a < __int_as_float(0x7f800000))) a = 0.f;
        float* h = state + 3;
        float m = a;
        for (int i = hist - 1; i > 0; --i) {
            h[i] = h[i - 1];
            m = fmaxf(m, h[i]);
        }
        h[0] = a;
        state[0] = finite_positive(m) ? m / FP8_MAX : 1.f;
        state[1] = finite_positive(m) ? FP8_MAX / m : 1.f;
    }
}

// Every thread at the end of a delayed launch. update = 0 (a fixed pair: a checkpointed region's recompute reuses its
// forward's): the pair handed out, no history. Else the block's amax, and fp8_delayed_fold.
__device__ __forceinline__ void fp8_delayed_end(float* state, float* __restrict__ scale_out, int hist, float amax,
                                                float inv, int update, float* smem) {
    if (!update) {
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            scale_out[0] = state[0];
            scale_out[1] = inv;
        }
        return;
    }
    amax = block_max(amax, smem);
    if (threadIdx.x == 0) fp8_delayed_fold(state, scale_out, hist, amax, inv);
}

#endif
