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

// Two 2-byte values as one 32-bit word (lo in the low half): 4-byte stores of pairs.
template <typename T>
__device__ __forceinline__ unsigned pack2(T lo, T hi) {
    static_assert(sizeof(T) == 2, "pack2: a 2-byte type");
    union { T t[2]; unsigned u; } v;
    v.t[0] = lo, v.t[1] = hi;
    return v.u;
}

// Hides values from the optimiser: raw words are unpacked again in each pass (instead of keeping 2x as many fp32
// registers alive through the reductions), and weight loads stay in the loop (instead of being hoisted out of it and
// held in registers). Emits no instruction.
template <int VPT>
__device__ __forceinline__ void opaque(uint4 (&q)[VPT]) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) asm volatile("" : "+r"(q[i].x), "+r"(q[i].y), "+r"(q[i].z), "+r"(q[i].w));
}

__device__ __forceinline__ const void* opaque_ptr(const void* p) {
    asm volatile("" : "+l"(p));
    return p;
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

// map2 as one step per thread with 8-byte vectors (8 / sizeof(T) elements per access; for 2-byte T: 4), U vectors per
// thread: no loop, no tail, no alignment check. The caller guarantees 8-byte aligned arrays, n a multiple of the
// vector and a grid of cdiv(n / (8 / sizeof(T)), blockDim.x * U) blocks (activations.py: _run does the tail with
// map2_unrolled). Its registers stay at 32 (a tail loop in the kernel raised the GELU backward to 46 and cost ~0.5%).
// Same results as map2 / map2_unrolled.
template <typename T, int U, typename F>
__device__ __forceinline__ void map2_step8(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, i64 n,
                                           F f) {
    constexpr int N = 8 / sizeof(T);
    const i64 bdim = blockDim.x, nv = n / N;
    const i64 base = (i64)blockIdx.x * bdim * U + threadIdx.x;
    uint2 qa[U], qb[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * bdim < nv) {
            qa[u] = *reinterpret_cast<const uint2*>(a + (base + u * bdim) * N);
            qb[u] = *reinterpret_cast<const uint2*>(b + (base + u * bdim) * N);
        }
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * bdim < nv) {
            union { uint2 q; T t[N]; } ua, ub;
            ua.q = qa[u];
            ub.q = qb[u];
#pragma unroll
            for (int j = 0; j < N; ++j) ub.t[j] = from_f32<T>(f(to_f32(ua.t[j]), to_f32(ub.t[j])));
            *reinterpret_cast<uint2*>(out + (base + u * bdim) * N) = ub.q;
        }
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

// Two block sums at once (every thread gets both); scratch: 64 floats. Safe back to back.
__device__ __forceinline__ void block_sum2(float& a, float& b, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = a;
        scratch[32 + warp] = b;
    }
    __syncthreads();
    a = warp_sum(lane < nwarps ? scratch[lane] : 0.f);
    b = warp_sum(lane < nwarps ? scratch[32 + lane] : 0.f);
}

// block_sum2 with one barrier: each warp's two sums go to `buf` (float2 per warp), and every thread adds the warps'
// sums itself, in warp order (the same result in every thread). Not safe back to back on one buffer: callers
// alternate two buffers (a thread writes buffer p again only after a later barrier, which every thread passes once
// it has read buffer p).
__device__ __forceinline__ void block_sum2_1b(float& a, float& b, float2* buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) buf[warp] = make_float2(a, b);
    __syncthreads();
    a = b = 0.f;
    for (int k = 0; k < nwarps; ++k) {
        const float2 v = buf[k];
        a += v.x;
        b += v.y;
    }
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

// ---------------------------------------------------------------------------------------------- L2 loads
// Loads of fp32 rows written by other blocks or by the kernel before (a programmatic dependent launch may start
// before it ends): ld.global.cg (L2, never a stale L1 line).
__device__ __forceinline__ void add4(float (&a)[4], const float4& q) {
    a[0] += q.x;
    a[1] += q.y;
    a[2] += q.z;
    a[3] += q.w;
}

