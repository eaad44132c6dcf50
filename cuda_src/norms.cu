// LayerNorm and RMSNorm over the last dim (forward + backward), and the column sums of their weight gradients.
// Statistics and math in fp32; weight / bias are T or fp32 (wf32 = 1). Rows are handled by groups of `tpr` threads:
// a power of two <= 32 (several rows per block, shuffle reductions) or the whole block. Each thread caches up to
// VPT (1, 2 or 4: one kernel each) vectors of its row in registers (one read of x); rows wider than tpr * VPT * N
// take the looping path (x re-read from cache).
#include "common.cuh"

// Forward of one row. N: elements per vector (16 bytes, or 1 for unaligned / odd widths).
template <typename T, int N, int VPT>
__device__ __forceinline__ void norm_fwd_row(const T* __restrict__ xr, const void* __restrict__ w,
                                             const void* __restrict__ b, T* __restrict__ yr, float* mean_out,
                                             float* rstd_out, bool valid, int cols, float eps, int lane, int tpr,
                                             int rms, int wf32, float* smem) {
    const int nvec = cols / N;
    if (nvec <= tpr * VPT) {
        float v[VPT][N];
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                load_f32<T, N>(xr + (i64)k * N, v[i]);
#pragma unroll
                for (int j = 0; j < N; ++j) s += v[i][j];
            }
        }
        const float mean = rms ? 0.f : group_sum(s, tpr, smem) / cols;
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const float d = v[i][j] - mean;
                    ss += d * d;
                }
            }
        }
        const float rstd = rsqrtf(group_sum(ss, tpr, smem) / cols + eps);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                float wv[N], bv[N], o[N];
                if (w) load_any<T, N>(w, (i64)k * N, wf32, wv);
                if (b) load_any<T, N>(b, (i64)k * N, wf32, bv);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float t = (v[i][j] - mean) * rstd;
                    if (w) t *= wv[j];
                    if (b) t += bv[j];
                    o[j] = t;
                }
                store_f32<T, N>(yr + (i64)k * N, o);
            }
        }
        if (valid && lane == 0) {
            if (mean_out) *mean_out = mean;
            if (rstd_out) *rstd_out = rstd;
        }
    } else {  // very wide rows: three passes over the row (the later ones hit L1/L2)
        float s = 0.f;
        if (valid && !rms)
            for (int k = lane; k < cols; k += tpr) s += to_f32(xr[k]);
        const float mean = rms ? 0.f : group_sum(s, tpr, smem) / cols;
        float ss = 0.f;
        if (valid)
            for (int k = lane; k < cols; k += tpr) {
                const float d = to_f32(xr[k]) - mean;
                ss += d * d;
            }
        const float rstd = rsqrtf(group_sum(ss, tpr, smem) / cols + eps);
        if (valid) {
            for (int k = lane; k < cols; k += tpr) {
                float t = (to_f32(xr[k]) - mean) * rstd;
                if (w) t *= load_any1<T>(w, k, wf32);
                if (b) t += load_any1<T>(b, k, wf32);
                yr[k] = from_f32<T>(t);
            }
            if (lane == 0) {
                if (mean_out) *mean_out = mean;
                if (rstd_out) *rstd_out = rstd;
            }
        }
    }
}

template <typename T, int VPT>
__device__ __forceinline__ void norm_fwd_impl(const T* __restrict__ x, const void* __restrict__ w,
                                              const void* __restrict__ b, T* __restrict__ y, float* __restrict__ mean,
                                              float* __restrict__ rstd, i64 rows, int cols, float eps, int tpr, int rms,
                                              int wf32) {
    __shared__ float smem[32];
    const int lane = threadIdx.x % tpr;
    const i64 row = (i64)blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    const bool valid = row < rows;
    const i64 r = valid ? row : 0;
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float* mo = mean ? mean + r : nullptr;
    float* ro = rstd ? rstd + r : nullptr;
    constexpr int N = VecT<T>::N;
    if (cols % N == 0 && aligned16(x) && aligned16(y))
        norm_fwd_row<T, N, VPT>(xr, w, b, yr, mo, ro, valid, cols, eps, lane, tpr, rms, wf32, smem);
    else
        norm_fwd_row<T, 1, VPT>(xr, w, b, yr, mo, ro, valid, cols, eps, lane, tpr, rms, wf32, smem);
}

