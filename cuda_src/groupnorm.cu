// GroupNorm on (N, C, *spatial) contiguous: G groups of C/G channels, statistics in fp32 over each (n, group).
// Every (n, c) channel row of hw elements is split into `splits` chunks so that even a few large groups fill the GPU:
//   forward:  gn_partials (chunk mean, M2) -> gn_fwd_finalize (group mean/rstd, per-row a, b) -> gn_apply y = a x + b
//   backward: gn_partials (chunk sum dy*x, sum dy) -> gn_bwd_finalize (per-row p, q, r; dw/db parts)
//             -> gn_bwd_apply dx = p dy + q x + r; dw, db summed by gn_bwd_finalize's last block (or gn_column_sum).
// Every pass also exists with SiLU fused after the affine (act / ACT 1): y = silu(z), z = a x + b, and the backward
// takes dy of the SiLU output: z is recomputed from x and the saved mean / rstd where dy is read, and
// dz = dy silu'(z) replaces dy in the GroupNorm backward (dz is never stored).
#include "activations.cuh"

// The activation after the affine: ACT 0 none, 1 SiLU.
template <int ACT>
__device__ __forceinline__ float gn_act(float z) {
    if constexpr (ACT == 1) return silu(z);
    return z;
}

// dy of act(z) -> dz, in place, for N values; z = x za + zb.
template <int ACT, int N>
__device__ __forceinline__ void gn_act_grad(float (&d)[N], const float (&x)[N], float za, float zb) {
    if constexpr (ACT == 1) {
#pragma unroll
        for (int j = 0; j < N; ++j) d[j] *= silu_grad(x[j] * za + zb);
    }
}

// The per-row coefficients of z = x za + zb: za = rstd w[ch], zb = bias[ch] - mean za (gn_fwd_finalize's a, b).
__device__ __forceinline__ void z_coefs(float mu, float rs, const float* __restrict__ w,
                                        const float* __restrict__ bias, int ch, float& za, float& zb) {
    za = w ? rs * w[ch] : rs;
    zb = (bias ? bias[ch] : 0.f) - mu * za;
}

__device__ __forceinline__ void chunk_range(i64 hw, int splits, int s, i64& lo, i64& hi, int align) {
    i64 chunk = (hw + splits - 1) / splits;
    chunk = (chunk + align - 1) / align * align;
    lo = (i64)s * chunk;
    hi = lo + chunk < hw ? lo + chunk : hw;
    if (lo > hw) lo = hw;
}

