// Probe (bench/act_probe.py): the SiLU / GELU(tanh) backward as one loop step per thread (the grid covers the data,
// no grid-stride loop), VB-byte vectors (8: 4 bf16 per access, 16: 8), U vectors per thread. The arrays are VB-byte
// aligned (checked by the caller). TAIL: the last block's thread 0 also does the n % (VB / sizeof(T)) elements past
// the last whole vector. BR (GELU only): the form is a runtime argument (the library's kernel takes one), else tanh.
template <int VB> struct RawVec;
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<16> { using type = uint4; };

template <typename T, int VB, int U, bool TAIL, typename F>
__device__ __forceinline__ void map2_step(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                          i64 n, F f) {
    using V = typename RawVec<VB>::type;
    constexpr int N = VB / sizeof(T);
    const i64 bdim = blockDim.x, nv = n / N;
    const i64 base = (i64)blockIdx.x * bdim * U + threadIdx.x;
    V qa[U], qb[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * bdim < nv) {
            qa[u] = *reinterpret_cast<const V*>(a + (base + u * bdim) * N);
            qb[u] = *reinterpret_cast<const V*>(b + (base + u * bdim) * N);
        }
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * bdim < nv) {
            union { V q; T t[N]; } ua, ub;
            ua.q = qa[u];
            ub.q = qb[u];
#pragma unroll
            for (int j = 0; j < N; ++j) ub.t[j] = from_f32<T>(f(to_f32(ua.t[j]), to_f32(ub.t[j])));
            *reinterpret_cast<V*>(out + (base + u * bdim) * N) = ub.q;
        }
    if (TAIL && blockIdx.x == gridDim.x - 1 && threadIdx.x == 0)
        for (i64 i = nv * N; i < n; ++i) out[i] = from_f32<T>(f(to_f32(a[i]), to_f32(b[i])));
}

template <typename T, int VB, int U, bool TAIL>
__global__ void silu_bwd_step(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n) {
    map2_step<T, VB, U, TAIL>(dy, x, dx, n, [](float g, float v) { return g * silu_grad(v); });
}

template <typename T, int VB, int U, bool TAIL, bool BR>
__global__ void gelu_bwd_step(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 n,
                              int approx) {
    if (!BR || approx)
        map2_step<T, VB, U, TAIL>(dy, x, dx, n, [](float g, float v) { return g * gelu_tanh_grad(v); });
    else
        map2_step<T, VB, U, TAIL>(dy, x, dx, n, [](float g, float v) { return g * gelu_erf_grad(v); });
}