// y = (x - mean) * rstd * w + b per row (rms: mean = 0, no b). mean / rstd: fp32 (rows,), either may be null.
// The digit is VPT: 16-byte vectors of the row each thread caches.
template <typename T>
__global__ void norm_fwd1(const T* __restrict__ x, const void* __restrict__ w, const void* __restrict__ b,
                          T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, i64 rows, int cols,
                          float eps, int tpr, int rms, int wf32) {
    norm_fwd_impl<T, 1>(x, w, b, y, mean, rstd, rows, cols, eps, tpr, rms, wf32);
}
template <typename T>
__global__ void norm_fwd2(const T* __restrict__ x, const void* __restrict__ w, const void* __restrict__ b,
                          T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, i64 rows, int cols,
                          float eps, int tpr, int rms, int wf32) {
    norm_fwd_impl<T, 2>(x, w, b, y, mean, rstd, rows, cols, eps, tpr, rms, wf32);
}
template <typename T>
__global__ void norm_fwd4(const T* __restrict__ x, const void* __restrict__ w, const void* __restrict__ b,
                          T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, i64 rows, int cols,
                          float eps, int tpr, int rms, int wf32) {
    norm_fwd_impl<T, 4>(x, w, b, y, mean, rstd, rows, cols, eps, tpr, rms, wf32);
}

// Backward of rows; each row group accumulates its share of dw = sum(dy * xhat), db = sum(dy) in registers and writes
// one partial row into dw_part / db_part (fp32, (gridDim.x * groups_per_block, cols)), summed by column_sum.
template <typename T, int N, int VPT>
__device__ __forceinline__ void norm_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x,
                                              const void* __restrict__ w, const float* __restrict__ mean,
                                              const float* __restrict__ rstd, T* __restrict__ dx,
                                              float* __restrict__ dw_part, float* __restrict__ db_part, i64 rows,
                                              int cols, int tpr, int rms, int wf32, float* smem) {
    const int lane = threadIdx.x % tpr, rpb = blockDim.x / tpr;
    const i64 part = (i64)blockIdx.x * rpb + threadIdx.x / tpr;
    const int nvec = cols / N;
    const float inv_cols = 1.f / cols;
    if (nvec <= tpr * VPT) {
        float aw[VPT][N], ab[VPT][N];
#pragma unroll
        for (int i = 0; i < VPT; ++i)
#pragma unroll
            for (int j = 0; j < N; ++j) aw[i][j] = ab[i][j] = 0.f;
        const i64 nblk = (rows + rpb - 1) / rpb;
        for (i64 rb = blockIdx.x; rb < nblk; rb += gridDim.x) {
            const i64 row = rb * rpb + threadIdx.x / tpr;
            const bool valid = row < rows;
            const i64 r = valid ? row : 0;
            const float mu = rms ? 0.f : mean[r], rs = rstd[r];
            float xv[VPT][N], gv[VPT][N];
            float sg = 0.f, sgx = 0.f;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int k = i * tpr + lane;
                if (valid && k < nvec) {
                    float dv[N], wv[N];
                    load_f32<T, N>(x + r * cols + (i64)k * N, xv[i]);
                    load_f32<T, N>(dy + r * cols + (i64)k * N, dv);
                    if (w) load_any<T, N>(w, (i64)k * N, wf32, wv);
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        const float xh = (xv[i][j] - mu) * rs;
                        aw[i][j] += dv[j] * xh;
                        ab[i][j] += dv[j];
                        const float g = w ? dv[j] * wv[j] : dv[j];
                        xv[i][j] = xh;
                        gv[i][j] = g;
                        sg += g;
                        sgx += g * xh;
                    }
                }
            }
            const float mg = rms ? 0.f : group_sum(sg, tpr, smem) * inv_cols;
            const float mgx = group_sum(sgx, tpr, smem) * inv_cols;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int k = i * tpr + lane;
                if (valid && k < nvec) {
                    float o[N];
#pragma unroll
                    for (int j = 0; j < N; ++j) o[j] = rs * (gv[i][j] - mg - xv[i][j] * mgx);
                    store_f32<T, N>(dx + r * cols + (i64)k * N, o);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (k < nvec) {
                if (dw_part) store_f32<float, N>(dw_part + part * cols + (i64)k * N, aw[i]);
                if (db_part) store_f32<float, N>(db_part + part * cols + (i64)k * N, ab[i]);
            }
        }
    } else {  // very wide rows: partials go straight to the part row (this group owns it)
        for (int k = lane; k < cols; k += tpr) {
            if (dw_part) dw_part[part * cols + k] = 0.f;
            if (db_part) db_part[part * cols + k] = 0.f;
        }
        const i64 nblk = (rows + rpb - 1) / rpb;
        for (i64 rb = blockIdx.x; rb < nblk; rb += gridDim.x) {
            const i64 row = rb * rpb + threadIdx.x / tpr;
            const bool valid = row < rows;
            const i64 r = valid ? row : 0;
            const float mu = rms ? 0.f : mean[r], rs = rstd[r];
            const T* xr = x + r * cols;
            const T* dyr = dy + r * cols;
            float sg = 0.f, sgx = 0.f;
            if (valid)
                for (int k = lane; k < cols; k += tpr) {
                    const float d = to_f32(dyr[k]), xh = (to_f32(xr[k]) - mu) * rs;
                    const float g = w ? d * load_any1<T>(w, k, wf32) : d;
                    sg += g;
                    sgx += g * xh;
                    if (dw_part) dw_part[part * cols + k] += d * xh;
                    if (db_part) db_part[part * cols + k] += d;
                }
            const float mg = rms ? 0.f : group_sum(sg, tpr, smem) * inv_cols;
            const float mgx = group_sum(sgx, tpr, smem) * inv_cols;
            if (valid)
                for (int k = lane; k < cols; k += tpr) {
                    const float d = to_f32(dyr[k]), xh = (to_f32(xr[k]) - mu) * rs;
                    const float g = w ? d * load_any1<T>(w, k, wf32) : d;
                    dx[r * cols + k] = from_f32<T>(rs * (g - mg - xh * mgx));
                }
        }
    }
}

