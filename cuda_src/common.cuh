// Shared device helpers for the FLAME kernel families: typed scalar conversion, 16-byte vector loads/stores with
// fp32 math, and warp / block reductions. NVRTC-compatible (CUDA headers only); the loader inlines this file.
#ifndef FLAME_COMMON_CUH
#define FLAME_COMMON_CUH
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
#define FLAME_NEG_INF __int_as_float(0xff800000)
// Row kernels cache at most this many 16-byte vectors per thread in registers; wider rows take the looping path.
#define MAX_VPT 4

// ---------------------------------------------------------------------------------------------- scalar conversion
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(double v) { return (float)v; }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ double from_f32<double>(float v) { return (double)v; }

// ---------------------------------------------------------------------------------------------- 16-byte vectors
// VecT<T>::N elements of T fill 16 bytes: 4 floats or 8 halves / bfloat16s.
template <typename T> struct VecT { static constexpr int N = 16 / sizeof(T); };

// Loads N contiguous T at p into fp32 registers. When N * sizeof(T) is a multiple of 16 the caller guarantees 16-byte
// alignment and the load is done in 16-byte pieces.
template <typename T, int N>
__device__ __forceinline__ void load_f32(const T* __restrict__ p, float (&v)[N]) {
    if constexpr ((N * sizeof(T)) % 16 == 0) {
        constexpr int K = 16 / sizeof(T);
#pragma unroll
        for (int c = 0; c < N / K; ++c) {
            union { uint4 q; T t[K]; } u;
            u.q = *reinterpret_cast<const uint4*>(p + c * K);
#pragma unroll
            for (int j = 0; j < K; ++j) v[c * K + j] = to_f32(u.t[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = to_f32(p[j]);
    }
}

template <typename T, int N>
__device__ __forceinline__ void store_f32(T* __restrict__ p, const float (&v)[N]) {
    if constexpr ((N * sizeof(T)) % 16 == 0) {
        constexpr int K = 16 / sizeof(T);
#pragma unroll
        for (int c = 0; c < N / K; ++c) {
            union { uint4 q; T t[K]; } u;
#pragma unroll
            for (int j = 0; j < K; ++j) u.t[j] = from_f32<T>(v[c * K + j]);
            *reinterpret_cast<uint4*>(p + c * K) = u.q;
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) p[j] = from_f32<T>(v[j]);
    }
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Small broadcast operands (weights, shift/scale/gate) are either the kernel's T or fp32: `f32` picks at run time.
template <typename T, int N>
__device__ __forceinline__ void load_any(const void* __restrict__ p, i64 i, int f32, float (&v)[N]) {
    if (f32)
        load_f32<float, N>(static_cast<const float*>(p) + i, v);
    else
        load_f32<T, N>(static_cast<const T*>(p) + i, v);
}

template <typename T>
__device__ __forceinline__ float load_any1(const void* __restrict__ p, i64 i, int f32) {
    return f32 ? static_cast<const float*>(p)[i] : to_f32(static_cast<const T*>(p)[i]);
}

// Grid-stride elementwise maps over n elements with 16-byte vectors when every pointer is aligned; the tail
// (n % N elements) is done by scalar code.  f(float...) -> float.
template <typename T, typename F>
__device__ __forceinline__ void map1(const T* __restrict__ a, T* __restrict__ out, i64 n, F f) {
    constexpr int N = VecT<T>::N;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    i64 done = 0;
    if (aligned16(a) && aligned16(out)) {
        const i64 nv = n / N;
        for (i64 k = tid; k < nv; k += stride) {
            float v[N];
            load_f32<T, N>(a + k * N, v);
#pragma unroll
            for (int j = 0; j < N; ++j) v[j] = f(v[j]);
            store_f32<T, N>(out + k * N, v);
        }
        done = nv * N;
    }
    for (i64 i = done + tid; i < n; i += stride) out[i] = from_f32<T>(f(to_f32(a[i])));
}

template <typename T, typename F>
__device__ __forceinline__ void map2(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, i64 n,
                                     F f) {
    constexpr int N = VecT<T>::N;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    i64 done = 0;
    if (aligned16(a) && aligned16(b) && aligned16(out)) {
        const i64 nv = n / N;
        for (i64 k = tid; k < nv; k += stride) {
            float u[N], v[N];
            load_f32<T, N>(a + k * N, u);
            load_f32<T, N>(b + k * N, v);
#pragma unroll
            for (int j = 0; j < N; ++j) v[j] = f(u[j], v[j]);
            store_f32<T, N>(out + k * N, v);
        }
        done = nv * N;
    }
    for (i64 i = done + tid; i < n; i += stride) out[i] = from_f32<T>(f(to_f32(a[i]), to_f32(b[i])));
}

// Raw 16-byte vectors <-> fp32 registers (the caller guarantees 16-byte alignment of p).
template <typename T>
__device__ __forceinline__ uint4 load_raw16(const T* __restrict__ p) {
    return *reinterpret_cast<const uint4*>(p);
}

template <typename T>
__device__ __forceinline__ void unpack_f32(const uint4& q, float (&v)[VecT<T>::N]) {
    constexpr int N = VecT<T>::N;
    union { uint4 q; T t[N]; } u;
    u.q = q;
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = to_f32(u.t[j]);
}

template <typename T>
__device__ __forceinline__ uint4 pack_f32(const float (&v)[VecT<T>::N]) {
    constexpr int N = VecT<T>::N;
    union { uint4 q; T t[N]; } u;
#pragma unroll
    for (int j = 0; j < N; ++j) u.t[j] = from_f32<T>(v[j]);
    return u.q;
}

// map1 / map2 with U 16-byte vectors per thread and step, all loads issued before the first use (more bytes in flight
// per thread than map1 / map2). Step s of block b covers vectors [(s * gridDim.x + b) * blockDim.x * U, + blockDim.x *
// U), thread t the vectors t, t + blockDim.x, ... of it (coalesced). Size the grid to cdiv(n / N, blockDim.x * U) blocks
// or fewer (the loop strides over the rest). Same results as map1 / map2.
template <typename T, int U, typename F>
__device__ __forceinline__ void map1_unrolled(const T* __restrict__ a, T* __restrict__ out, i64 n, F f) {
    constexpr int N = VecT<T>::N;
    const i64 bdim = blockDim.x;
    i64 done = 0;
    if (aligned16(a) && aligned16(out)) {
        const i64 nv = n / N, step = (i64)gridDim.x * bdim * U;
        for (i64 base = (i64)blockIdx.x * bdim * U + threadIdx.x; base < nv; base += step) {
            uint4 q[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (base + u * bdim < nv) q[u] = load_raw16(a + (base + u * bdim) * N);
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (base + u * bdim < nv) {
                    float v[N];
                    unpack_f32<T>(q[u], v);
#pragma unroll
                    for (int j = 0; j < N; ++j) v[j] = f(v[j]);
                    *reinterpret_cast<uint4*>(out + (base + u * bdim) * N) = pack_f32<T>(v);
                }
        }
        done = nv * N;
    }
    const i64 tid = (i64)blockIdx.x * bdim + threadIdx.x, stride = (i64)gridDim.x * bdim;
    for (i64 i = done + tid; i < n; i += stride) out[i] = from_f32<T>(f(to_f32(a[i])));
}

template <typename T, int U, typename F>
__device__ __forceinline__ void map2_unrolled(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                              i64 n, F f) {
    constexpr int N = VecT<T>::N;
    const i64 bdim = blockDim.x;
    i64 done = 0;
    if (aligned16(a) && aligned16(b) && aligned16(out)) {
        const i64 nv = n / N, step = (i64)gridDim.x * bdim * U;
        for (i64 base = (i64)blockIdx.x * bdim * U + threadIdx.x; base < nv; base += step) {
            uint4 qa[U], qb[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (base + u * bdim < nv) {
                    qa[u] = load_raw16(a + (base + u * bdim) * N);
                    qb[u] = load_raw16(b + (base + u * bdim) * N);
                }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (base + u * bdim < nv) {
                    float va[N], vb[N];
                    unpack_f32<T>(qa[u], va);
                    unpack_f32<T>(qb[u], vb);
#pragma unroll
                    for (int j = 0; j < N; ++j) vb[j] = f(va[j], vb[j]);
                    *reinterpret_cast<uint4*>(out + (base + u * bdim) * N) = pack_f32<T>(vb);
                }
        }
        done = nv * N;
    }
    const i64 tid = (i64)blockIdx.x * bdim + threadIdx.x, stride = (i64)gridDim.x * bdim;
    for (i64 i = done + tid; i < n; i += stride) out[i] = from_f32<T>(f(to_f32(a[i]), to_f32(b[i])));
}

// ---------------------------------------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum / max over the whole block (any multiple of 32 threads up to 1024). `smem` holds 32 floats; every thread
// gets the result. Safe to call back to back: the leading barrier protects `smem` from the previous call's readers.
__device__ __forceinline__ float block_sum(float v, float* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = lane < nwarps ? smem[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = lane < nwarps ? smem[lane] : FLAME_NEG_INF;
    return warp_max(v);
}

// Reduction over a group of `tpr` threads that share one row: a power of two <= 32 (shuffles within aligned lane
// groups; the whole warp must call) or the whole block (tpr == blockDim.x).
__device__ __forceinline__ float group_sum(float v, int tpr, float* smem) {
    if (tpr <= 32) {
        for (int o = tpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    }
    return block_sum(v, smem);
}

__device__ __forceinline__ float group_max(float v, int tpr, float* smem) {
    if (tpr <= 32) {
        for (int o = tpr >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        return v;
    }
    return block_max(v, smem);
}

// Deterministic column sums: out[c] = sum_p part[p * cols + c] (fp32), cast to T. Block (32, 32),
// grid (cdiv(cols, 32), batches): batch y reads part + y * parts * cols and writes out + y * cols.
template <typename T>
__device__ __forceinline__ void column_sum_body(const float* __restrict__ part, T* __restrict__ out, int parts,
                                                int cols) {
    __shared__ float tile[32][33];
    part += (i64)blockIdx.y * parts * cols;
    out += (i64)blockIdx.y * cols;
    const int c = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.f;
    if (c < cols)
        for (int p = threadIdx.y; p < parts; p += 32) acc += part[(i64)p * cols + c];
    tile[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0) {
        float s = 0.f;
#pragma unroll 8
        for (int k = 0; k < 32; ++k) s += tile[k][threadIdx.x];
        if (c < cols) out[c] = from_f32<T>(s);
    }
}

#endif  // FLAME_COMMON_CUH