template <typename T, int N, int ACT>
__device__ __forceinline__ void partials_body(const T* __restrict__ x, const T* __restrict__ dy, float* __restrict__ p0,
                                              float* __restrict__ p1, i64 hw, int splits,
                                              const float* __restrict__ mean, const float* __restrict__ rstd,
                                              const float* __restrict__ w, const float* __restrict__ bias, int nch,
                                              int cpg, float* smem) {
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
        float za = 0.f, zb = 0.f;
        if constexpr (ACT != 0) z_coefs(mean[row / cpg], rstd[row / cpg], w, bias, (int)(row % nch), za, zb);
        for (i64 k = threadIdx.x; k < nv; k += blockDim.x) {
            float v[N], d[N];
            load_f32<T, N>(xr + lo + k * N, v);
            load_f32<T, N>(dr + lo + k * N, d);
            gn_act_grad<ACT, N>(d, v, za, zb);
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
// Backward with act 1 (SiLU): dy is of silu(z), and the sums are of dz (z from mean, rstd (N, G), w, bias (C), either
// may be null; rows are (n, c) of C channels, cpg per group); those pointers are not read otherwise.
template <typename T>
__global__ void gn_partials(const T* __restrict__ x, const T* __restrict__ dy, float* __restrict__ p0,
                            float* __restrict__ p1, i64 hw, int splits, const float* __restrict__ mean,
                            const float* __restrict__ rstd, const float* __restrict__ w,
                            const float* __restrict__ bias, int c, int cpg, int act) {
    __shared__ float smem[32];
    constexpr int N = VecT<T>::N;
    const bool vec = hw % N == 0 && aligned16(x) && (dy == nullptr || aligned16(dy));
    if (dy != nullptr && act == 1) {
        if (vec)
            partials_body<T, N, 1>(x, dy, p0, p1, hw, splits, mean, rstd, w, bias, c, cpg, smem);
        else
            partials_body<T, 1, 1>(x, dy, p0, p1, hw, splits, mean, rstd, w, bias, c, cpg, smem);
    } else if (vec) {
        partials_body<T, N, 0>(x, dy, p0, p1, hw, splits, mean, rstd, w, bias, c, cpg, smem);
    } else {
        partials_body<T, 1, 0>(x, dy, p0, p1, hw, splits, mean, rstd, w, bias, c, cpg, smem);
    }
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

// y = act(x * a[row] + b[row]) with row = index / hw.
template <typename T, int N, int ACT>
__device__ __forceinline__ void apply_body(const T* __restrict__ x, const float* __restrict__ a,
                                           const float* __restrict__ b, T* __restrict__ y, i64 total, i64 hw) {
    const i64 nv = total / N;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < nv; k += (i64)gridDim.x * blockDim.x) {
        const i64 row = k * N / hw;
        const float av = a[row], bv = b[row];
        float v[N];
        load_f32<T, N>(x + k * N, v);
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = gn_act<ACT>(v[j] * av + bv);
        store_f32<T, N>(y + k * N, v);
    }
}

template <typename T>
__global__ void gn_apply(const T* __restrict__ x, const float* __restrict__ a, const float* __restrict__ b,
                         T* __restrict__ y, i64 total, i64 hw, int act) {
    constexpr int N = VecT<T>::N;
    const bool vec = hw % N == 0 && aligned16(x) && aligned16(y);
    if (act == 1) {
        if (vec)
            apply_body<T, N, 1>(x, a, b, y, total, hw);
        else
            apply_body<T, 1, 1>(x, a, b, y, total, hw);
    } else if (vec) {
        apply_body<T, N, 0>(x, a, b, y, total, hw);
    } else {
        apply_body<T, 1, 0>(x, a, b, y, total, hw);
    }
}

// Channels-last output: y (N, hw, C) = act(x (N, C, hw) * a + b) with a = rstd[n, g] w[c], b = bias[c] - mean[n, g] a
// (w / bias may be null) - the affine fused with the NCHW -> NHWC transpose that a channels-last consumer (the
// implicit-GEMM convolution) would otherwise make; the statistics come from any forward path (the cluster kernels
// with y null, or gn_partials + gn_fwd_finalize). A tiled transpose of 64 channels x 64 pixels per block: VEC (2-byte
// T, hw and C multiples of 8, 16-byte aligned x and y) reads 8 pixels and writes 8 channels per 16-byte access, else
// one element per access. grid (ceil(hw / 64), ceil(C / 64), N), 256 threads.
template <typename T>
__host__ __device__ constexpr int gn_cl_ld() { return 64 + (sizeof(T) == 2 ? 2 : 1); }  // 2-byte rows of 33 words

template <typename T, int ACT, bool VEC>
__device__ __forceinline__ void apply_cl_body(const T* __restrict__ x, const float* __restrict__ mean,
                                              const float* __restrict__ rstd, const float* __restrict__ w,
                                              const float* __restrict__ bias, T* __restrict__ y, int C, int G,
                                              i64 hw, T* __restrict__ tile) {
    constexpr int LD = gn_cl_ld<T>();
    const i64 l0 = (i64)blockIdx.x * 64;
    const int c0 = blockIdx.y * 64, cpg = C / G;
    const i64 n = blockIdx.z;
    const T* src = x + n * C * hw;
    T* dst = y + n * hw * C;
    auto coef = [&](int c, float& a, float& b) {
        const i64 ng = n * G + c / cpg;
        a = w ? rstd[ng] * w[c] : rstd[ng];
        b = (bias ? bias[c] : 0.f) - mean[ng] * a;
    };
    if constexpr (VEC) {
        constexpr int N = VecT<T>::N;  // 8
        unsigned* t32 = reinterpret_cast<unsigned*>(tile);
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // 64 channels x 8 vectors of 8 pixels; 8 threads read a channel's 128 bytes
            const int i = threadIdx.x + j * 256, cc = i >> 3, v = i & 7, c = c0 + cc;
            const i64 l = l0 + 8 * v;
            if (c < C && l < hw) {
                float a, b, f[N];
                coef(c, a, b);
                load_f32<T, N>(src + (i64)c * hw + l, f);
#pragma unroll
                for (int e = 0; e < N; e += 2)
                    t32[(cc * LD + 8 * v + e) >> 1] = pack2<T>(from_f32<T>(gn_act<ACT>(f[e] * a + b)),
                                                               from_f32<T>(gn_act<ACT>(f[e + 1] * a + b)));
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // 64 pixels x 8 vectors of 8 channels; 8 threads write a pixel's 128 bytes
            const int i = threadIdx.x + j * 256, p = i >> 3, cg = i & 7, c = c0 + 8 * cg;
            const i64 l = l0 + p;
            if (c < C && l < hw) {
                unsigned u[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    u[e] = pack2<T>(tile[(8 * cg + 2 * e) * LD + p], tile[(8 * cg + 2 * e + 1) * LD + p]);
                *reinterpret_cast<uint4*>(dst + l * C + c) = make_uint4(u[0], u[1], u[2], u[3]);
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) {  // all 16 loads in flight at once
            const int i = threadIdx.x + j * 256, cc = i >> 6, ll = i & 63, c = c0 + cc;
            const i64 l = l0 + ll;
            if (c < C && l < hw) {
                float a, b;
                coef(c, a, b);
                tile[cc * LD + ll] = from_f32<T>(gn_act<ACT>(to_f32(src[(i64)c * hw + l]) * a + b));
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int i = threadIdx.x + j * 256, ll = i >> 6, cc = i & 63, c = c0 + cc;
            const i64 l = l0 + ll;
            if (c < C && l < hw) dst[l * C + c] = tile[cc * LD + ll];
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(256) gn_apply_cl(const T* __restrict__ x, const float* __restrict__ mean,
                                                   const float* __restrict__ rstd, const float* __restrict__ w,
                                                   const float* __restrict__ bias, T* __restrict__ y, int C, int G,
                                                   i64 hw, int act, int vec) {
    __shared__ __align__(16) T tile[64 * gn_cl_ld<T>()];
    if constexpr (sizeof(T) == 2) {
        if (vec) {
            if (act == 1)
                apply_cl_body<T, 1, true>(x, mean, rstd, w, bias, y, C, G, hw, tile);
            else
                apply_cl_body<T, 0, true>(x, mean, rstd, w, bias, y, C, G, hw, tile);
            return;
        }
    }
    if (act == 1)
        apply_cl_body<T, 1, false>(x, mean, rstd, w, bias, y, C, G, hw, tile);
    else
        apply_cl_body<T, 0, false>(x, mean, rstd, w, bias, y, C, G, hw, tile);
}

__device__ __forceinline__ void gn_bwd_finalize_one(const float* __restrict__ p0, const float* __restrict__ p1,
                                                    const float* __restrict__ w, const float* __restrict__ mean,
                                                    const float* __restrict__ rstd, float* __restrict__ p_out,
                                                    float* __restrict__ q_out, float* __restrict__ r_out,
                                                    float* __restrict__ dw_part, float* __restrict__ db_part,
                                                    const float* __restrict__ bias, float* __restrict__ za_out,
                                                    float* __restrict__ zb_out, int c, int g, long long hw, int splits,
                                                    int t) {
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
        if (za_out) z_coefs(mu, rs, w, bias, ch, za_out[row0 + j], zb_out[row0 + j]);
    }
}

// One thread per (n, g). With A = sum(dy x), B = sum(dy) per row, M = cpg * hw:
//   sum(g) = sum_c w_c B_c, sum(g xhat) = sum_c w_c rstd (A_c - mean B_c), mg, mgx their means;
//   dx = rstd w_c dy - rstd^2 mgx x + rstd (mean rstd mgx - mg)  ->  p = rstd w_c, q, r per row;
//   dw parts (n, c) = rstd (A_c - mean B_c), db parts (n, c) = B_c, summed over n into dw_out / db_out (fp32) by
//   the last block to finish (last_arrival on counters[0]) where counters is non-null, else by gn_column_sum.
// With SiLU fused (A, B then sums of dz) za_out / zb_out (non-null) get the rows' z = x za + zb for gn_bwd_apply.
extern "C" __global__ void gn_bwd_finalize(const float* __restrict__ p0, const float* __restrict__ p1,
                                           const float* __restrict__ w, const float* __restrict__ mean,
                                           const float* __restrict__ rstd, float* __restrict__ p_out,
                                           float* __restrict__ q_out, float* __restrict__ r_out,
                                           float* __restrict__ dw_part, float* __restrict__ db_part, int n, int c,
                                           int g, long long hw, int splits, float* __restrict__ dw_out,
                                           float* __restrict__ db_out, unsigned* __restrict__ counters,
                                           const float* __restrict__ bias, float* __restrict__ za_out,
                                           float* __restrict__ zb_out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n * g)
        gn_bwd_finalize_one(p0, p1, w, mean, rstd, p_out, q_out, r_out, dw_part, db_part, bias, za_out, zb_out, c, g,
                            hw, splits, t);
    __shared__ int flag;
    if (counters == nullptr || !last_arrival(counters, gridDim.x, &flag)) return;
    if (dw_part)
        sum_rows<4>(dw_part, c, 0, 1, n, 0, c, [&](int col, const float(&v)[4], int k) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < k) dw_out[col + j] = v[j];
        });
    if (db_part)
        sum_rows<4>(db_part, c, 0, 1, n, 0, c, [&](int col, const float(&v)[4], int k) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < k) db_out[col + j] = v[j];
        });
}


template <typename T, int N, int ACT>
__device__ __forceinline__ void bwd_apply_body(const T* __restrict__ dy, const T* __restrict__ x,
                                               const float* __restrict__ p, const float* __restrict__ q,
                                               const float* __restrict__ r, const float* __restrict__ za,
                                               const float* __restrict__ zb, T* __restrict__ dx, i64 total, i64 hw) {
    const i64 nv = total / N;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < nv; k += (i64)gridDim.x * blockDim.x) {
        const i64 row = k * N / hw;
        const float pv = p[row], qv = q[row], rv = r[row];
        float d[N], v[N];
        load_f32<T, N>(dy + k * N, d);
        load_f32<T, N>(x + k * N, v);
        if constexpr (ACT != 0) gn_act_grad<ACT, N>(d, v, za[row], zb[row]);
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = pv * d[j] + qv * v[j] + rv;
        store_f32<T, N>(dx + k * N, v);
    }
}

// dx = p dy + q x + r per row; act 1: dy is of silu(z) and enters as dz, z = x za[row] + zb[row] (gn_bwd_finalize).
template <typename T>
__global__ void gn_bwd_apply(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ p,
                             const float* __restrict__ q, const float* __restrict__ r, const float* __restrict__ za,
                             const float* __restrict__ zb, T* __restrict__ dx, i64 total, i64 hw, int act) {
    constexpr int N = VecT<T>::N;
    const bool vec = hw % N == 0 && aligned16(dy) && aligned16(x) && aligned16(dx);
    if (act == 1) {
        if (vec)
            bwd_apply_body<T, N, 1>(dy, x, p, q, r, za, zb, dx, total, hw);
        else
            bwd_apply_body<T, 1, 1>(dy, x, p, q, r, za, zb, dx, total, hw);
    } else if (vec) {
        bwd_apply_body<T, N, 0>(dy, x, p, q, r, za, zb, dx, total, hw);
    } else {
        bwd_apply_body<T, 1, 0>(dy, x, p, q, r, za, zb, dx, total, hw);
    }
}

template <typename T>
__global__ void gn_column_sum(const float* __restrict__ part, T* __restrict__ out, int parts, int cols) {
    column_sum_body<T>(part, out, parts, cols);
}

// ---------------------------------------------------------------------------------------------- one pass (sm_90)
// A cluster of GN_CL blocks owns one (n, group): the group's M = cpg * hw elements (contiguous) are cut into GN_CL
// slices of S elements (a multiple of the access width), each cached by its block in dynamic shared memory, so x
// (and dy) are read from global memory once and y (dx) written once. The blocks exchange their statistics through
// distributed shared memory (mapa / ld.shared::cluster) between cluster barriers; every block combines them in rank
// order (identical, deterministic results in all of them).
//   dynamic smem (floats): [0, 64) block-reduction scratch | [64, 72) statistics this block publishes |
//   [72, 72 + 4 * GN_CL) the cluster's statistics, gathered | from GN_HEAD bytes: the cached slice(s) (x | dy).
// Block size GN_THREADS; Python checks the device (compute capability >= 9.0) and that GN_HEAD + slices fit.
#define GN_CL 8
#define GN_THREADS 256
#define GN_HEAD 512
#define GN_UNROLL 4

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(gmem) : "memory");
}

