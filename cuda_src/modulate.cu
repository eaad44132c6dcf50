// adaLN modulation y = x * (1 + scale) + shift and the gated residual out = x + gate * y, with (B, H) modulation
// vectors broadcast over x's (B, L, H); and their backward, which reduces over L for the modulation gradients.
// Grids: x over L*H elements (blockIdx.x, grid-stride), blockIdx.y = batch. Modulation vectors are T or fp32 (mf32).
#include "common.cuh"

template <typename T, int N>
__device__ __forceinline__ void modulate_body(const T* __restrict__ x, const void* __restrict__ shift,
                                              const void* __restrict__ scale, T* __restrict__ y, i64 lh, int h,
                                              int mf32) {
    const i64 b = blockIdx.y;
    x += b * lh;
    y += b * lh;
    const i64 nv = lh / N;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < nv; k += (i64)gridDim.x * blockDim.x) {
        const int c = (int)((k * N) % h);
        float v[N], sh[N], sc[N];
        load_f32<T, N>(x + k * N, v);
        load_any<T, N>(shift, b * h + c, mf32, sh);
        load_any<T, N>(scale, b * h + c, mf32, sc);
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = v[j] * (1.f + sc[j]) + sh[j];
        store_f32<T, N>(y + k * N, v);
    }
}

template <typename T>
__global__ void modulate_fwd(const T* __restrict__ x, const void* __restrict__ shift, const void* __restrict__ scale,
                             T* __restrict__ y, i64 lh, int h, int mf32) {
    constexpr int N = VecT<T>::N;
    if (h % N == 0 && aligned16(x) && aligned16(y) && aligned16(shift) && aligned16(scale))
        modulate_body<T, N>(x, shift, scale, y, lh, h, mf32);
    else
        modulate_body<T, 1>(x, shift, scale, y, lh, h, mf32);
}

template <typename T, int N>
__device__ __forceinline__ void gated_body(const T* __restrict__ x, const void* __restrict__ gate,
                                           const T* __restrict__ y, T* __restrict__ out, i64 lh, int h, int mf32) {
    const i64 b = blockIdx.y;
    x += b * lh;
    y += b * lh;
    out += b * lh;
    const i64 nv = lh / N;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < nv; k += (i64)gridDim.x * blockDim.x) {
        const int c = (int)((k * N) % h);
        float xv[N], yv[N], g[N];
        load_f32<T, N>(x + k * N, xv);
        load_f32<T, N>(y + k * N, yv);
        load_any<T, N>(gate, b * h + c, mf32, g);
#pragma unroll
        for (int j = 0; j < N; ++j) xv[j] += g[j] * yv[j];
        store_f32<T, N>(out + k * N, xv);
    }
}

template <typename T>
__global__ void gated_fwd(const T* __restrict__ x, const void* __restrict__ gate, const T* __restrict__ y,
                          T* __restrict__ out, i64 lh, int h, int mf32) {
    constexpr int N = VecT<T>::N;
    if (h % N == 0 && aligned16(x) && aligned16(y) && aligned16(out) && aligned16(gate))
        gated_body<T, N>(x, gate, y, out, lh, h, mf32);
    else
        gated_body<T, 1>(x, gate, y, out, lh, h, mf32);
}

// out = g * (coef + off): the input gradient of modulate (off = 1) and of gated_residual's y (off = 0) when the
// modulation vector needs no gradient (a frozen base's adaLN), so nothing is summed over L.
template <typename T, int N>
__device__ __forceinline__ void bscale_body(const T* __restrict__ g, const void* __restrict__ coef, float off,
                                            T* __restrict__ out, i64 lh, int h, int mf32) {
    const i64 b = blockIdx.y;
    g += b * lh;
    out += b * lh;
    const i64 nv = lh / N;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < nv; k += (i64)gridDim.x * blockDim.x) {
        const int c = (int)((k * N) % h);
        float v[N], cf[N];
        load_f32<T, N>(g + k * N, v);
        load_any<T, N>(coef, b * h + c, mf32, cf);
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] *= cf[j] + off;
        store_f32<T, N>(out + k * N, v);
    }
}

template <typename T>
__global__ void bcast_scale(const T* __restrict__ g, const void* __restrict__ coef, T* __restrict__ out, i64 lh,
                            int h, int mf32, float off) {
    constexpr int N = VecT<T>::N;
    if (h % N == 0 && aligned16(g) && aligned16(out) && aligned16(coef))
        bscale_body<T, N>(g, coef, off, out, lh, h, mf32);
    else
        bscale_body<T, 1>(g, coef, off, out, lh, h, mf32);
}

// Backward of out = a * (coef + off) [+ shift]:  d_a = dout * (coef + off);  partial sums over this block's rows of
// dout * a (-> dcoef) and dout (-> dshift, when dsum_part is given). Block (32, 8): threadIdx.x owns N columns,
// threadIdx.y strides over rows of split blockIdx.z (MOD_ROWS rows' loads in flight at once); grid (cdiv(h, 32 N), B,
// splits). Parts: (B, splits, h) fp32. counters non-null: the last block of each (column chunk, batch) to finish
// (last_arrival, counter b * gridDim.x + blockIdx.x) sums the chunk's `splits` part rows in split order into
// dcoef_out / dsum_out ((B, h), T or fp32 where of32) in the same launch; else mod_column_sum sums the parts.
#define MOD_ROWS 2

