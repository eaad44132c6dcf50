// Probe (bench/act_probe.py): the SiLU / GELU(tanh) backward with 8-byte vectors (4 bf16 / fp16 per access) instead
// of the library's 16-byte ones (map2_unrolled), U vectors per thread, the grid covering the data. n % 4 == 0 and
// 8-byte aligned arrays assumed (the probe's shapes).
template <typename T, int U, typename F>
__device__ __forceinline__ void map2_v8(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, i64 n,
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

template <typename T, int U>
__global__ void silu_bwd_v8(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2_v8<T, U>(dy, x, dx, n, [](float g, float v) { return g * silu_grad(v); });
}

template <typename T, int U>
__global__ void gelu_bwd_v8(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2_v8<T, U>(dy, x, dx, n, [](float g, float v) { return g * gelu_tanh_grad(v); });
}