// Copies elements [lo, lo + n) of src (n a multiple of N) into the cache; N = VecT<T>::N moves 16-byte words with
// cp.async, every copy of the slice issued before the first wait (the whole slice in flight at once). The caller
// syncs the block before reading the cache.
template <typename T, int N>
__device__ __forceinline__ void cache_slice(const T* __restrict__ src, T* __restrict__ cache, i64 n) {
    const int nv = (int)(n / N), bdim = blockDim.x;
    if constexpr (N > 1) {
        for (int k = threadIdx.x; k < nv; k += bdim) cp_async16(cache + (i64)k * N, src + (i64)k * N);
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
    }
    for (int base = threadIdx.x; base < nv; base += bdim * GN_UNROLL) {
        if constexpr (N == 1) {
            T t[GN_UNROLL];
#pragma unroll
            for (int u = 0; u < GN_UNROLL; ++u)
                if (base + u * bdim < nv) t[u] = src[base + u * bdim];
#pragma unroll
            for (int u = 0; u < GN_UNROLL; ++u)
                if (base + u * bdim < nv) cache[base + u * bdim] = t[u];
        } else {
            uint4 q[GN_UNROLL];
#pragma unroll
            for (int u = 0; u < GN_UNROLL; ++u)
                if (base + u * bdim < nv) q[u] = load_raw16(src + (i64)(base + u * bdim) * N);
#pragma unroll
            for (int u = 0; u < GN_UNROLL; ++u)
                if (base + u * bdim < nv) reinterpret_cast<uint4*>(cache)[base + u * bdim] = q[u];
        }
    }
}

