// Softmax / log-softmax of scale * x over the last dim, forward and backward. Rows are handled like the norms: groups
// of `tpr` threads (a power of two <= 32, or the whole block), the row cached in registers (VPT = 1, 2 or 4 vectors
// per thread, one kernel each) or, for very wide rows, re-read from cache. fp32 math.
#include "common.cuh"

template <typename T, int N, int VPT>
__device__ __forceinline__ void softmax_row(const T* __restrict__ xr, T* __restrict__ yr, bool valid, int cols,
                                            float scale, int log_out, int lane, int tpr, float* smem) {
    const int nvec = cols / N;
    if (nvec <= tpr * VPT) {
        float v[VPT][N];
        float m = FLAME_NEG_INF;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                load_f32<T, N>(xr + (i64)k * N, v[i]);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    v[i][j] *= scale;
                    m = fmaxf(m, v[i][j]);
                }
            }
        }
        m = group_max(m, tpr, smem);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec)
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const float e = expf(v[i][j] - m);
                    s += e;
                    if (!log_out) v[i][j] = e;
                }
        }
        s = group_sum(s, tpr, smem);
        const float inv = 1.f / s, lse = logf(s);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                float o[N];
#pragma unroll
                for (int j = 0; j < N; ++j) o[j] = log_out ? v[i][j] - m - lse : v[i][j] * inv;
                store_f32<T, N>(yr + (i64)k * N, o);
            }
        }
    } else {
        float m = FLAME_NEG_INF;
        if (valid)
            for (int k = lane; k < cols; k += tpr) m = fmaxf(m, to_f32(xr[k]) * scale);
        m = group_max(m, tpr, smem);
        float s = 0.f;
        if (valid)
            for (int k = lane; k < cols; k += tpr) s += expf(to_f32(xr[k]) * scale - m);
        s = group_sum(s, tpr, smem);
        const float inv = 1.f / s, lse = logf(s);
        if (valid)
            for (int k = lane; k < cols; k += tpr) {
                const float z = to_f32(xr[k]) * scale - m;
                yr[k] = from_f32<T>(log_out ? z - lse : expf(z) * inv);
            }
    }
}

template <typename T, int VPT>
__device__ __forceinline__ void softmax_fwd_impl(const T* __restrict__ x, T* __restrict__ y, i64 rows, int cols,
                                                 float scale, int log_out, int tpr) {
    __shared__ float smem[32];
    const int lane = threadIdx.x % tpr;
    const i64 row = (i64)blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    const bool valid = row < rows;
    const i64 r = valid ? row : 0;
    constexpr int N = VecT<T>::N;
    if (cols % N == 0 && aligned16(x) && aligned16(y))
        softmax_row<T, N, VPT>(x + r * cols, y + r * cols, valid, cols, scale, log_out, lane, tpr, smem);
    else
        softmax_row<T, 1, VPT>(x + r * cols, y + r * cols, valid, cols, scale, log_out, lane, tpr, smem);
}

// The digit is VPT: 16-byte vectors of the row each thread caches.
template <typename T>
__global__ void softmax_fwd1(const T* __restrict__ x, T* __restrict__ y, i64 rows, int cols, float scale,
                             int log_out, int tpr) {
    softmax_fwd_impl<T, 1>(x, y, rows, cols, scale, log_out, tpr);
}
template <typename T>
__global__ void softmax_fwd2(const T* __restrict__ x, T* __restrict__ y, i64 rows, int cols, float scale,
                             int log_out, int tpr) {
    softmax_fwd_impl<T, 2>(x, y, rows, cols, scale, log_out, tpr);
}
template <typename T>
__global__ void softmax_fwd4(const T* __restrict__ x, T* __restrict__ y, i64 rows, int cols, float scale,
                             int log_out, int tpr) {
    softmax_fwd_impl<T, 4>(x, y, rows, cols, scale, log_out, tpr);
}

// softmax: dx = scale * y * (dy - sum(dy * y));  log-softmax: dx = scale * (dy - exp(y) * sum(dy)).
template <typename T, int N, int VPT>
__device__ __forceinline__ void softmax_bwd_row(const T* __restrict__ dyr, const T* __restrict__ yr,
                                                T* __restrict__ dxr, bool valid, int cols, float scale, int log_out,
                                                int lane, int tpr, float* smem) {
    const int nvec = cols / N;
    if (nvec <= tpr * VPT) {
        float g[VPT][N], y[VPT][N];
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                load_f32<T, N>(dyr + (i64)k * N, g[i]);
                load_f32<T, N>(yr + (i64)k * N, y[i]);
#pragma unroll
                for (int j = 0; j < N; ++j) s += log_out ? g[i][j] : g[i][j] * y[i][j];
            }
        }
        s = group_sum(s, tpr, smem);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                float o[N];
#pragma unroll
                for (int j = 0; j < N; ++j)
                    o[j] = log_out ? scale * (g[i][j] - expf(y[i][j]) * s) : scale * y[i][j] * (g[i][j] - s);
                store_f32<T, N>(dxr + (i64)k * N, o);
            }
        }
    } else {
        float s = 0.f;
        if (valid)
            for (int k = lane; k < cols; k += tpr) s += log_out ? to_f32(dyr[k]) : to_f32(dyr[k]) * to_f32(yr[k]);
        s = group_sum(s, tpr, smem);
        if (valid)
            for (int k = lane; k < cols; k += tpr) {
                const float g = to_f32(dyr[k]), y = to_f32(yr[k]);
                dxr[k] = from_f32<T>(log_out ? scale * (g - expf(y) * s) : scale * y * (g - s));
            }
    }
}

template <typename T, int VPT>
__device__ __forceinline__ void softmax_bwd_impl(const T* __restrict__ dy, const T* __restrict__ y,
                                                 T* __restrict__ dx, i64 rows, int cols, float scale, int log_out,
                                                 int tpr) {
    __shared__ float smem[32];
    const int lane = threadIdx.x % tpr;
    const i64 row = (i64)blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    const bool valid = row < rows;
    const i64 r = valid ? row : 0;
    constexpr int N = VecT<T>::N;
    if (cols % N == 0 && aligned16(dy) && aligned16(y) && aligned16(dx))
        softmax_bwd_row<T, N, VPT>(dy + r * cols, y + r * cols, dx + r * cols, valid, cols, scale, log_out, lane,
                                   tpr, smem);
    else
        softmax_bwd_row<T, 1, VPT>(dy + r * cols, y + r * cols, dx + r * cols, valid, cols, scale, log_out, lane,
                                   tpr, smem);
}

template <typename T>
__global__ void softmax_bwd1(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, i64 rows,
                             int cols, float scale, int log_out, int tpr) {
    softmax_bwd_impl<T, 1>(dy, y, dx, rows, cols, scale, log_out, tpr);
}
template <typename T>
__global__ void softmax_bwd2(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, i64 rows,
                             int cols, float scale, int log_out, int tpr) {
    softmax_bwd_impl<T, 2>(dy, y, dx, rows, cols, scale, log_out, tpr);
}
template <typename T>
__global__ void softmax_bwd4(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, i64 rows,
                             int cols, float scale, int log_out, int tpr) {
    softmax_bwd_impl<T, 4>(dy, y, dx, rows, cols, scale, log_out, tpr);
}