__device__ __forceinline__ float4 ld_cg4(const float* p) {  // __ldcg in PTX (no header dependency under NVRTC)
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

// ---------------------------------------------------------------------------------------------- dependent launches
// Programmatic dependent launch (sm_90; launching.launch_dependent): a kernel launched with programmatic stream
// serialization may start while the kernel before it in the stream still runs, once that kernel has executed
// grid_dependents_launch in every block (or finished); it must call grid_dependency_wait before it reads what the
// earlier kernel wrote (the wait returns when that grid has completed and its memory is visible). Both are no-ops
// for ordinary launches and before sm_90.
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// a[0] (V = float) or a[0..3] (V = float4: columns c .. c + 3) += part[p * cols + c] over the rows p = p0, p0 + step,
// ... < parts, in row order, U loads in flight (ld.global.cg: the rows come from other blocks).
__device__ __forceinline__ float ld_cg_v(const float* p, float) { return ld_cg(p); }
__device__ __forceinline__ float4 ld_cg_v(const float* p, float4) { return ld_cg4(p); }
__device__ __forceinline__ void add_v(float (&a)[4], float v) { a[0] += v; }
__device__ __forceinline__ void add_v(float (&a)[4], const float4& v) { add4(a, v); }

template <int U, typename V>
__device__ __forceinline__ void add_strided_rows(const float* __restrict__ part, int cols, int c, int p0, int step,
                                                 int parts, float (&a)[4]) {
    for (int p = p0; p < parts; p += step * U) {
        V v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (p + step * u < parts) v[u] = ld_cg_v(part + (i64)(p + step * u) * cols + c, V{});
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (p + step * u < parts) add_v(a, v[u]);
    }
}

// The 16-byte form of column_sum_body: block (4, ty), ty a multiple of 8 (<= 256); 16 columns per block, each
// thread 4 of them (float4 loads) over the rows y, y + ty, ...; a warp holds 8 row lanes of the 16 columns and adds
// them by a fixed shuffle tree, then one thread per column adds the warps' sums in order. cols % 4 == 0, part
// 16-byte aligned. Its 4 loads in flight per thread take 16 registers, so more blocks fit per SM than in the scalar
// form (LayerNorm's two batches of 396 part rows in one wave), and the final add is over ty / 8 values, not ty.
template <typename T>
__device__ __forceinline__ void column_sum_vec4(const float* __restrict__ part, T* __restrict__ out, int parts,
                                                int cols, float* red) {
    const int ty = blockDim.y, tid = threadIdx.y * 4 + threadIdx.x;
    const int c = blockIdx.x * 16 + threadIdx.x * 4;
    constexpr int U = 4;
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    if (c < cols) add_strided_rows<U, float4>(part, cols, c, threadIdx.y, ty, parts, a);
    for (int o = 4; o < 32; o <<= 1)  // the warp's 8 row lanes (lane = 4 * (y % 8) + x)
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] += __shfl_xor_sync(0xffffffffu, a[j], o);
    if ((tid & 31) < 4)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[(tid >> 5) * 16 + (tid & 31) * 4 + j] = a[j];
    __syncthreads();
    if (tid < 16 && blockIdx.x * 16 + tid < cols) {
        float s = 0.f;
        for (int w = 0; w < ty / 8; ++w) s += red[w * 16 + tid];
        out[blockIdx.x * 16 + tid] = from_f32<T>(s);
    }
}

// Deterministic column sums: out[c] = sum_p part[p * cols + c] (fp32), cast to T. Block (32, ty <= 32),
// grid (cdiv(cols, 32), batches), or the 16-byte form above: block (4, ty), grid (cdiv(cols, 16), batches).
// Batch y reads part + y * parts * cols and writes out + y * cols.
template <typename T>
__device__ __forceinline__ void column_sum_body(const float* __restrict__ part, T* __restrict__ out, int parts,
                                                int cols) {
    __shared__ float tile[32][33];
    grid_dependency_wait();  // launched as a programmatic dependent of the kernel that wrote `part`
    part += (i64)blockIdx.y * parts * cols;
    out += (i64)blockIdx.y * cols;
    if (blockDim.x == 4) {
        column_sum_vec4<T>(part, out, parts, cols, &tile[0][0]);
        return;
    }
    const int c = blockIdx.x * 32 + threadIdx.x, ty = blockDim.y;
    constexpr int U = 16;  // loads in flight per thread (one round for <= 16 ty rows); the adds keep the row order
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    if (c < cols) add_strided_rows<U, float>(part, cols, c, threadIdx.y, ty, parts, a);
    tile[threadIdx.y][threadIdx.x] = a[0];
    __syncthreads();
    if (threadIdx.y == 0) {
        float s = 0.f;
        for (int k = 0; k < ty; ++k) s += tile[k][threadIdx.x];
        if (c < cols) out[c] = from_f32<T>(s);
    }
}