// fp32 values of cached vector k (N elements) / stores N values as vector k of dst.
template <typename T, int N>
__device__ __forceinline__ void cached(const T* __restrict__ cache, int k, float (&v)[N]) {
    if constexpr (N == 1)
        v[0] = to_f32(cache[k]);
    else
        unpack_f32<T>(reinterpret_cast<const uint4*>(cache)[k], v);
}

// f(k, v) for the vectors k = k0 + threadIdx.x, + blockDim.x, ... < k1 of a global array (v: the N fp32 values of
// vector k), GN_UNROLL loads (raw 16-byte words) issued before the first use.
template <typename T, int N, typename F>
__device__ __forceinline__ void stream(const T* __restrict__ src, int k0, int k1, F f) {
    const int bdim = blockDim.x;
    for (int base = k0 + threadIdx.x; base < k1; base += bdim * GN_UNROLL) {
        if constexpr (N == 1) {
            T t[GN_UNROLL];
#pragma unroll
            for (int u = 0; u < GN_UNROLL; ++u)
                if (base + u * bdim < k1) t[u] = src[base + u * bdim];
#pragma unroll
            for (int u = 0; u < GN_UNROLL; ++u)
                if (base + u * bdim < k1) {
                    float v[1] = {to_f32(t[u])};
                    f(base + u * bdim, v);
                }
        } else {
            uint4 q[GN_UNROLL];
#pragma unroll
            for (int u = 0; u < GN_UNROLL; ++u)
                if (base + u * bdim < k1) q[u] = load_raw16(src + (i64)(base + u * bdim) * N);
#pragma unroll
            for (int u = 0; u < GN_UNROLL; ++u)
                if (base + u * bdim < k1) {
                    float v[N];
                    unpack_f32<T>(q[u], v);
                    f(base + u * bdim, v);
                }
        }
    }
}

template <typename T, int N>
__device__ __forceinline__ void put(T* __restrict__ dst, i64 k, const float (&v)[N]) {
    if constexpr (N == 1)
        dst[k] = from_f32<T>(v[0]);
    else
        *reinterpret_cast<uint4*>(dst + k * N) = pack_f32<T>(v);
}

// The slice of cluster rank r: [lo, hi) of the group's m elements; returns S = ceil(ceil(m / GN_CL) / N) * N, the
// slice length of every rank (the last ones may be shorter or empty).
template <int N>
__device__ __forceinline__ i64 slice_of(i64 m, int r, i64& lo, i64& hi) {
    const i64 per = (m + GN_CL - 1) / GN_CL;
    const i64 s = (per + N - 1) / N * N;
    lo = (i64)r * s < m ? (i64)r * s : m;
    hi = lo + s < m ? lo + s : m;
    return s;
}

// The group's mean and M2 from every block's (count, mean, M2 around its mean): published in this block's shared
// memory (sm + 64), gathered from the cluster between barriers (into sm + 72) and combined by Chan's formula in rank
// order (the same numbers in every block). All threads call; the cluster barrier before exit is the caller's
// (cluster_wait after its last read of anything; this leaves one arrive outstanding).
__device__ __forceinline__ void cluster_stats(float cnt, float mb, float q, float* sm, float& mean, float& m2) {
    float* mine = sm + 64;
    float* all = sm + 72;
    if (threadIdx.x == 0) {
        mine[0] = cnt;
        mine[1] = mb;
        mine[2] = q;
    }
    cluster_arrive();
    cluster_wait();  // every block has published
    if (threadIdx.x < 3 * GN_CL) all[threadIdx.x] = cluster_load(mine + threadIdx.x % 3, threadIdx.x / 3);
    __syncthreads();
    cluster_arrive();  // done reading the others' shared memory (waited for before exit)
    float n = 0.f;  // Chan's combination, in rank order
    mean = m2 = 0.f;
    for (int rr = 0; rr < GN_CL; ++rr) {
        const float nb = all[3 * rr];
        if (nb > 0.f) {
            const float tot = n + nb, delta = all[3 * rr + 1] - mean;
            mean += delta * (nb / tot);
            m2 += all[3 * rr + 2] + delta * delta * (n * nb / tot);
            n = tot;
        }
    }
}

// Part-row entries of the group's channels that this block's slice [c0, c1] does not touch are 0.
__device__ __forceinline__ void zero_other_channels(float* __restrict__ dw_part, float* __restrict__ db_part, i64 prow,
                                                    int cpg, int c0, int c1) {
    for (int cl = threadIdx.x; cl < cpg; cl += blockDim.x)
        if (cl < c0 || cl > c1) {
            if (dw_part) dw_part[prow + cl] = 0.f;
            if (db_part) db_part[prow + cl] = 0.f;
        }
}

// The backward's per-channel step: the thread's sums a (dy * xhat) and b (dy) of channel `col` enter its running
// tg += w b, tgx += w a; with weight / bias gradients wanted (parts) the block's sums go to part row entry `col`.
__device__ __forceinline__ void channel_sums(float a, float b, float wc, float& tg, float& tgx, bool parts,
                                             float* __restrict__ dw_part, float* __restrict__ db_part, i64 col,
                                             float* scratch) {
    tg += wc * b;
    tgx += wc * a;
    if (parts) {
        block_sum2(a, b, scratch);
        if (threadIdx.x == 0) {
            if (dw_part) dw_part[col] = a;
            if (db_part) db_part[col] = b;
        }
    }
}