template <typename T, int N>
__device__ __forceinline__ void bcast_rows(const T* __restrict__ p, i64 e, uint4& q, T (&t)[N]) {
    if constexpr (N == VecT<T>::N)
        q = load_raw16(p + e);
    else
#pragma unroll
        for (int j = 0; j < N; ++j) t[j] = p[e + j];
}

template <typename T, int N>
__device__ __forceinline__ void bcast_vals(const uint4& q, const T (&t)[N], float (&v)[N]) {
    if constexpr (N == VecT<T>::N)
        unpack_f32<T>(q, v);
    else
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = to_f32(t[j]);
}

template <typename T, int N>
__device__ __forceinline__ void bcast_bwd_body(const T* __restrict__ dout, const T* __restrict__ a,
                                               const void* __restrict__ coef, float off, T* __restrict__ da,
                                               float* __restrict__ dcoef_part, float* __restrict__ dsum_part, int l,
                                               int h, int mf32, void* __restrict__ dcoef_out,
                                               void* __restrict__ dsum_out, unsigned* __restrict__ counters,
                                               int of32) {
    __shared__ float red[2][8][32 * N];
    __shared__ int flag;
    const i64 b = blockIdx.y;
    const int splits = gridDim.z, s = blockIdx.z;
    const int c = (blockIdx.x * 32 + threadIdx.x) * N;
    const bool col_ok = c < h;
    const int rows_per = (l + splits - 1) / splits, r0 = s * rows_per, r1 = min(l, r0 + rows_per);
    float cf[N], acc_c[N], acc_s[N];
#pragma unroll
    for (int j = 0; j < N; ++j) acc_c[j] = acc_s[j] = 0.f;
    if (col_ok) {
        load_any<T, N>(coef, b * h + c, mf32, cf);
#pragma unroll
        for (int j = 0; j < N; ++j) cf[j] += off;
        for (int r = r0 + threadIdx.y; r < r1; r += 8 * MOD_ROWS) {
            uint4 qg[MOD_ROWS], qa[MOD_ROWS];
            T tg[MOD_ROWS][N], ta[MOD_ROWS][N];  // the scalar path's values (unused on the 16-byte path)
#pragma unroll
            for (int u = 0; u < MOD_ROWS; ++u)
                if (r + 8 * u < r1) {
                    const i64 e = (b * l + r + 8 * u) * (i64)h + c;
                    bcast_rows<T, N>(dout, e, qg[u], tg[u]);
                    bcast_rows<T, N>(a, e, qa[u], ta[u]);
                }
#pragma unroll
            for (int u = 0; u < MOD_ROWS; ++u)
                if (r + 8 * u < r1) {
                    const i64 e = (b * l + r + 8 * u) * (i64)h + c;
                    float g[N], av[N];
                    bcast_vals<T, N>(qg[u], tg[u], g);
                    bcast_vals<T, N>(qa[u], ta[u], av);
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        acc_c[j] += g[j] * av[j];
                        acc_s[j] += g[j];
                        av[j] = g[j] * cf[j];
                    }
                    if (da) store_f32<T, N>(da + e, av);
                }
        }
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
        red[0][threadIdx.y][threadIdx.x * N + j] = acc_c[j];
        red[1][threadIdx.y][threadIdx.x * N + j] = acc_s[j];
    }
    __syncthreads();
    if (threadIdx.y == 0 && col_ok) {
        const i64 base = (b * splits + s) * (i64)h + c;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            float sc = 0.f, ss = 0.f;
#pragma unroll
            for (int y = 0; y < 8; ++y) {
                sc += red[0][y][threadIdx.x * N + j];
                ss += red[1][y][threadIdx.x * N + j];
            }
            dcoef_part[base + j] = sc;
            if (dsum_part) dsum_part[base + j] = ss;
        }
    }
    if (counters == nullptr || !last_arrival(counters + b * gridDim.x + blockIdx.x, splits, &flag)) return;
    const int c0 = blockIdx.x * 32 * N, c1 = min(h, c0 + 32 * N);
    sum_rows<4>(dcoef_part, h, b * splits, 1, splits, c0, c1, [&](int col, const float(&v)[4], int n) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (j < n) store_any1<T>(dcoef_out, b * h + col + j, v[j], of32);
    });
    if (dsum_part)
        sum_rows<4>(dsum_part, h, b * splits, 1, splits, c0, c1, [&](int col, const float(&v)[4], int n) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < n) store_any1<T>(dsum_out, b * h + col + j, v[j], of32);
        });
}

template <typename T>
__global__ void __launch_bounds__(256) bcast_bwd(const T* __restrict__ dout, const T* __restrict__ a,
                                                 const void* __restrict__ coef, float off, T* __restrict__ da,
                                                 float* __restrict__ dcoef_part, float* __restrict__ dsum_part,
                                                 int l, int h, int mf32, int vec, void* __restrict__ dcoef_out,
                                                 void* __restrict__ dsum_out, unsigned* __restrict__ counters,
                                                 int of32) {
    constexpr int N = VecT<T>::N;
    if (vec)
        bcast_bwd_body<T, N>(dout, a, coef, off, da, dcoef_part, dsum_part, l, h, mf32, dcoef_out, dsum_out,
                             counters, of32);
    else
        bcast_bwd_body<T, 1>(dout, a, coef, off, da, dcoef_part, dsum_part, l, h, mf32, dcoef_out, dsum_out,
                             counters, of32);
}

template <typename T>
__global__ void mod_column_sum(const float* __restrict__ part, T* __restrict__ out, int parts, int cols) {
    column_sum_body<T>(part, out, parts, cols);
}
