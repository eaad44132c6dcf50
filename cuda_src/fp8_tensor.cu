// Per-tensor fp8 (e4m3, max 448) quantisation for the fp8 GEMM, with "current" scaling (the amax of this call):
//   fp8_amax_scale   amax(|x|) over the whole tensor into state[0] (float bits; atomicMax on the bits orders
//                    non-negative floats), then the last block to finish writes scale[0] = amax / 448 (1 when amax
//                    is 0) -- the dequantisation factor cuBLASLt reads through its A/B scale pointer -- and
//                    scale[1] = 448 / amax, the factor the cast multiplies by. No host synchronisation: the scale stays
//                    on the device, so a CUDA graph can capture the pair.
//   fp8_cast_scaled  q = e4m3(x * scale[1]), round-to-nearest-even, saturating to +-448 (as fp8_quantize_rows).
//   fp8_transpose    (rows, cols) bytes -> (cols, rows): the weight's K-major copy for the input gradient
//                    (Hopper's fp8 tensor cores take both operands K-major only).
// state = {amax bits, blocks done}, zeroed by the caller before fp8_amax_scale.
#include "common.cuh"
#include <cuda_fp8.h>

#define FP8_MAX 448.f

template <typename T>
__global__ void fp8_amax_scale(const T* __restrict__ x, i64 n, unsigned int* state, float* scale) {
    __shared__ float smem[32];
    __shared__ bool last;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    float amax = 0.f;
    if (aligned16(x)) {
        constexpr int N = VecT<T>::N;
        for (i64 k = tid; k < n / N; k += stride) {
            float v[N];
            load_f32<T, N>(x + k * N, v);
#pragma unroll
            for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(v[j]));
        }
        for (i64 i = n / N * N + tid; i < n; i += stride) amax = fmaxf(amax, fabsf(to_f32(x[i])));
    } else {
        for (i64 i = tid; i < n; i += stride) amax = fmaxf(amax, fabsf(to_f32(x[i])));
    }
    amax = block_max(amax, smem);
    if (threadIdx.x == 0) {
        atomicMax(state, __float_as_uint(amax));
        __threadfence();  // the max is visible before this block counts as done
        last = atomicAdd(state + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
        const float a = __uint_as_float(atomicAdd(state, 0u));  // an atomic read: past the other blocks' fences
        const bool safe = a > 0.f && a < __int_as_float(0x7f800000);  // finite and not NaN
        scale[0] = safe ? a / FP8_MAX : 1.f;
        scale[1] = safe ? FP8_MAX / a : 1.f;
    }
}

__device__ __forceinline__ unsigned char e4m3_sat(float v) {
    return (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

template <typename T>
__global__ void fp8_cast_scaled(const T* __restrict__ x, unsigned char* __restrict__ q, const float* __restrict__ scale,
                                i64 n) {
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const float inv = scale[1];
    if (aligned16(x) && aligned16(q)) {
        for (i64 k = tid; k < n / 8; k += stride) {
            float v[8];
            load_f32<T, 8>(x + k * 8, v);
            union { uint2 u; unsigned char b[8]; } o;
#pragma unroll
            for (int j = 0; j < 8; ++j) o.b[j] = e4m3_sat(v[j] * inv);
            *reinterpret_cast<uint2*>(q + k * 8) = o.u;
        }
        for (i64 i = n / 8 * 8 + tid; i < n; i += stride) q[i] = e4m3_sat(to_f32(x[i]) * inv);
    } else {
        for (i64 i = tid; i < n; i += stride) q[i] = e4m3_sat(to_f32(x[i]) * inv);
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