// The cluster's sums of two per-thread values (every block gets them, added in rank order): block sums published in
// this block's shared memory (sm + 64), gathered between cluster barriers (into sm + 72). Leaves one cluster arrive
// outstanding, as cluster_stats.
__device__ __forceinline__ void cluster_sums2(float a, float b, float* sm, float& sa, float& sb) {
    float* mine = sm + 64;
    float* all = sm + 72;
    block_sum2(a, b, sm);
    if (threadIdx.x == 0) {
        mine[0] = a;
        mine[1] = b;
    }
    cluster_arrive();
    cluster_wait();  // every block has published
    if (threadIdx.x < 2 * GN_CL) all[threadIdx.x] = cluster_load(mine + (threadIdx.x & 1), threadIdx.x >> 1);
    __syncthreads();
    cluster_arrive();  // done reading the others' shared memory (waited for before exit)
    sa = sb = 0.f;
    for (int rr = 0; rr < GN_CL; ++rr) {
        sa += all[2 * rr];
        sb += all[2 * rr + 1];
    }
}

// s += sum(v - c), s2 += sum((v - c)^2) over the cached vectors k = k0 + threadIdx.x, + blockDim.x, ... < k1.
template <typename T, int N>
__device__ __forceinline__ void shifted_sums(const T* __restrict__ cache, int k0, int k1, float c, float& s,
                                             float& s2) {
    for (int k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
        float v[N];
        cached<T, N>(cache, k, v);
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float d = v[j] - c;
            s += d;
            s2 += d * d;
        }
    }
}

// Waits until at most n of this thread's cp.async commit groups are pending (n: 0 .. 3, a constant once unrolled).
__device__ __forceinline__ void cp_async_wait_pending(int n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    }
}

// cache_slice for the 16-byte path in GN_CHUNKS commit groups, and as each group lands the thread's sums of (v - c)
// and (v - c)^2 over the vectors it copied itself (its own cp.async writes are visible to it after the wait; the
// others' only after a block barrier): the statistics are done when the last copy lands.
#define GN_CHUNKS 4  // <= 4 (cp_async_wait_pending)
template <typename T, int N>
__device__ __forceinline__ void cache_slice_sums(const T* __restrict__ src, T* __restrict__ cache, int nv, float c,
                                                 float& s, float& s2) {
#pragma unroll
    for (int ch = 0; ch < GN_CHUNKS; ++ch) {
        const int k1 = (int)((i64)nv * (ch + 1) / GN_CHUNKS);
        for (int k = (int)((i64)nv * ch / GN_CHUNKS) + threadIdx.x; k < k1; k += blockDim.x)
            cp_async16(cache + (i64)k * N, src + (i64)k * N);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
#pragma unroll
    for (int ch = 0; ch < GN_CHUNKS; ++ch) {
        cp_async_wait_pending(GN_CHUNKS - 1 - ch);
        shifted_sums<T, N>(cache, (int)((i64)nv * ch / GN_CHUNKS), (int)((i64)nv * (ch + 1) / GN_CHUNKS), c, s, s2);
    }
}

// y = act((x - mean) * rstd * w[c] + bias[c]) over the group of this cluster. STATS: the block statistics in two
// passes over the cache (0), in one pass after it is loaded (1) or as it loads (2, cache_slice_sums; 16-byte path).
template <typename T, int N, int STATS, int ACT>
__device__ __forceinline__ void gn_fwd_cluster_body(const T* __restrict__ x, const float* __restrict__ w,
                                                    const float* __restrict__ bias, T* __restrict__ y,
                                                    float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                                    int groups, int cpg, i64 hw, float eps, float* sm) {
    const int r = blockIdx.x % GN_CL;
    const i64 grp = blockIdx.x / GN_CL, m = (i64)cpg * hw;
    const int gi = (int)(grp % groups);
    i64 lo, hi;
    slice_of<N>(m, r, lo, hi);
    const int cnt = (int)(hi - lo), nv = cnt / N;
    float* scratch = sm;
    T* cache = reinterpret_cast<T*>(reinterpret_cast<char*>(sm) + GN_HEAD);
    constexpr bool AS_IT_LOADS = STATS == 2 && N > 1;
    if constexpr (!AS_IT_LOADS) {
        cache_slice<T, N>(x + grp * m + lo, cache, cnt);
        __syncthreads();
    }
    // this block's count, mean and M2: around its own mean (two passes over the cache), or (STATS 1, 2) from the sums
    // of (x - c) and (x - c)^2 around c = the slice's first element (one pass)
    float mb, q;
    if constexpr (STATS != 0) {
        float s = 0.f, s2 = 0.f, c;
        if constexpr (AS_IT_LOADS) {
            c = cnt > 0 ? to_f32(x[grp * m + lo]) : 0.f;
            cache_slice_sums<T, N>(x + grp * m + lo, cache, nv, c, s, s2);
        } else {
            c = cnt > 0 ? to_f32(cache[0]) : 0.f;
            shifted_sums<T, N>(cache, 0, nv, c, s, s2);
        }
        block_sum2(s, s2, scratch);  // its first barrier: every thread's copies have landed (the cache is whole)
        const float md = cnt > 0 ? s / (float)cnt : 0.f;
        mb = c + md;
        q = cnt > 0 ? fmaxf(s2 - s * md, 0.f) : 0.f;
    } else {
        float s = 0.f;
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float v[N];
            cached<T, N>(cache, k, v);
#pragma unroll
            for (int j = 0; j < N; ++j) s += v[j];
        }
        s = block_sum(s, scratch);
        mb = cnt > 0 ? s / (float)cnt : 0.f;
        q = 0.f;
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float v[N];
            cached<T, N>(cache, k, v);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const float d = v[j] - mb;
                q += d * d;
            }
        }
        q = block_sum(q, scratch);
    }
    float mean, m2;
    cluster_stats((float)cnt, mb, q, sm, mean, m2);
    const float rs = rsqrtf(m2 / (float)m + eps);
    if (r == 0 && threadIdx.x == 0) {
        mean_out[grp] = mean;
        rstd_out[grp] = rs;
    }
    if (y == nullptr) {  // statistics only (a channels-last output is written by gn_apply_cl)
        cluster_wait();
        return;
    }
    T* ys = y + grp * m + lo;
    const int c0 = (int)(lo / hw), c1 = cnt > 0 ? (int)((hi - 1) / hw) : c0 - 1;
    for (int cl = c0; cl <= c1; ++cl) {  // channel by channel: y = x * a + b
        const int ch = gi * cpg + cl;
        const float a = w ? rs * w[ch] : rs;
        const float b = (bias ? bias[ch] : 0.f) - mean * a;
        const i64 slo = max((i64)cl * hw, lo), shi = min((i64)(cl + 1) * hw, hi);  // channel cl within the slice
        const int k1 = (int)((shi - lo) / N);
        for (int k = (int)((slo - lo) / N) + threadIdx.x; k < k1; k += blockDim.x) {
            float v[N];
            cached<T, N>(cache, k, v);
#pragma unroll
            for (int j = 0; j < N; ++j) v[j] = gn_act<ACT>(v[j] * a + b);
            put<T, N>(ys, k, v);
        }
    }
    cluster_wait();
}