// ---------------------------------------------------------------------------------------------- single-launch sums
// "Last block done": a kernel whose blocks write fp32 partial rows also sums them, in the block that arrives last at
// a counter (no separate column-sum launch). Every block: write its partials, then last_arrival(counter, expected).
// The one block that sees the count reach `expected` gets true (all the others' partials are visible to it) and
// resets the counter to 0, so the next launch (also a CUDA-graph replay) finds it zeroed. Counters are uint32 in a
// zero-initialised device buffer (flame_core/kernels/loader.py, reduction_counters); launches that may run at once
// must not share them. Every thread of the block must call (it holds two barriers); `flag`: one shared int.
__device__ __forceinline__ bool last_arrival(unsigned* __restrict__ counter, unsigned expected, int* flag) {
    __threadfence();  // this thread's partials are visible GPU-wide before the block is counted
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        const bool last = atomicAdd(counter, 1u) == expected - 1u;
        if (last) {
            atomicExch(counter, 0u);  // every arrival has been counted: ready for the next launch
            __threadfence();
        }
        *flag = last;
    }
    __syncthreads();
    return *flag != 0;
}

// Deterministic column sums of fp32 rows written by other blocks: for each column c in [c0, c1),
// put(c, v, n) receives v[0 .. n) = the sums over i = 0 .. nrows - 1 of part[(row0 + i * rstride) * ld + c + j]
// (n = 4 columns at a time when ld, c0 and c1 - c0 are multiples of 4 and part is 16-byte aligned, else 1).
// Every thread of the block must call (blockDim.x * blockDim.y a multiple of 32: warp shuffles). Narrow column
// ranges also split the rows over `ways` lanes (a power of two) combined by a fixed shuffle tree, so the result
// does not depend on which block sums. Loads bypass L1 (ld.global.cg: the rows come from other SMs) and U of
// them per thread are in flight at once (U 16-byte registers: 4 where the kernel is short of registers).
template <int U = 8, typename F>
__device__ __forceinline__ void sum_rows(const float* __restrict__ part, i64 ld, i64 row0, i64 rstride, int nrows,
                                         int c0, int c1, F put) {
    const int nt = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    const bool v4 = ((ld | (i64)c0 | (i64)(c1 - c0)) & 3) == 0 && aligned16(part);
    const int W = v4 ? 4 : 1, ncv = (c1 - c0) / W;
    int ways = 1;
    while (ways < 32 && ways * 2 * ncv <= nt && ways * 2 <= nrows) ways *= 2;
    for (int base = 0; base < ncv * ways; base += nt) {  // block-uniform trip count: whole warps shuffle below
        const int idx = base + tid, cv = idx / ways, way = idx % ways;
        const bool ok = cv < ncv;
        const int c = c0 + cv * W;
        float a[4] = {0.f, 0.f, 0.f, 0.f};
        if (ok) {
            const float* p = part + row0 * ld + c;
            const i64 step = rstride * ld;
            for (int i = way; i < nrows; i += U * ways) {
                if (v4) {
                    float4 q[U];
#pragma unroll
                    for (int u = 0; u < U; ++u)
                        if (i + u * ways < nrows)
                            q[u] = ld_cg4(p + (i + u * ways) * step);
#pragma unroll
                    for (int u = 0; u < U; ++u)
                        if (i + u * ways < nrows) add4(a, q[u]);
                } else {
                    float q[U];
#pragma unroll
                    for (int u = 0; u < U; ++u)
                        if (i + u * ways < nrows) q[u] = ld_cg(p + (i + u * ways) * step);
#pragma unroll
                    for (int u = 0; u < U; ++u)
                        if (i + u * ways < nrows) a[0] += q[u];
                }
            }
        }
        for (int o = 1; o < ways; o <<= 1)
#pragma unroll
            for (int j = 0; j < 4; ++j) a[j] += __shfl_xor_sync(0xffffffffu, a[j], o);
        if (ok && way == 0) put(c, a, W);
    }
}

