// float8_e4m3fn storage on the GPU: CuPy has no fp8 dtype, so FLAME keeps the raw bytes in uint8 arrays and converts
// with these kernels: round to nearest even; out-of-range values become NaN (e4m3fn has no inf), as ml_dtypes and
// torch's .to(torch.float8_e4m3fn) do.
#include <cuda_fp8.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T>
__device__ __forceinline__ float to_f32(T v) { return (float)v; }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v) { return (T)v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void to_fp8_e4m3(const T* __restrict__ x, unsigned char* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = (unsigned char)__nv_cvt_float_to_fp8(to_f32<T>(x[i]), __NV_NOSAT, __NV_E4M3);
}

template <typename T>
__global__ void from_fp8_e4m3(const unsigned char* __restrict__ q, T* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q[i], __NV_E4M3);
        out[i] = from_f32<T>(__half2float(__half(h)));
    }
}
