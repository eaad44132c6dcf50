// GroupNorm on (N, C, *spatial) contiguous: G groups of C/G channels, statistics in fp32 over each (n, group).
// Every (n, c) channel row of hw elements is split into `splits` chunks so that even a few large groups fill the GPU:
//   forward:  gn_partials (chunk mean, M2) -> gn_fwd_finalize (group mean/rstd, per-row a, b) -> gn_apply y = a x + b
//   backward: gn_partials (chunk sum dy*x, sum dy) -> gn_bwd_finalize (per-row p, q, r; dw/db parts)
//             -> gn_bwd_apply dx = p dy + q x + r, and column_sum for dw, db.
#include "common.cuh"

__device__ __forceinline__ void chunk_range(i64 hw, int splits, int s, i64& lo, i64& hi, int align) {
    i64 chunk = (hw + splits - 1) / splits;
    chunk = (chunk + align - 1) / align * align;
    lo = (i64)s * chunk;
    hi = lo + chunk < hw ? lo + chunk : hw;
    if (lo > hw) lo = hw;
}

template <typename T, int N>
__device__ __forceinline__ void partials_body(const T* __restrict__ x, const T* __restrict__ dy, float* __restrict__ p0,
                                              float* __restrict__ p1, i64 hw, int splits, float* smem) {
    const i64 row = blockIdx.x / splits;
    const int s = blockIdx.x % splits;
    i64 lo, hi;
    chunk_range(hw, splits, s, lo, hi, VecT<T>::N);
    const T* xr = x + row * hw;
    const i64 nv = (hi - lo) / N;  // lo is a multiple of the vector width; N divides hw on the vector path
    float a = 0.f, c = 0.f;
    if (dy == nullptr) {  // chunk mean, then M2 around it (second read hits L1)
        for (i64 k = threadIdx.x; k < nv; k += blockDim.x) {
            float v[N];
            load_f32<T, N>(xr + lo + k * N, v);
#pragma unroll
            for (int j = 0; j < N; ++j) a += v[j];
        }
        const float cnt = (float)(hi - lo);
        const float mean = cnt > 0.f ? block_sum(a, smem) / cnt : 0.f;
        for (i64 k = threadIdx.x; k < nv; k += blockDim.x) {
            float v[N];
            load_f32<T, N>(xr + lo + k * N, v);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const float d = v[j] - mean;
                c += d * d;
            }
        }
        c = block_sum(c, smem);
        a = mean;
    } else {
        const T* dr = dy + row * hw;
        for (i64 k = threadIdx.x; k < nv; k += blockDim.x) {
            float v[N], d[N];
            load_f32<T, N>(xr + lo + k * N, v);
            load_f32<T, N>(dr + lo + k * N, d);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                a += d[j] * v[j];
                c += d[j];
            }
        }
        a = block_sum(a, smem);
        c = block_sum(c, smem);
    }
    if (threadIdx.x == 0) {
        p0[blockIdx.x] = a;
        p1[blockIdx.x] = c;
    }
}

// Forward (dy null): p0 = chunk mean, p1 = chunk M2. Backward: p0 = sum(dy * x), p1 = sum(dy). Grid rows * splits.
template <typename T>
__global__ void gn_partials(const T* __restrict__ x, const T* __restrict__ dy, float* __restrict__ p0,
                            float* __restrict__ p1, i64 hw, int splits) {
    __shared__ float smem[32];
    constexpr int N = VecT<T>::N;
    if (hw % N == 0 && aligned16(x) && (dy == nullptr || aligned16(dy)))
        partials_body<T, N>(x, dy, p0, p1, hw, splits, smem);
    else
        partials_body<T, 1>(x, dy, p0, p1, hw, splits, smem);
}

// One thread per (n, g): Chan's combination of the chunk (mean, M2) pairs of the group's C/G rows; writes group mean
// and rstd, and per-row a = rstd * w[c], b = bias[c] - mean * a.
extern "C" __global__ void gn_fwd_finalize(const float* __restrict__ p0, const float* __restrict__ p1,
                                           const float* __restrict__ w, const float* __restrict__ bias,
                                           float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                           float* __restrict__ a_out, float* __restrict__ b_out, int n, int c, int g,
                                           long long hw, int splits, int align, float eps) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * g) return;
    const int cpg = c / g, gi = t % g;
    const long long row0 = (long long)t * cpg;  // rows of this group are consecutive: (n, gi*cpg + j)
    double cnt = 0.0, mean = 0.0, m2 = 0.0;
    for (int j = 0; j < cpg; ++j)
        for (int s = 0; s < splits; ++s) {
            long long lo, hi;
            chunk_range(hw, splits, s, lo, hi, align);
            const double nb = (double)(hi - lo);
            if (nb == 0.0) continue;
            const long long k = (row0 + j) * splits + s;
            const double mb = p0[k], tot = cnt + nb, delta = mb - mean;
            mean += delta * nb / tot;
            m2 += (double)p1[k] + delta * delta * cnt * nb / tot;
            cnt = tot;
        }
    const float mu = (float)mean, rs = rsqrtf((float)(m2 / cnt) + eps);
    mean_out[t] = mu;
    rstd_out[t] = rs;
    for (int j = 0; j < cpg; ++j) {
        const int ch = gi * cpg + j;
        const float a = w ? rs * w[ch] : rs;
        a_out[row0 + j] = a;
        b_out[row0 + j] = (bias ? bias[ch] : 0.f) - mu * a;
    }
}