// Stores v as element i of an output of the kernel's T (f32 = 0) or fp32 (f32 = 1).
template <typename T>
__device__ __forceinline__ void store_any1(void* __restrict__ p, i64 i, float v, int f32) {
    if (f32)
        static_cast<float*>(p)[i] = v;
    else
        static_cast<T*>(p)[i] = from_f32<T>(v);
}

// ---------------------------------------------------------------------------------------------- clusters (sm_90)
// Thread-block-cluster barriers and distributed shared memory reads (mapa / ld.shared::cluster). Kernels using them
// declare __cluster_dims__ and sit behind the same guard; Python launches them on compute capability >= 9.0 only.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait;" ::: "memory"); }

// The shared-memory address of `p` (this block's shared memory) in the block of cluster rank `rank`.
__device__ __forceinline__ unsigned cluster_addr(const void* p, unsigned rank) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}

// The float at `p` in the block of cluster rank `rank`.
__device__ __forceinline__ float cluster_load(const float* p, unsigned rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}

// The 4 floats at `p` (16-byte aligned) in the block of cluster rank `rank`.
__device__ __forceinline__ float4 cluster_load4(const float* p, unsigned rank) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}

// ---------------------------------------------------------------------------------------------- bulk copies (sm_90)
// One-dimensional bulk asynchronous copies (TMA engine, cp.async.bulk) from global into this block's shared memory,
// completed on an mbarrier (transaction bytes). Source, destination and size: multiples of 16 bytes. A stage's
// mbarrier: mbar_init (one expected arrival: the issuing thread's expect_tx), then per fill mbar_expect_tx + the
// copies, and the consumers wait on the fill's phase parity (0, 1, 0, ... per reuse).
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes mbar_init visible to the async proxy (the bulk copies) before the first copy is issued.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return ok != 0;
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

// Orders this thread's earlier shared-memory accesses (generic proxy) before its later bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// Bulk store from this block's shared memory to global (the issuing thread's current bulk group; same size and
// alignment rules), the group's commit, and the wait until at most N of the thread's committed groups still read shared
// memory (the others' buffers may be written again; before the block exits: N = 0).
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(dst), "r"(smem_u32(src)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// out[i] = f(a[i]) for one CHUNK-byte chunk per block through the bulk-copy engine: the chunk comes into shared memory
// on an mbarrier, each thread maps its 16-byte vectors there in fp32, thread 0 writes the chunk back with a bulk store.
// n: elements, a multiple of 16 bytes' worth; a and out 16-byte aligned; grid cdiv(n * sizeof(T), CHUNK).
template <typename T, int CHUNK, typename F>
__device__ __forceinline__ void map1_bulk(const T* __restrict__ a, T* __restrict__ out, i64 n, F f) {
    static_assert(CHUNK % 16 == 0, "CHUNK: whole 16-byte vectors");
    constexpr int N = VecT<T>::N;
    __shared__ __align__(128) uint4 buf[CHUNK / 16];
    __shared__ __align__(8) unsigned long long bar;
    const i64 off = (i64)blockIdx.x * CHUNK;
    const unsigned bytes = (unsigned)min((i64)CHUNK, n * (i64)sizeof(T) - off);
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        mbar_init_fence();
        mbar_expect_tx(&bar, bytes);
        bulk_load(buf, reinterpret_cast<const char*>(a) + off, bytes, &bar);
    }
    __syncthreads();
    mbar_wait(&bar, 0);
    for (unsigned v = threadIdx.x; v < bytes / 16; v += blockDim.x) {
        float r[N];
        unpack_f32<T>(buf[v], r);
#pragma unroll
        for (int j = 0; j < N; ++j) r[j] = f(r[j]);
        buf[v] = pack_f32<T>(r);
    }
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == 0) {
        bulk_store(reinterpret_cast<char*>(out) + off, buf, bytes);
        bulk_commit();
        bulk_wait_read<0>();
    }
}
#endif

#endif  // FLAME_COMMON_CUH