template <typename T, int VPT>
__device__ __forceinline__ void norm_bwd_impl(const T* __restrict__ dy, const T* __restrict__ x,
                                              const void* __restrict__ w, const float* __restrict__ mean,
                                              const float* __restrict__ rstd, T* __restrict__ dx,
                                              float* __restrict__ dw_part, float* __restrict__ db_part, i64 rows,
                                              int cols, int tpr, int rms, int wf32) {
    __shared__ float smem[32];
    constexpr int N = VecT<T>::N;
    if (cols % N == 0 && aligned16(x) && aligned16(dy) && aligned16(dx))
        norm_bwd_rows<T, N, VPT>(dy, x, w, mean, rstd, dx, dw_part, db_part, rows, cols, tpr, rms, wf32, smem);
    else
        norm_bwd_rows<T, 1, VPT>(dy, x, w, mean, rstd, dx, dw_part, db_part, rows, cols, tpr, rms, wf32, smem);
}

template <typename T>
__global__ void norm_bwd1(const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w,
                          const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
                          float* __restrict__ dw_part, float* __restrict__ db_part, i64 rows, int cols, int tpr,
                          int rms, int wf32) {
    norm_bwd_impl<T, 1>(dy, x, w, mean, rstd, dx, dw_part, db_part, rows, cols, tpr, rms, wf32);
}
template <typename T>
__global__ void norm_bwd2(const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w,
                          const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
                          float* __restrict__ dw_part, float* __restrict__ db_part, i64 rows, int cols, int tpr,
                          int rms, int wf32) {
    norm_bwd_impl<T, 2>(dy, x, w, mean, rstd, dx, dw_part, db_part, rows, cols, tpr, rms, wf32);
}
template <typename T>
__global__ void norm_bwd4(const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w,
                          const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
                          float* __restrict__ dw_part, float* __restrict__ db_part, i64 rows, int cols, int tpr,
                          int rms, int wf32) {
    norm_bwd_impl<T, 4>(dy, x, w, mean, rstd, dx, dw_part, db_part, rows, cols, tpr, rms, wf32);
}

// out[c] = sum_p part[p, c], in T (the weight's dtype). Block (32, 32).
template <typename T>
__global__ void column_sum(const float* __restrict__ part, T* __restrict__ out, int parts, int cols) {
    column_sum_body<T>(part, out, parts, cols);
}