// dx of the group of this cluster (mean / rstd given). Only x is cached (GN_HEAD + S * sizeof(T) bytes, as the
// forward: 5 blocks per SM, every cluster of the SDXL shapes resident at once); dy is streamed from global memory
// twice (the second read mostly hits L2). dw_part / db_part (fp32, (n * GN_CL, C)), either may be null:
// row n * GN_CL + r holds this block's sums of dy * xhat / dy for the channels of its group (0 where its slice has none
// of a channel). counters non-null (G of them): the last block of group g to finish (last_arrival on counters[g],
// over all n) sums the group's columns of those rows in row order into dw_out / db_out (T, or fp32 where of32) in
// the same launch; else gn_column_sum sums the rows afterwards.
template <typename T, int N, int ACT>
__device__ __forceinline__ void gn_bwd_cluster_body(const T* __restrict__ dy, const T* __restrict__ x,
                                                    const float* __restrict__ w, const float* __restrict__ bias,
                                                    const float* __restrict__ mean,
                                                    const float* __restrict__ rstd, T* __restrict__ dx,
                                                    float* __restrict__ dw_part, float* __restrict__ db_part,
                                                    int groups, int cpg, i64 hw, float* sm, void* __restrict__ dw_out,
                                                    void* __restrict__ db_out, unsigned* __restrict__ counters,
                                                    int of32) {
    const int r = blockIdx.x % GN_CL;
    const i64 grp = blockIdx.x / GN_CL, m = (i64)cpg * hw;
    const int gi = (int)(grp % groups);
    i64 lo, hi;
    slice_of<N>(m, r, lo, hi);
    const int cnt = (int)(hi - lo);
    float* scratch = sm;
    T* cx = reinterpret_cast<T*>(reinterpret_cast<char*>(sm) + GN_HEAD);
    const T* dys = dy + grp * m + lo;
    cache_slice<T, N>(x + grp * m + lo, cx, cnt);
    __syncthreads();
    const float mu = mean[grp], rs = rstd[grp];
    const bool parts = dw_part != nullptr || db_part != nullptr;
    const i64 prow = ((grp / groups) * GN_CL + r) * ((i64)groups * cpg) + (i64)gi * cpg;  // the group's columns
    const int c0 = (int)(lo / hw), c1 = cnt > 0 ? (int)((hi - 1) / hw) : c0 - 1;
    if (parts) zero_other_channels(dw_part, db_part, prow, cpg, c0, c1);
    float tg = 0.f, tgx = 0.f;  // this thread's sums of g = dy * w and g * xhat
    for (int cl = c0; cl <= c1; ++cl) {
        const float wc = w ? w[gi * cpg + cl] : 1.f;
        float za = 0.f, zb = 0.f;
        if constexpr (ACT != 0) z_coefs(mu, rs, w, bias, gi * cpg + cl, za, zb);
        const i64 slo = max((i64)cl * hw, lo), shi = min((i64)(cl + 1) * hw, hi);  // channel cl within the slice
        const int k1 = (int)((shi - lo) / N);
        float a = 0.f, b = 0.f;  // sums of dy * xhat, dy (dz for dy with ACT)
        stream<T, N>(dys, (int)((slo - lo) / N), k1, [&](int k, const float(&dv0)[N]) {
            float xv[N], dv[N];
            cached<T, N>(cx, k, xv);
#pragma unroll
            for (int j = 0; j < N; ++j) dv[j] = dv0[j];
            gn_act_grad<ACT, N>(dv, xv, za, zb);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                a += dv[j] * ((xv[j] - mu) * rs);
                b += dv[j];
            }
        });
        channel_sums(a, b, wc, tg, tgx, parts, dw_part, db_part, prow + cl, scratch);
    }
    float sg, sgx;
    cluster_sums2(tg, tgx, sm, sg, sgx);
    const float inv_m = 1.f / (float)m, mg = sg * inv_m, mgx = sgx * inv_m;
    T* dxs = dx + grp * m + lo;
    for (int cl = c0; cl <= c1; ++cl) {
        const float wc = w ? w[gi * cpg + cl] : 1.f;
        float za = 0.f, zb = 0.f;
        if constexpr (ACT != 0) z_coefs(mu, rs, w, bias, gi * cpg + cl, za, zb);
        const i64 slo = max((i64)cl * hw, lo), shi = min((i64)(cl + 1) * hw, hi);  // channel cl within the slice
        const int k1 = (int)((shi - lo) / N);
        stream<T, N>(dys, (int)((slo - lo) / N), k1, [&](int k, const float(&dv0)[N]) {
            float xv[N], dv[N];
            cached<T, N>(cx, k, xv);
#pragma unroll
            for (int j = 0; j < N; ++j) dv[j] = dv0[j];
            gn_act_grad<ACT, N>(dv, xv, za, zb);
#pragma unroll
            for (int j = 0; j < N; ++j) xv[j] = rs * (dv[j] * wc - mg - (xv[j] - mu) * rs * mgx);
            put<T, N>(dxs, k, xv);
        });
    }
    cluster_wait();
    if (counters == nullptr || !parts) return;
    // the last of the group's n * GN_CL blocks (over all n) sums its part rows into the group's columns
    __shared__ int flag;
    const int n = (int)(gridDim.x / ((unsigned)groups * GN_CL)), ld = groups * cpg, col0 = gi * cpg;
    if (!last_arrival(counters + gi, (unsigned)n * GN_CL, &flag)) return;
    if (dw_part)
        sum_rows<4>(dw_part, ld, 0, 1, n * GN_CL, col0, col0 + cpg, [&](int col, const float(&v)[4], int k) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < k) store_any1<T>(dw_out, col + j, v[j], of32);
        });
    if (db_part)
        sum_rows<4>(db_part, ld, 0, 1, n * GN_CL, col0, col0 + cpg, [&](int col, const float(&v)[4], int k) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < k) store_any1<T>(db_out, col + j, v[j], of32);
        });
}

