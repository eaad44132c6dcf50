// Per-row fp8 (e4m3, max 448) quantization: scale[r] = amax(|x[r, :]|) / 448 (1 for an all-zero row),
// q = e4m3(x * (448 / amax)) with round-to-nearest-even and saturation; dequantization y = float(q) * scale[r].
// q is stored as raw bytes (float8_e4m3fn bit patterns). Rows go to groups of `tpr` threads (as in the norms);
// 8 elements per thread-step when the row width and addresses allow (16-byte loads of x, 8-byte stores of q).
#include "common.cuh"
#include <cuda_fp8.h>

#define FP8_MAX 448.f

__device__ __forceinline__ unsigned char f32_to_e4m3(float v) {
    return (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float e4m3_to_f32(unsigned char b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

template <typename T, int N>
__device__ __forceinline__ void quantize_row(const T* __restrict__ xr, unsigned char* __restrict__ qr, float* scale,
                                             bool valid, int cols, int lane, int tpr, float* smem) {
    const int nv = cols / N;
    float amax = 0.f;
    if (valid)
        for (int k = lane; k < nv; k += tpr) {
            float v[N];
            load_f32<T, N>(xr + (i64)k * N, v);
#pragma unroll
            for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(v[j]));
        }
    amax = group_max(amax, tpr, smem);
    if (!valid) return;  // after the last collective
    const float inv = amax > 0.f ? FP8_MAX / amax : 1.f;
    for (int k = lane; k < nv; k += tpr) {
        float v[N];
        load_f32<T, N>(xr + (i64)k * N, v);
        if constexpr (N == 8) {
            union { uint2 u; unsigned char b[8]; } o;
#pragma unroll
            for (int j = 0; j < 8; ++j) o.b[j] = f32_to_e4m3(v[j] * inv);
            *reinterpret_cast<uint2*>(qr + (i64)k * 8) = o.u;
        } else {
#pragma unroll
            for (int j = 0; j < N; ++j) qr[(i64)k * N + j] = f32_to_e4m3(v[j] * inv);
        }
    }
    if (lane == 0) *scale = amax > 0.f ? amax / FP8_MAX : 1.f;
}

template <typename T>
__global__ void fp8_quantize_rows(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales,
                                  i64 rows, int cols, int tpr) {
    __shared__ float smem[32];
    const int lane = threadIdx.x % tpr;
    const i64 row = (i64)blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    const bool valid = row < rows;
    const i64 r = valid ? row : 0;
    if (cols % 8 == 0 && aligned16(x) && aligned16(q))
        quantize_row<T, 8>(x + r * cols, q + r * cols, scales + r, valid, cols, lane, tpr, smem);
    else
        quantize_row<T, 1>(x + r * cols, q + r * cols, scales + r, valid, cols, lane, tpr, smem);
}

// Grid-stride over groups of 8 elements (cols % 8 == 0 and aligned) or single elements.
template <typename T>
__global__ void fp8_dequantize_rows(const unsigned char* __restrict__ q, const float* __restrict__ scales,
                                    T* __restrict__ y, i64 total, int cols) {
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    if (cols % 8 == 0 && aligned16(q) && aligned16(y)) {
        for (i64 k = tid; k < total / 8; k += stride) {
            union { uint2 u; unsigned char b[8]; } in;
            in.u = *reinterpret_cast<const uint2*>(q + k * 8);
            const float s = scales[k * 8 / cols];
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = e4m3_to_f32(in.b[j]) * s;
            store_f32<T, 8>(y + k * 8, v);
        }
    } else {
        for (i64 i = tid; i < total; i += stride) y[i] = from_f32<T>(e4m3_to_f32(q[i]) * scales[i / cols]);
    }
}
