// Probe (bench/act_probe.py swizzle): the order blocks take their chunks in. Block b takes chunk
// (b % S) * (gridDim.x / S) + b / S, so the blocks resident at one time work in S windows spread over the array
// instead of one (S = 1: the library's order). gridDim.x % S == 0 assumed (the probe's shape).
// silu forward: one 16-byte vector per thread (the library's loop plan (1, 256) without the loop);
// GELU(tanh) backward: map2_step8's body, U 8-byte vectors per thread.
__device__ __forceinline__ i64 swizzled_block(int S) {
    const i64 nb = gridDim.x, b = blockIdx.x;
    return (b % S) * (nb / S) + b / S;
}

template <typename T>
__global__ void silu_fwd_swz(const T* __restrict__ x, T* __restrict__ y, i64 n, int S) {
    constexpr int N = VecT<T>::N;
    const i64 v = swizzled_block(S) * blockDim.x + threadIdx.x;
    if (v < n / N) {
        float a[N];
        unpack_f32<T>(load_raw16(x + v * N), a);
#pragma unroll
        for (int j = 0; j < N; ++j) a[j] = silu(a[j]);
        *reinterpret_cast<uint4*>(y + v * N) = pack_f32<T>(a);
    }
}

template <typename T, int U>
__global__ void gelu_bwd_swz(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n, int S) {
    constexpr int N = 8 / sizeof(T);
    const i64 bdim = blockDim.x, nv = n / N;
    const i64 base = swizzled_block(S) * bdim * U + threadIdx.x;
    uint2 qa[U], qb[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * bdim < nv) {
            qa[u] = *reinterpret_cast<const uint2*>(dy + (base + u * bdim) * N);
            qb[u] = *reinterpret_cast<const uint2*>(x + (base + u * bdim) * N);
        }
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * bdim < nv) {
            union { uint2 q; T t[N]; } ua, ub;
            ua.q = qa[u];
            ub.q = qb[u];
#pragma unroll
            for (int j = 0; j < N; ++j) ub.t[j] = from_f32<T>(to_f32(ua.t[j]) * gelu_tanh_grad(to_f32(ub.t[j])));
            *reinterpret_cast<uint2*>(dx + (base + u * bdim) * N) = ub.q;
        }
}

// Lean one-step kernels (32-bit index math, no loop, no alignment check, nothing before the first load but the index):
// silu forward with one VB-byte vector per thread, GELU(tanh) backward with U 8-byte vectors per thread.
template <int VB> struct LeanVec;
template <> struct LeanVec<8> { using type = uint2; };
template <> struct LeanVec<16> { using type = uint4; };

template <typename T, int VB>
__global__ void silu_fwd_lean(const T* __restrict__ x, T* __restrict__ y, int nv) {
    using V = typename LeanVec<VB>::type;
    constexpr int N = VB / sizeof(T);
    const int v = blockIdx.x * blockDim.x + threadIdx.x;
    if (v < nv) {
        union { V q; T t[N]; } u;
        u.q = reinterpret_cast<const V*>(x)[v];
#pragma unroll
        for (int j = 0; j < N; ++j) u.t[j] = from_f32<T>(silu(to_f32(u.t[j])));
        reinterpret_cast<V*>(y)[v] = u.q;
    }
}

template <typename T, int U>
__global__ void gelu_bwd_lean(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, int nv) {
    const int base = blockIdx.x * blockDim.x * U + threadIdx.x;
    uint2 qa[U], qb[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * (int)blockDim.x < nv) {
            qa[u] = reinterpret_cast<const uint2*>(dy)[base + u * blockDim.x];
            qb[u] = reinterpret_cast<const uint2*>(x)[base + u * blockDim.x];
        }
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * (int)blockDim.x < nv) {
            union { uint2 q; T t[4]; } ua, ub;
            ua.q = qa[u];
            ub.q = qb[u];
#pragma unroll
            for (int j = 0; j < 4; ++j) ub.t[j] = from_f32<T>(to_f32(ua.t[j]) * gelu_tanh_grad(to_f32(ub.t[j])));
            reinterpret_cast<uint2*>(dx)[base + u * blockDim.x] = ub.q;
        }
}