// Grid: (N * G * GN_CL) blocks of GN_THREADS, CL = GN_CL (a template argument so that the per-dtype module of this
// file, compiled for any GPU, does not contain it: Python asks for "gn_fwd_cluster<T, 8>" on sm_90+ only).
// Dynamic smem: GN_HEAD + S * sizeof(T) bytes (forward and backward: x only).
// ONE: the block statistics in two passes over the cache (0), one pass (1) or one pass as it loads (2); see
// gn_fwd_cluster_body. ACT: the activation after the affine (0 none, 1 SiLU; the backward's dy is then of its output,
// and bias enters z; the backward does not read bias with ACT 0).
template <typename T, int CL, int ONE, int ACT>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(GN_THREADS)
    gn_fwd_cluster(const T* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                   T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int groups, int cpg,
                   i64 hw, float eps) {
    static_assert(CL == GN_CL, "the cluster size is GN_CL");
    extern __shared__ __align__(16) float gn_sm[];
    constexpr int N = VecT<T>::N;
    if (hw % N == 0 && aligned16(x) && aligned16(y))
        gn_fwd_cluster_body<T, N, ONE, ACT>(x, w, bias, y, mean_out, rstd_out, groups, cpg, hw, eps, gn_sm);
    else
        gn_fwd_cluster_body<T, 1, ONE, ACT>(x, w, bias, y, mean_out, rstd_out, groups, cpg, hw, eps, gn_sm);
}

template <typename T, int CL, int ACT>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(GN_THREADS)
    gn_bwd_cluster(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ w,
                   const float* __restrict__ bias, const float* __restrict__ mean, const float* __restrict__ rstd,
                   T* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, int groups, int cpg,
                   i64 hw, void* __restrict__ dw_out, void* __restrict__ db_out, unsigned* __restrict__ counters,
                   int of32) {
    static_assert(CL == GN_CL, "the cluster size is GN_CL");
    extern __shared__ __align__(16) float gn_sm[];
    constexpr int N = VecT<T>::N;
    if (hw % N == 0 && aligned16(dy) && aligned16(x) && aligned16(dx))
        gn_bwd_cluster_body<T, N, ACT>(dy, x, w, bias, mean, rstd, dx, dw_part, db_part, groups, cpg, hw, gn_sm,
                                       dw_out, db_out, counters, of32);
    else
        gn_bwd_cluster_body<T, 1, ACT>(dy, x, w, bias, mean, rstd, dx, dw_part, db_part, groups, cpg, hw, gn_sm,
                                       dw_out, db_out, counters, of32);
}
// ---------------------------------------------------------------------------------------------- register slices
// The same one-pass cluster scheme with the slice in registers instead of shared memory (16-byte vector path only:
// hw % N == 0, 16-byte aligned pointers; slices of <= V * GN_THREADS vectors). Thread t holds vectors t, t +
// GN_THREADS, ... of its block's slice as raw 16-byte words.
//   forward (gn_fwd_cluster_reg): x in registers; the block's statistics in one pass over them, as sums of (x - c) and
//     (x - c)^2 around c = the slice's first element (then count, mean, M2 for cluster_stats); no shared-memory cache.
//   backward (gn_bwd_cluster_reg): x cached in shared memory as in gn_bwd_cluster, dy in registers: dy is read from
//     global memory once (gn_bwd_cluster reads it twice).
template <int V>
__device__ __forceinline__ void load_slice(const uint4* __restrict__ src, int nv, uint4 (&q)[V]) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int k = (int)threadIdx.x + i * GN_THREADS;
        q[i] = k < nv ? src[k] : make_uint4(0u, 0u, 0u, 0u);
    }
}

template <typename T, int V, int ACT>
__device__ __forceinline__ void gn_fwd_reg_body(const T* __restrict__ x, const float* __restrict__ w,
                                                const float* __restrict__ bias, T* __restrict__ y,
                                                float* __restrict__ mean_out, float* __restrict__ rstd_out, int groups,
                                                int cpg, i64 hw, float eps, float* sm) {
    constexpr int N = VecT<T>::N;
    const int r = blockIdx.x % GN_CL;
    const i64 grp = blockIdx.x / GN_CL, m = (i64)cpg * hw;
    const int gi = (int)(grp % groups);
    i64 lo, hi;
    slice_of<N>(m, r, lo, hi);
    const int cnt = (int)(hi - lo), nv = cnt / N;
    const T* xs = x + grp * m + lo;
    uint4 q[V];
    load_slice<V>(reinterpret_cast<const uint4*>(xs), nv, q);
    const float c = cnt > 0 ? to_f32(xs[0]) : 0.f;
    float s = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i)
        if ((int)threadIdx.x + i * GN_THREADS < nv) {
            float v[N];
            unpack_f32<T>(q[i], v);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const float d = v[j] - c;
                s += d;
                s2 += d * d;
            }
        }
    block_sum2(s, s2, sm);
    const float fc = (float)cnt, mb = cnt > 0 ? s / fc : 0.f;
    float mean, m2;
    cluster_stats(fc, c + mb, cnt > 0 ? fmaxf(s2 - s * mb, 0.f) : 0.f, sm, mean, m2);
    const float rs = rsqrtf(m2 / (float)m + eps);
    if (r == 0 && threadIdx.x == 0) {
        mean_out[grp] = mean;
        rstd_out[grp] = rs;
    }
    if (y == nullptr) {  // statistics only
        cluster_wait();
        return;
    }
    T* ys = y + grp * m + lo;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int k = (int)threadIdx.x + i * GN_THREADS;
        if (k < nv) {
            const int ch = gi * cpg + (int)((unsigned)(lo + k * N) / (unsigned)hw);  // m < 2^31 on this path
            const float a = w ? rs * w[ch] : rs;
            const float b = (bias ? bias[ch] : 0.f) - mean * a;
            float v[N];
            unpack_f32<T>(q[i], v);
#pragma unroll
            for (int j = 0; j < N; ++j) v[j] = gn_act<ACT>(v[j] * a + b);
            put<T, N>(ys, k, v);
        }
    }
    cluster_wait();
}