// y = x * a[row] + b[row] with row = index / hw (also the dx of the backward with q = 0 ... see gn_bwd_apply).
template <typename T, int N>
__device__ __forceinline__ void apply_body(const T* __restrict__ x, const float* __restrict__ a,
                                           const float* __restrict__ b, T* __restrict__ y, i64 total, i64 hw) {
    const i64 nv = total / N;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < nv; k += (i64)gridDim.x * blockDim.x) {
        const i64 row = k * N / hw;
        const float av = a[row], bv = b[row];
        float v[N];
        load_f32<T, N>(x + k * N, v);
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = v[j] * av + bv;
        store_f32<T, N>(y + k * N, v);
    }
}

template <typename T>
__global__ void gn_apply(const T* __restrict__ x, const float* __restrict__ a, const float* __restrict__ b,
                         T* __restrict__ y, i64 total, i64 hw) {
    constexpr int N = VecT<T>::N;
    if (hw % N == 0 && aligned16(x) && aligned16(y))
        apply_body<T, N>(x, a, b, y, total, hw);
    else
        apply_body<T, 1>(x, a, b, y, total, hw);
}

// One thread per (n, g). With A = sum(dy x), B = sum(dy) per row, M = cpg * hw:
//   sum(g) = sum_c w_c B_c, sum(g xhat) = sum_c w_c rstd (A_c - mean B_c), mg, mgx their means;
//   dx = rstd w_c dy - rstd^2 mgx x + rstd (mean rstd mgx - mg)  ->  p = rstd w_c, q, r per row;
//   dw parts (n, c) = rstd (A_c - mean B_c), db parts (n, c) = B_c (summed over n by column_sum).
extern "C" __global__ void gn_bwd_finalize(const float* __restrict__ p0, const float* __restrict__ p1,
                                           const float* __restrict__ w, const float* __restrict__ mean,
                                           const float* __restrict__ rstd, float* __restrict__ p_out,
                                           float* __restrict__ q_out, float* __restrict__ r_out,
                                           float* __restrict__ dw_part, float* __restrict__ db_part, int n, int c,
                                           int g, long long hw, int splits) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * g) return;
    const int cpg = c / g, gi = t % g;
    const long long row0 = (long long)t * cpg;
    const float mu = mean[t], rs = rstd[t];
    float sg = 0.f, sgx = 0.f;
    for (int j = 0; j < cpg; ++j) {
        float A = 0.f, B = 0.f;
        for (int s = 0; s < splits; ++s) {
            A += p0[(row0 + j) * splits + s];
            B += p1[(row0 + j) * splits + s];
        }
        const int ch = gi * cpg + j;
        const float wc = w ? w[ch] : 1.f, dxh = rs * (A - mu * B);
        sg += wc * B;
        sgx += wc * dxh;
        if (dw_part) dw_part[row0 + j] = dxh;
        if (db_part) db_part[row0 + j] = B;
    }
    const float inv_m = 1.f / (float)((double)cpg * (double)hw);
    const float mg = sg * inv_m, mgx = sgx * inv_m;
    for (int j = 0; j < cpg; ++j) {
        const int ch = gi * cpg + j;
        p_out[row0 + j] = rs * (w ? w[ch] : 1.f);
        q_out[row0 + j] = -rs * rs * mgx;
        r_out[row0 + j] = rs * (mu * rs * mgx - mg);
    }
}

template <typename T, int N>
__device__ __forceinline__ void bwd_apply_body(const T* __restrict__ dy, const T* __restrict__ x,
                                               const float* __restrict__ p, const float* __restrict__ q,
                                               const float* __restrict__ r, T* __restrict__ dx, i64 total, i64 hw) {
    const i64 nv = total / N;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < nv; k += (i64)gridDim.x * blockDim.x) {
        const i64 row = k * N / hw;
        const float pv = p[row], qv = q[row], rv = r[row];
        float d[N], v[N];
        load_f32<T, N>(dy + k * N, d);
        load_f32<T, N>(x + k * N, v);
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = pv * d[j] + qv * v[j] + rv;
        store_f32<T, N>(dx + k * N, v);
    }
}

template <typename T>
__global__ void gn_bwd_apply(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ p,
                             const float* __restrict__ q, const float* __restrict__ r, T* __restrict__ dx, i64 total,
                             i64 hw) {
    constexpr int N = VecT<T>::N;
    if (hw % N == 0 && aligned16(dy) && aligned16(x) && aligned16(dx))
        bwd_apply_body<T, N>(dy, x, p, q, r, dx, total, hw);
    else
        bwd_apply_body<T, 1>(dy, x, p, q, r, dx, total, hw);
}

template <typename T>
__global__ void gn_column_sum(const float* __restrict__ part, T* __restrict__ out, int parts, int cols) {
    column_sum_body<T>(part, out, parts, cols);
}
