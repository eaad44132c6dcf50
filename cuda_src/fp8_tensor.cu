// Per-tensor fp8 (e4m3, max 448) quantisation for the fp8 GEMM, with "current" scaling (the amax of this call), in
// ONE launch, and the weight's byte transpose:
//   fp8_quantize_tensor  pass 1: amax(|x|) over the whole tensor (a block reduction, then atomicMax on the float bits,
//                        which orders non-negative floats); a grid-wide barrier; pass 2: q = e4m3(x * 448 / amax),
//                        round-to-nearest-even, saturating to +-448 (as fp8_quantize_rows). Block 0 writes
//                        scale[0] = amax / 448 (1 when amax is 0 or not finite) -- the dequantisation factor cuBLASLt
//                        reads through its A/B scale pointer -- and scale[1] = 448 / amax, the factor the cast used.
//                        Why one launch: the two-kernel version (amax, then cast) also needed its counters zeroed per
//                        call (a memset): three launches and two full reads of x per GEMM operand. Pass 2 walks x
//                        backwards, so it starts on the lines pass 1 left in L2 last (an activation up to ~40 MB is
//                        read from HBM once). No host synchronisation: a CUDA graph captures it.
//   fp8_transpose        (rows, cols) bytes -> (cols, rows): the weight's K-major copy for the input gradient
//                        (Hopper's fp8 tensor cores take both operands K-major only).
//
// The barrier's counters live in module memory (g_fp8_state: zero at load, every launch leaves them zero again), so
// nothing is allocated or zeroed per call. Its conditions: all blocks resident at once (the host caps the grid at 4
// blocks of 256 threads per SM, __launch_bounds__ keeps the registers under that occupancy's share) and one launch at a
// time per device (FLAME quantises on the compute stream only).
#include "common.cuh"
#include <cuda_fp8.h>

#define FP8_MAX 448.f

// {amax bits, blocks arrived, barrier generation, blocks done}
__device__ unsigned int g_fp8_state[4];

__device__ __forceinline__ unsigned char e4m3_sat(float v) {
    return (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ bool finite_positive(float a) { return a > 0.f && a < __int_as_float(0x7f800000); }

template <typename T>
__global__ void __launch_bounds__(256, 4)
fp8_quantize_tensor(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scale, i64 n) {
    __shared__ float smem[32];
    __shared__ float s_inv;
    unsigned int* state = g_fp8_state;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const bool vec = aligned16(x) && aligned16(q);
    constexpr int N = 8;   // 8 elements: 16 bytes of bf16 / fp16 in, 8 bytes of e4m3 out (fp32: two 16-byte loads)
    const i64 nv = vec ? n / N : 0;
    float amax = 0.f;
    for (i64 k = tid; k < nv; k += stride) {
        float v[N];
        load_f32<T, N>(x + k * N, v);
#pragma unroll
        for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
    for (i64 i = nv * N + tid; i < n; i += stride) amax = fmaxf(amax, fabsf(to_f32(x[i])));
    amax = block_max(amax, smem);

    // grid barrier: the last block to arrive publishes the scale and opens the next generation
    if (threadIdx.x == 0) {
        volatile unsigned int* gen = state + 2;
        const unsigned int g = *gen;
        atomicMax(state, __float_as_uint(amax));
        __threadfence();  // the max is visible before this block counts as arrived
        if (atomicAdd(state + 1, 1u) == gridDim.x - 1) {
            atomicExch(state + 1, 0u);
            const float a = __uint_as_float(atomicAdd(state, 0u));  // an atomic read: past the other blocks' fences
            scale[0] = finite_positive(a) ? a / FP8_MAX : 1.f;
            scale[1] = finite_positive(a) ? FP8_MAX / a : 1.f;
            __threadfence();
            atomicAdd(state + 2, 1u);
        } else {
            while (*gen == g) __nanosleep(64);
            __threadfence();
        }
        const float a = __uint_as_float(atomicAdd(state, 0u));
        s_inv = finite_positive(a) ? FP8_MAX / a : 1.f;  // the same fp32 division as scale[1]: the same bits
    }
    __syncthreads();
    const float inv = s_inv;
    for (i64 k = nv - 1 - tid; k >= 0; k -= stride) {   // backwards: L2 still holds the end of pass 1
        float v[N];
        load_f32<T, N>(x + k * N, v);
        union { uint2 u; unsigned char b[N]; } o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.b[j] = e4m3_sat(v[j] * inv);
        *reinterpret_cast<uint2*>(q + k * N) = o.u;
    }
    for (i64 i = nv * N + tid; i < n; i += stride) q[i] = e4m3_sat(to_f32(x[i]) * inv);

    // every block has read the amax once all have counted here: the last one leaves the state zero for the next call
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(state + 3, 1u) == gridDim.x - 1) {
            atomicExch(state, 0u);
            atomicExch(state + 3, 0u);
        }
    }
}
// 32x32 byte tiles through shared memory (a padded row avoids bank conflicts on the transposed read); block (32, 8).
extern "C" __global__ void fp8_transpose(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                         i64 rows, i64 cols) {
    __shared__ unsigned char tile[32][33];
    const i64 c0 = (i64)blockIdx.x * 32, r0 = (i64)blockIdx.y * 32;
    for (int k = threadIdx.y; k < 32; k += 8) {
        const i64 r = r0 + k, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[k][threadIdx.x] = src[r * cols + c];
    }
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += 8) {
        const i64 c = c0 + k, r = r0 + threadIdx.x;  // dst row c, column r
        if (c < cols && r < rows) dst[c * rows + r] = tile[threadIdx.x][k];
    }
}