template <typename T, int V, int ACT>
__device__ __forceinline__ void gn_bwd_reg_body(const T* __restrict__ dy, const T* __restrict__ x,
                                                const float* __restrict__ w, const float* __restrict__ bias,
                                                const float* __restrict__ mean,
                                                const float* __restrict__ rstd, T* __restrict__ dx,
                                                float* __restrict__ dw_part, float* __restrict__ db_part, int groups,
                                                int cpg, i64 hw, float* sm) {
    constexpr int N = VecT<T>::N;
    const int r = blockIdx.x % GN_CL;
    const i64 grp = blockIdx.x / GN_CL, m = (i64)cpg * hw;
    const int gi = (int)(grp % groups);
    i64 lo, hi;
    slice_of<N>(m, r, lo, hi);
    const int cnt = (int)(hi - lo), nv = cnt / N;
    float* scratch = sm;
    T* cx = reinterpret_cast<T*>(reinterpret_cast<char*>(sm) + GN_HEAD);
    for (int k = threadIdx.x; k < nv; k += GN_THREADS) cp_async16(cx + (i64)k * N, x + grp * m + lo + (i64)k * N);
    uint4 q[V];
    load_slice<V>(reinterpret_cast<const uint4*>(dy + grp * m + lo), nv, q);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    const float mu = mean[grp], rs = rstd[grp];
    const bool parts = dw_part != nullptr || db_part != nullptr;
    const i64 prow = ((grp / groups) * GN_CL + r) * ((i64)groups * cpg) + (i64)gi * cpg;  // the group's columns
    const int c0 = (int)(lo / hw), c1 = cnt > 0 ? (int)((hi - 1) / hw) : c0 - 1;
    if (parts) zero_other_channels(dw_part, db_part, prow, cpg, c0, c1);
    float tg = 0.f, tgx = 0.f;  // this thread's sums of g = dy * w and g * xhat
    for (int cl = c0; cl <= c1; ++cl) {
        opaque<V>(q);  // unpacked per channel, not held as 2x the fp32 registers
        const float wc = w ? w[gi * cpg + cl] : 1.f;
        float za = 0.f, zb = 0.f;
        if constexpr (ACT != 0) z_coefs(mu, rs, w, bias, gi * cpg + cl, za, zb);
        const i64 slo = max((i64)cl * hw, lo), shi = min((i64)(cl + 1) * hw, hi);  // channel cl within the slice
        const int k0 = (int)((slo - lo) / N), k1 = (int)((shi - lo) / N);
        float a = 0.f, b = 0.f;  // sums of dy * xhat, dy
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int k = (int)threadIdx.x + i * GN_THREADS;
            if (k >= k0 && k < k1) {
                float dv[N], xv[N];
                unpack_f32<T>(q[i], dv);
                cached<T, N>(cx, k, xv);
                gn_act_grad<ACT, N>(dv, xv, za, zb);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    a += dv[j] * ((xv[j] - mu) * rs);
                    b += dv[j];
                }
            }
        }
        channel_sums(a, b, wc, tg, tgx, parts, dw_part, db_part, prow + cl, scratch);
    }
    float sg, sgx;
    cluster_sums2(tg, tgx, sm, sg, sgx);
    const float inv_m = 1.f / (float)m, mg = sg * inv_m, mgx = sgx * inv_m;
    T* dxs = dx + grp * m + lo;
    opaque<V>(q);
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int k = (int)threadIdx.x + i * GN_THREADS;
        if (k < nv) {
            const int ch = gi * cpg + (int)((unsigned)(lo + k * N) / (unsigned)hw);
            const float wc = w ? w[ch] : 1.f;
            float dv[N], xv[N];
            unpack_f32<T>(q[i], dv);
            cached<T, N>(cx, k, xv);
            if constexpr (ACT != 0) {
                float za, zb;
                z_coefs(mu, rs, w, bias, ch, za, zb);
                gn_act_grad<ACT, N>(dv, xv, za, zb);
            }
#pragma unroll
            for (int j = 0; j < N; ++j) xv[j] = rs * (dv[j] * wc - mg - (xv[j] - mu) * rs * mgx);
            put<T, N>(dxs, k, xv);
        }
    }
    cluster_wait();
}

// Grid and block as gn_fwd_cluster / gn_bwd_cluster; V: register slots per thread (Python: the smallest instantiated
// V with V * GN_THREADS >= the slice's vectors), ACT as gn_fwd_cluster / gn_bwd_cluster. Dynamic smem: forward
// GN_HEAD bytes, backward GN_HEAD + S * sizeof(T).
template <typename T, int V, int ACT>
__global__ void __cluster_dims__(GN_CL, 1, 1) __launch_bounds__(GN_THREADS, 4)
    gn_fwd_cluster_reg(const T* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                       T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int groups,
                       int cpg, i64 hw, float eps) {
    extern __shared__ __align__(16) float gn_sm[];
    gn_fwd_reg_body<T, V, ACT>(x, w, bias, y, mean_out, rstd_out, groups, cpg, hw, eps, gn_sm);
}

template <typename T, int V, int ACT>
__global__ void __cluster_dims__(GN_CL, 1, 1) __launch_bounds__(GN_THREADS, 4)
    gn_bwd_cluster_reg(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ w,
                       const float* __restrict__ bias, const float* __restrict__ mean, const float* __restrict__ rstd,
                       T* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, int groups,
                       int cpg, i64 hw) {
    extern __shared__ __align__(16) float gn_sm[];
    gn_bwd_reg_body<T, V, ACT>(dy, x, w, bias, mean, rstd, dx, dw_part, db_part, groups, cpg, hw, gn_sm);
}
#endif  // sm_90
