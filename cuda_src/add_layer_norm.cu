// The residual add fused with the norm after it (a pre-norm transformer's x = x + f(...); h = norm(x)), one kernel
// each way over contiguous (rows, D) arrays:
//   forward:  s = x + r (rounded to T, written), y = layer_norm(s) w + b (or rms_norm(s) w with rms = 1), and the
//             row statistics (mean, rstd fp32) for the backward;
//   backward: dsum = norm_backward(dy) + ds (ds may be null): the gradient of x and of r alike.
// The statistics normalise s AS ROUNDED to T, so y equals add-then-layer_norm up to the reduction order. Math in
// fp32, two-pass variance from the row cached in registers; y = ((s - mean) rstd) w + b as the norms.cu kernels
// round it. A gain / bias is T or fp32 (wf32 = 1) or absent (null). Weight / bias gradients are not formed here
// (flame_core/kernels/add_layer_norm.py sums them with array ops when asked).
//
// Rows are handled by groups of G threads (a power of two <= 256; G <= 32: several rows per block, shuffle
// reductions; G > 32: one row per block of G threads, block reductions), N elements per thread and step (vec = 1:
// one 16-byte vector, N = 16 / sizeof(T), when every row start is 16-byte aligned; else N = 1), 16 / N steps (16
// values cached per thread), so D <= 16 G <= 4096. Each block walks row blocks b, b + gridDim.x, ... (the loop
// bound is uniform over the block: the shuffles see full warps, the barriers every thread).
#include "row_gain.cuh"

template <typename T, int N>
__device__ __forceinline__ void aln_fwd_body(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ s,
                                             T* __restrict__ y, float* __restrict__ mean_out,
                                             float* __restrict__ rstd_out, const void* __restrict__ wp,
                                             const void* __restrict__ bp, i64 rows, int D, int G, float eps,
                                             int wf32, int rms) {
    constexpr int K = N >= 16 ? 1 : 16 / N;
    __shared__ float smem[32];
    const int t = threadIdx.x % G, rpb = blockDim.x / G;
    for (i64 base = (i64)blockIdx.x * rpb; base < rows; base += (i64)gridDim.x * rpb) {
        const i64 row = base + threadIdx.x / G;
        const bool valid = row < rows;
        const i64 off = (valid ? row : 0) * D;
        float v[K][N];
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
#pragma unroll
            for (int j = 0; j < N; ++j) v[k][j] = 0.f;
            if (valid && c < D) {
                float a[N], b[N];
                load_f32<T, N>(x + off + c, a);
                load_f32<T, N>(r + off + c, b);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    v[k][j] = to_f32(from_f32<T>(a[j] + b[j]));  // s as stored: the norm sees the rounded sum
                    sum += v[k][j];
                }
                store_f32<T, N>(s + off + c, v[k]);
            }
        }
        float mean = 0.f;
        if (!rms) mean = group_sum(sum, G, smem) / D;
        float sq = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (valid && c < D) {
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const float d = v[k][j] - mean;
                    sq += d * d;
                }
            }
        }
        const float rs = rsqrtf(group_sum(sq, G, smem) / D + eps);
        if (!valid) continue;
        if (t == 0 && rstd_out) {
            rstd_out[row] = rs;
            if (mean_out) mean_out[row] = mean;
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (c < D) {
                float o[N];
#pragma unroll
                for (int j = 0; j < N; ++j) o[j] = (v[k][j] - mean) * rs;
                mul_gain<T, N>(wp, c, wf32, o);
                if (bp) {
                    float b[N];
                    load_any<T, N>(bp, c, wf32, b);
#pragma unroll
                    for (int j = 0; j < N; ++j) o[j] += b[j];
                }
                store_f32<T, N>(y + off + c, o);
            }
        }
    }
}

// dsum = rstd (g - mean(g) - xhat mean(g xhat)) + ds, g = dy w, xhat = (s - mean) rstd with the forward's statistics
// (rms: no mean terms).
template <typename T, int N>
__device__ __forceinline__ void aln_bwd_body(const T* __restrict__ dy, const T* __restrict__ s,
                                             const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                             const T* __restrict__ ds, T* __restrict__ dsum,
                                             const void* __restrict__ wp, i64 rows, int D, int G, int wf32) {
    constexpr int K = N >= 16 ? 1 : 16 / N;
    __shared__ float smem[32];
    const int t = threadIdx.x % G, rpb = blockDim.x / G;
    for (i64 base = (i64)blockIdx.x * rpb; base < rows; base += (i64)gridDim.x * rpb) {
        const i64 row = base + threadIdx.x / G;
        const bool valid = row < rows;
        const i64 rr = valid ? row : 0, off = rr * D;
        const float mu = mean_in ? mean_in[rr] : 0.f, rs = rstd_in[rr];
        float gw[K][N], xh[K][N];
        float sg = 0.f, sgx = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (valid && c < D) {
                load_f32<T, N>(dy + off + c, gw[k]);
                load_f32<T, N>(s + off + c, xh[k]);
                mul_gain<T, N>(wp, c, wf32, gw[k]);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    xh[k][j] = (xh[k][j] - mu) * rs;
                    sg += gw[k][j];
                    sgx += gw[k][j] * xh[k][j];
                }
            }
        }
        const float dot = group_sum(sgx, G, smem) / D;
        const float gm = mean_in ? group_sum(sg, G, smem) / D : 0.f;
        if (!valid) continue;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (c < D) {
                float o[N];
#pragma unroll
                for (int j = 0; j < N; ++j) o[j] = rs * (gw[k][j] - gm - xh[k][j] * dot);
                if (ds) {
                    float d[N];
                    load_f32<T, N>(ds + off + c, d);
#pragma unroll
                    for (int j = 0; j < N; ++j) o[j] += d[j];
                }
                store_f32<T, N>(dsum + off + c, o);
            }
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(256) add_layer_norm_fwd(const T* __restrict__ x, const T* __restrict__ r,
                                                          T* __restrict__ s, T* __restrict__ y, float* mean_out,
                                                          float* rstd_out, const void* w, const void* b, i64 rows,
                                                          int D, int G, float eps, int wf32, int rms, int vec) {
    if (vec)
        aln_fwd_body<T, VecT<T>::N>(x, r, s, y, mean_out, rstd_out, w, b, rows, D, G, eps, wf32, rms);
    else
        aln_fwd_body<T, 1>(x, r, s, y, mean_out, rstd_out, w, b, rows, D, G, eps, wf32, rms);
}

template <typename T>
__global__ void __launch_bounds__(256) add_layer_norm_bwd(const T* __restrict__ dy, const T* __restrict__ s,
                                                          const float* mean_in, const float* rstd_in,
                                                          const T* __restrict__ ds, T* __restrict__ dsum,
                                                          const void* w, i64 rows, int D, int G, int wf32, int vec) {
    if (vec)
        aln_bwd_body<T, VecT<T>::N>(dy, s, mean_in, rstd_in, ds, dsum, w, rows, D, G, wf32);
    else
        aln_bwd_body<T, 1>(dy, s, mean_in, rstd_in, ds, dsum, w, rows, D, G, wf32);
}
