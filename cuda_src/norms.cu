// LayerNorm and RMSNorm over the last dim (forward + backward), and the column sums of their weight gradients.
// Statistics and math in fp32; weight / bias are T or fp32 (wf32 = 1). Rows are handled by row groups of `tpr`
// threads: a power of two <= 32 (several rows per warp, shuffle reductions) or a multiple of 32 (its warps reduce
// through shared memory behind a named barrier, so a block may hold several such groups: rpb = blockDim.x / tpr <=
// NORM_MAX_RPB). Each thread caches up to VPT (1, 2 or 4: one kernel each) vectors of its row in registers (one read
// of x); rows wider than tpr * VPT * N take the looping path (x re-read from cache, one row group per block).
//
// Blocks are persistent: block b handles row blocks b, b + gridDim.x, ... (any grid works; the Python side sizes it
// to the blocks that fit on the GPU at once). On the 16-byte vector path each row group loads its next row (raw
// 16-byte vectors in registers) before it reduces and writes the current one, so loads stay in flight through the
// reductions.
#include "common.cuh"

#define NORM_MAX_RPB 8  // row groups of > 32 threads per block (named barriers 1 .. 8); Python keeps to it
// The kernels below are thin template wrappers (one per VPT / ACC, so that each has its own name for the loader)
// around norm_fwd_impl / norm_fwdv_impl / norm_bwd_impl; their shared parameter lists:
#define NORM_FWD_PARAMS const T* __restrict__ x, const void* __restrict__ w, const void* __restrict__ b, \
    T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, i64 rows, int cols, float eps, int tpr, \
    int rms, int wf32
#define NORM_FWD_ARGS x, w, b, y, mean, rstd, rows, cols, eps, tpr, rms, wf32
#define NORM_BWD_PARAMS const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w, \
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx, \
    const T* __restrict__ dres, float* __restrict__ dw_part, \
    float* __restrict__ db_part, i64 rows, int cols, int tpr, int rms, int wf32, void* __restrict__ dw_out, \
    void* __restrict__ db_out, unsigned* __restrict__ counters, int group, int of32
#define NORM_BWD_ARGS dy, x, w, mean, rstd, dx, dres, dw_part, db_part, rows, cols, tpr, rms, wf32, dw_out, db_out, \
    counters, group, of32

// ---------------------------------------------------------------------------------------------- row-group sums
// Sum over the row group of this thread (every thread of the group gets it; all of them must call, and for groups
// of <= 32 threads the whole warp). smem: NORM_MAX_RPB * 64 floats. Deterministic (fixed order).
__device__ __forceinline__ void rg_barrier(int tpr) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + (int)threadIdx.x / tpr), "r"(tpr) : "memory");
}

__device__ __forceinline__ float rg_sum(float a, int tpr, float* smem) {
    if (tpr <= 32) {
        for (int o = tpr >> 1; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        return a;
    }
    a = warp_sum(a);
    const int lane = threadIdx.x & 31, w = (threadIdx.x % tpr) >> 5, nw = tpr >> 5;
    float* s = smem + (threadIdx.x / tpr) * 64;
    rg_barrier(tpr);  // the previous call's readers are done with s
    if (lane == 0) s[w] = a;
    rg_barrier(tpr);
    return warp_sum(lane < nw ? s[lane] : 0.f);
}

// Two sums at once (one barrier pair).
__device__ __forceinline__ void rg_sum2(float& a, float& b, int tpr, float* smem) {
    if (tpr <= 32) {
        for (int o = tpr >> 1; o > 0; o >>= 1) {
            a += __shfl_xor_sync(0xffffffffu, a, o);
            b += __shfl_xor_sync(0xffffffffu, b, o);
        }
        return;
    }
    a = warp_sum(a);
    b = warp_sum(b);
    const int lane = threadIdx.x & 31, w = (threadIdx.x % tpr) >> 5, nw = tpr >> 5;
    float* s = smem + (threadIdx.x / tpr) * 64;
    rg_barrier(tpr);
    if (lane == 0) {
        s[w] = a;
        s[32 + w] = b;
    }
    rg_barrier(tpr);
    a = warp_sum(lane < nw ? s[lane] : 0.f);
    b = warp_sum(lane < nw ? s[32 + lane] : 0.f);
}

// Loads the cached vectors of one row (k = i * tpr + lane < nvec) as raw 16-byte words; rows >= rows load nothing.
template <typename T, int VPT>
__device__ __forceinline__ void fetch_row(const T* __restrict__ p, i64 row, i64 rows, int cols, int nvec, int lane,
                                          int tpr, uint4 (&q)[VPT]) {
    if (row < rows) {
        const T* pr = p + row * cols;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (k < nvec) q[i] = load_raw16(pr + (i64)k * VecT<T>::N);
        }
    }
}


// ---------------------------------------------------------------------------------------------- forward
// 16-byte vector path, the row cached (nvec <= tpr * VPT) as raw 16-byte words, the next row prefetched. Weight /
// bias columns are read per row (L1 hits) right where they are used.
template <typename T, int VPT>
__device__ __forceinline__ void norm_fwd_vec(const T* __restrict__ x, const void* __restrict__ w,
                                             const void* __restrict__ b, T* __restrict__ y, float* __restrict__ mean,
                                             float* __restrict__ rstd, i64 rows, int cols, float eps, int tpr, int rms,
                                             int wf32, float* smem) {
    constexpr int N = VecT<T>::N;
    const int lane = threadIdx.x % tpr, rg = threadIdx.x / tpr, rpb = blockDim.x / tpr, nvec = cols / N;
    const i64 nblk = (rows + rpb - 1) / rpb;
    uint4 nxt[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) nxt[i] = make_uint4(0u, 0u, 0u, 0u);
    i64 rb = blockIdx.x;
    if (rb < nblk) fetch_row<T, VPT>(x, rb * rpb + rg, rows, cols, nvec, lane, tpr, nxt);
    for (; rb < nblk; rb += gridDim.x) {
        const i64 row = rb * rpb + rg;
        const bool valid = row < rows;
        uint4 cur[VPT];
#pragma unroll
        for (int i = 0; i < VPT; ++i) cur[i] = nxt[i];
        if (rb + gridDim.x < nblk) fetch_row<T, VPT>(x, (rb + gridDim.x) * rpb + rg, rows, cols, nvec, lane, tpr, nxt);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                float v[N];
                unpack_f32<T>(cur[i], v);
#pragma unroll
                for (int j = 0; j < N; ++j) s += v[j];
            }
        }
        const float mu = rms ? 0.f : rg_sum(s, tpr, smem) / cols;
        opaque<VPT>(cur);
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                float v[N];
                unpack_f32<T>(cur[i], v);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const float d = v[j] - mu;
                    ss += d * d;
                }
            }
        }
        const float rs = rsqrtf(rg_sum(ss, tpr, smem) / cols + eps);
        opaque<VPT>(cur);
        const void* wp = opaque_ptr(w);
        const void* bp = opaque_ptr(b);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                float v[N], wv[N], bv[N];
                if (wp) load_any<T, N>(wp, (i64)k * N, wf32, wv);
                if (bp) load_any<T, N>(bp, (i64)k * N, wf32, bv);
                unpack_f32<T>(cur[i], v);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float t = (v[j] - mu) * rs;
                    if (wp) t *= wv[j];
                    if (bp) t += bv[j];
                    v[j] = t;
                }
                *reinterpret_cast<uint4*>(y + row * cols + (i64)k * N) = pack_f32<T>(v);
            }
        }
        if (valid && lane == 0) {
            if (mean) mean[row] = mu;
            if (rstd) rstd[row] = rs;
        }
    }
}

// Any width / alignment: N elements per access (N = 1: scalar), the row cached when it fits, else three passes over
// the row (the later ones hit L1/L2). One row per row group and step.
template <typename T, int N, int VPT>
__device__ __forceinline__ void norm_fwd_any(const T* __restrict__ x, const void* __restrict__ w,
                                             const void* __restrict__ b, T* __restrict__ y, float* __restrict__ mean,
                                             float* __restrict__ rstd, i64 rows, int cols, float eps, int tpr, int rms,
                                             int wf32, float* smem) {
    const int lane = threadIdx.x % tpr, rg = threadIdx.x / tpr, rpb = blockDim.x / tpr, nvec = cols / N;
    const i64 nblk = (rows + rpb - 1) / rpb;
    for (i64 rb = blockIdx.x; rb < nblk; rb += gridDim.x) {
        const i64 row = rb * rpb + rg;
        const bool valid = row < rows;
        const T* xr = x + (valid ? row : 0) * cols;
        T* yr = y + (valid ? row : 0) * cols;
        float mu, rs;
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
            mu = rms ? 0.f : rg_sum(s, tpr, smem) / cols;
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int k = i * tpr + lane;
                if (valid && k < nvec)
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        const float d = v[i][j] - mu;
                        ss += d * d;
                    }
            }
            rs = rsqrtf(rg_sum(ss, tpr, smem) / cols + eps);
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int k = i * tpr + lane;
                if (valid && k < nvec) {
                    float wv[N], bv[N], o[N];
                    if (w) load_any<T, N>(w, (i64)k * N, wf32, wv);
                    if (b) load_any<T, N>(b, (i64)k * N, wf32, bv);
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        float t = (v[i][j] - mu) * rs;
                        if (w) t *= wv[j];
                        if (b) t += bv[j];
                        o[j] = t;
                    }
                    store_f32<T, N>(yr + (i64)k * N, o);
                }
            }
        } else {  // very wide rows
            float s = 0.f;
            if (valid && !rms)
                for (int k = lane; k < cols; k += tpr) s += to_f32(xr[k]);
            mu = rms ? 0.f : rg_sum(s, tpr, smem) / cols;
            float ss = 0.f;
            if (valid)
                for (int k = lane; k < cols; k += tpr) {
                    const float d = to_f32(xr[k]) - mu;
                    ss += d * d;
                }
            rs = rsqrtf(rg_sum(ss, tpr, smem) / cols + eps);
            if (valid)
                for (int k = lane; k < cols; k += tpr) {
                    float t = (to_f32(xr[k]) - mu) * rs;
                    if (w) t *= load_any1<T>(w, k, wf32);
                    if (b) t += load_any1<T>(b, k, wf32);
                    yr[k] = from_f32<T>(t);
                }
        }
        if (valid && lane == 0) {
            if (mean) mean[row] = mu;
            if (rstd) rstd[row] = rs;
        }
    }
}

template <typename T, int VPT>
__device__ __forceinline__ void norm_fwd_impl(const T* __restrict__ x, const void* __restrict__ w,
                                              const void* __restrict__ b, T* __restrict__ y, float* __restrict__ mean,
                                              float* __restrict__ rstd, i64 rows, int cols, float eps, int tpr, int rms,
                                              int wf32) {
    __shared__ float smem[NORM_MAX_RPB * 64];
    constexpr int N = VecT<T>::N;
    if (cols % N == 0 && aligned16(x) && aligned16(y)) {
        if (cols / N <= tpr * VPT)
            norm_fwd_vec<T, VPT>(x, w, b, y, mean, rstd, rows, cols, eps, tpr, rms, wf32, smem);
        else
            norm_fwd_any<T, N, VPT>(x, w, b, y, mean, rstd, rows, cols, eps, tpr, rms, wf32, smem);
    } else {
        norm_fwd_any<T, 1, VPT>(x, w, b, y, mean, rstd, rows, cols, eps, tpr, rms, wf32, smem);
    }
}

// y = (x - mean) * rstd * w + b per row (rms: mean = 0, no b). mean / rstd: fp32 (rows,), either may be null.
// The digit is VPT: 16-byte vectors of the row each thread caches.
template <typename T>
__global__ void norm_fwd1(NORM_FWD_PARAMS) { norm_fwd_impl<T, 1>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwd2(NORM_FWD_PARAMS) { norm_fwd_impl<T, 2>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwd4(NORM_FWD_PARAMS) { norm_fwd_impl<T, 4>(NORM_FWD_ARGS); }

// ---------------------------------------------------------------------------------------------- forward, one pass
// 16-byte vector path for rows of nvec = cols / N <= tpr * VPT vectors (the Python side checks cols % N == 0 and
// 16-byte aligned x and y). Not persistent: block b holds rows b * rpb ...; each thread issues all VPT loads of its
// row at once (raw 16-byte words in registers: many bytes in flight per SM), one reduction, then the output.
//   tpr <= 32 (a power of two): rpb = blockDim.x / tpr rows per block, several rows per warp, shuffle reductions
//     only (LayerNorm: the exact two-pass mean and M2 over the cached values, no barrier).
//   tpr > 32 (a multiple of 32, blockDim.x == tpr): one row per block. Each warp reduces its count, mean and M2
//     (exact two-pass within the warp); one barrier; every thread combines the warps' triples in warp order with
//     Chan's formula (the same result in all threads: deterministic).
template <int VPT>
__device__ __forceinline__ float fwdv_warp_count(int nvec, int tpr, int warp, int n) {
    int c = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int r = nvec - (i * tpr + warp * 32);
        c += r <= 0 ? 0 : (r >= 32 ? 32 : r);
    }
    return c * n;
}

template <typename T, int VPT>
__device__ __forceinline__ void norm_fwdv_impl(const T* __restrict__ x, const void* __restrict__ w,
                                               const void* __restrict__ b, T* __restrict__ y,
                                               float* __restrict__ mean, float* __restrict__ rstd, i64 rows,
                                               int cols, float eps, int tpr, int rms, int wf32) {
    __shared__ float red[3 * 32];
    constexpr int N = VecT<T>::N;
    const int nvec = cols / N;
    const bool small = tpr <= 32;
    const int lane = small ? (int)(threadIdx.x & (tpr - 1)) : (int)threadIdx.x;
    const int rpb = small ? (int)blockDim.x / tpr : 1;
    const i64 row = (i64)blockIdx.x * rpb + (small ? (int)threadIdx.x / tpr : 0);
    const bool valid = row < rows;
    const T* xr = x + (valid ? row : 0) * cols;
    uint4 q[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int k = i * tpr + lane;
        q[i] = (valid && k < nvec) ? load_raw16(xr + (i64)k * N) : make_uint4(0u, 0u, 0u, 0u);
    }
    // zero words unpack to 0.f: they add nothing to the sums below (the M2 pass is predicated)
    float mu = 0.f, var;
    if (small) {
        if (rms) {
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                float v[N];
                unpack_f32<T>(q[i], v);
#pragma unroll
                for (int j = 0; j < N; ++j) ss += v[j] * v[j];
            }
            for (int o = tpr >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            var = ss / cols;
        } else {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                float v[N];
                unpack_f32<T>(q[i], v);
#pragma unroll
                for (int j = 0; j < N; ++j) s += v[j];
            }
            for (int o = tpr >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            mu = s / cols;
            opaque<VPT>(q);
            float m2 = 0.f;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                if (i * tpr + lane < nvec) {
                    float v[N];
                    unpack_f32<T>(q[i], v);
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        const float d = v[j] - mu;
                        m2 += d * d;
                    }
                }
            }
            for (int o = tpr >> 1; o > 0; o >>= 1) m2 += __shfl_xor_sync(0xffffffffu, m2, o);
            var = m2 / cols;
        }
    } else {
        const int wl = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        if (rms) {
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                float v[N];
                unpack_f32<T>(q[i], v);
#pragma unroll
                for (int j = 0; j < N; ++j) ss += v[j] * v[j];
            }
            ss = warp_sum(ss);
            if (wl == 0) red[warp] = ss;
            __syncthreads();
            ss = 0.f;
            for (int u = 0; u < nw; ++u) ss += red[u];
            var = ss / cols;
        } else {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                float v[N];
                unpack_f32<T>(q[i], v);
#pragma unroll
                for (int j = 0; j < N; ++j) s += v[j];
            }
            const float nwf = (float)fwdv_warp_count<VPT>(nvec, tpr, warp, N);
            const float mw = nwf > 0.f ? warp_sum(s) / nwf : 0.f;  // nwf is warp-uniform
            opaque<VPT>(q);
            float m2 = 0.f;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                if (i * tpr + lane < nvec) {
                    float v[N];
                    unpack_f32<T>(q[i], v);
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        const float d = v[j] - mw;
                        m2 += d * d;
                    }
                }
            }
            m2 = warp_sum(m2);
            if (wl == 0) {
                red[3 * warp] = nwf;
                red[3 * warp + 1] = mw;
                red[3 * warp + 2] = m2;
            }
            __syncthreads();
            float n = 0.f, m = 0.f, q2 = 0.f;
            for (int u = 0; u < nw; ++u) {
                const float nb = red[3 * u];
                if (nb > 0.f) {
                    const float tot = n + nb, delta = red[3 * u + 1] - m;
                    m += delta * (nb / tot);
                    q2 += red[3 * u + 2] + delta * delta * (n * nb / tot);
                    n = tot;
                }
            }
            mu = m;
            var = q2 / cols;
        }
    }
    const float rs = rsqrtf(var + eps);
    T* yr = y + (valid ? row : 0) * cols;
    opaque<VPT>(q);  // unpacked again below: raw words stay the only copy of the row in registers
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int k = i * tpr + lane;
        if (valid && k < nvec) {
            float v[N], wv[N], bv[N];
            w = opaque_ptr(w);  // one vector's weight / bias loads at a time (not all hoisted into registers)
            b = opaque_ptr(b);
            if (w) load_any<T, N>(w, (i64)k * N, wf32, wv);
            if (b) load_any<T, N>(b, (i64)k * N, wf32, bv);
            unpack_f32<T>(q[i], v);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                float t = (v[j] - mu) * rs;
                if (w) t *= wv[j];
                if (b) t += bv[j];
                v[j] = t;
            }
            *reinterpret_cast<uint4*>(yr + (i64)k * N) = pack_f32<T>(v);
        }
    }
    if (valid && lane == 0) {
        if (mean) mean[row] = mu;
        if (rstd) rstd[row] = rs;
    }
}

// norm_fwd's contract (y, mean, rstd; rms: no mean / bias) on the one-pass vector path above; the digit is VPT.
// Grid: cdiv(rows, rpb) blocks; block: a multiple of tpr (tpr <= 32) or tpr itself.
template <typename T>
__global__ void norm_fwdv1(NORM_FWD_PARAMS) { norm_fwdv_impl<T, 1>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwdv2(NORM_FWD_PARAMS) { norm_fwdv_impl<T, 2>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwdv3(NORM_FWD_PARAMS) { norm_fwdv_impl<T, 3>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwdv6(NORM_FWD_PARAMS) { norm_fwdv_impl<T, 6>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwdv4(NORM_FWD_PARAMS) { norm_fwdv_impl<T, 4>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwdv8(NORM_FWD_PARAMS) { norm_fwdv_impl<T, 8>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwdv12(NORM_FWD_PARAMS) { norm_fwdv_impl<T, 12>(NORM_FWD_ARGS); }
template <typename T>
__global__ void norm_fwdv16(NORM_FWD_PARAMS) { norm_fwdv_impl<T, 16>(NORM_FWD_ARGS); }

// ---------------------------------------------------------------------------------------------- backward
// ACC: the weight-gradient partials a kernel accumulates: 0 none (dx only), 1 dw = sum(dy * xhat), 2 dw and
// db = sum(dy). On the cached paths each row group adds its rows into its own fp32 row of dynamic shared memory
// (acc: ACC * rpb * cols floats, [dw rows | db rows], each thread touching only its own columns: no races, a fixed
// order); at the end the block adds its row groups in order and writes one partial row per block into dw_part /
// db_part (fp32, (gridDim.x, cols)), summed over blocks by column_sum. On the looping path (rpb == 1) the partials
// go straight to the block's part row. Either pointer may be null.
__device__ __forceinline__ void parts_zero(float* __restrict__ acc, int n) {
    for (int c = threadIdx.x; c < n; c += blockDim.x) acc[c] = 0.f;
    __syncthreads();
}

template <int ACC>
__device__ __forceinline__ void parts_write(const float* __restrict__ acc, float* __restrict__ dw_part,
                                            float* __restrict__ db_part, int cols, int rpb) {
    __syncthreads();
    const i64 base = (i64)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float s = 0.f, t = 0.f;
        for (int g = 0; g < rpb; ++g) {
            s += acc[g * cols + c];
            if (ACC == 2) t += acc[(rpb + g) * cols + c];
        }
        if (dw_part) dw_part[base + c] = s;
        if (ACC == 2 && db_part) db_part[base + c] = t;
    }
}

// Register partials (the vector path with VPT <= 2: a thread keeps the same columns for all its rows): the block's
// row groups add theirs into the block's part row in row-group order (deterministic), one barrier between groups.
template <int ACC, int VPT, int N>
__device__ __forceinline__ void parts_write_reg(const float (&aw)[VPT][N], const float (&ab)[VPT][N],
                                                float* __restrict__ dw_part, float* __restrict__ db_part, int cols,
                                                int nvec, int tpr, int lane, int rg, int rpb) {
    const i64 base = (i64)blockIdx.x * cols;
    for (int g = 0; g < rpb; ++g) {
        if (rg == g) {
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int k = i * tpr + lane;
                if (k < nvec) {
                    float a[N];
                    if (dw_part) {
                        float* p = dw_part + base + (i64)k * N;
                        if (g) load_f32<float, N>(p, a);
#pragma unroll
                        for (int j = 0; j < N; ++j) a[j] = g ? a[j] + aw[i][j] : aw[i][j];
                        store_f32<float, N>(p, a);
                    }
                    if (ACC == 2 && db_part) {
                        float* p = db_part + base + (i64)k * N;
                        if (g) load_f32<float, N>(p, a);
#pragma unroll
                        for (int j = 0; j < N; ++j) a[j] = g ? a[j] + ab[i][j] : ab[i][j];
                        store_f32<float, N>(p, a);
                    }
                }
            }
        }
        if (g + 1 < rpb) __syncthreads();  // the next group reads what this one wrote (global, same block)
    }
}

// The column sums in the same launch (counters non-null; else column_sum sums dw_part / db_part afterwards). Blocks
// form groups of `group` consecutive blocks: the last block of a group to finish (last_arrival) adds the group's part
// rows into the group's first row; the last of those adds the groups' rows (every group-th row) and writes dw_out /
// db_out (T, or fp32 where of32). group >= gridDim.x: one level (the last block adds all rows). Counters: 1, or
// cdiv(gridDim.x, group) + 1 (one per group, then the top level). Both levels add rows in a fixed order. U: loads in
// flight per thread (sum_rows; 4 for VPT 1, whose main loop needs fewer registers than 8 loads would).
template <typename T, int ACC, int U>
__device__ __forceinline__ void parts_finish(float* __restrict__ dw_part, float* __restrict__ db_part,
                                             void* __restrict__ dw_out, void* __restrict__ db_out, int cols,
                                             unsigned* __restrict__ counters, int group, int of32) {
    __shared__ int flag;
    const int parts = gridDim.x, g = blockIdx.x / group, ngroups = (parts + group - 1) / group;
    const int gs = min(group, parts - g * group);
    if (!last_arrival(counters + g, gs, &flag)) return;
    if (ngroups > 1) {
        const i64 r0 = (i64)g * group;
        if (gs > 1) {
            if (dw_part)
                sum_rows<U>(dw_part, cols, r0, 1, gs, 0, cols, [&](int c, const float(&v)[4], int n) {
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (j < n) dw_part[r0 * cols + c + j] = v[j];
                });
            if (ACC == 2 && db_part)
                sum_rows<U>(db_part, cols, r0, 1, gs, 0, cols, [&](int c, const float(&v)[4], int n) {
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (j < n) db_part[r0 * cols + c + j] = v[j];
                });
        }
        if (!last_arrival(counters + ngroups, ngroups, &flag)) return;
    }
    const i64 stride = ngroups > 1 ? group : 1;
    const int nr = ngroups > 1 ? ngroups : gs;
    if (dw_part)
        sum_rows<U>(dw_part, cols, 0, stride, nr, 0, cols, [&](int c, const float(&v)[4], int n) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < n) store_any1<T>(dw_out, c + j, v[j], of32);
        });
    if (ACC == 2 && db_part)
        sum_rows<U>(db_part, cols, 0, stride, nr, 0, cols, [&](int c, const float(&v)[4], int n) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < n) store_any1<T>(db_out, c + j, v[j], of32);
        });
}

// acc[...] += (dy * xhat, dy) for one thread's vector of N columns at `col`.
template <int ACC, int N>
__device__ __forceinline__ void parts_add(float* __restrict__ acc, int rg, int rpb, int cols, int col,
                                          const float (&xh)[N], const float (&dv)[N]) {
    if (ACC >= 1) {
        float a[N];
        float* p = acc + rg * cols + col;
        load_f32<float, N>(p, a);
#pragma unroll
        for (int j = 0; j < N; ++j) a[j] += dv[j] * xh[j];
        store_f32<float, N>(p, a);
    }
    if (ACC == 2) {
        float a[N];
        float* p = acc + (rpb + rg) * cols + col;
        load_f32<float, N>(p, a);
#pragma unroll
        for (int j = 0; j < N; ++j) a[j] += dv[j];
        store_f32<float, N>(p, a);
    }
}

// 16-byte vector path, the row cached (nvec <= tpr * VPT), the next row (x, dy, mean, rstd) prefetched. x and dy stay
// raw 16-byte words in registers; xhat and g = dy * w are recomputed for the output pass (w re-read from L1).
// Weight-gradient partials: in registers for VPT <= 2 (REG; no dynamic shared memory), else in shared memory.
// Cluster partials (norm_bwd_cl, sm_90): the partial rows sit in each block's shared memory, acc: R rows of cols
// floats per accumulated quantity ([dw rows | db rows]): the row groups' own rows (R = rpb, parts_add: SM) or, from
// register partials (!SM), one row per quantity (R = 1) that the row groups add into in order here. Between cluster
// barriers block rank r adds the CL blocks' rows (rank, then row order: deterministic) over its 1/CL of the columns,
// through distributed shared memory, and writes them to part row blockIdx.x / CL: a launch writes gridDim.x / CL part
// rows instead of gridDim.x.
template <int ACC, int VPT, int N, int CL, bool SM>
__device__ __forceinline__ void parts_write_cluster(const float (&aw)[VPT][N], const float (&ab)[VPT][N],
                                                    float* __restrict__ dw_part, float* __restrict__ db_part,
                                                    int cols, int nvec, int tpr, int lane, int rg, int rpb,
                                                    float* __restrict__ acc) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    const int R = SM ? rpb : 1;
    if constexpr (SM) {
        __syncthreads();
    } else {
        for (int g = 0; g < rpb; ++g) {  // the block's row groups, in order
            if (rg == g)
#pragma unroll
                for (int i = 0; i < VPT; ++i) {
                    const int k = i * tpr + lane;
                    if (k < nvec)
#pragma unroll
                        for (int a = 0; a < ACC; ++a)
#pragma unroll
                            for (int j = 0; j < N; j += 4) {
                                float4* p = reinterpret_cast<float4*>(acc + a * cols + k * N + j);
                                const float(&v)[N] = a ? ab[i] : aw[i];
                                float4 t = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
                                if (g) {
                                    const float4 o = *p;
                                    t.x += o.x;
                                    t.y += o.y;
                                    t.z += o.z;
                                    t.w += o.w;
                                }
                                *p = t;
                            }
                }
            if (g + 1 < rpb) __syncthreads();
        }
    }
    cluster_arrive();
    cluster_wait();  // every block's rows are in its shared memory
    const int q = cols / 4, per = (q + CL - 1) / CL, r = (int)(blockIdx.x % CL);
    const int lo = min(q, r * per), hi = min(q, lo + per);
    const i64 base = (i64)(blockIdx.x / CL) * cols;
    for (int c = lo + (int)threadIdx.x; c < hi; c += blockDim.x)
#pragma unroll
        for (int a = 0; a < ACC; ++a) {
            float* out = a ? db_part : dw_part;
            if (out == nullptr) continue;
            float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int rr = 0; rr < CL; ++rr)
                for (int g = 0; g < R; ++g) {
                    const float4 u = cluster_load4(acc + (a * R + g) * cols + 4 * c, rr);
                    t.x += u.x;
                    t.y += u.y;
                    t.z += u.z;
                    t.w += u.w;
                }
            *reinterpret_cast<float4*>(out + base + 4 * c) = t;
        }
    cluster_arrive();
    cluster_wait();  // the others are done reading this block's shared memory
#endif
}

template <typename T, int VPT, int ACC, int CL = 0, bool SM = false>
__device__ __forceinline__ void norm_bwd_vec(const T* __restrict__ dy, const T* __restrict__ x,
                                             const void* __restrict__ w, const float* __restrict__ mean,
                                             const float* __restrict__ rstd, T* __restrict__ dx,
                                             const T* __restrict__ dres, float* __restrict__ dw_part,
                                             float* __restrict__ db_part, i64 rows, int cols, int tpr, int rms,
                                             int wf32, float* smem, float* acc) {
    constexpr int N = VecT<T>::N;
    const int lane = threadIdx.x % tpr, rg = threadIdx.x / tpr, rpb = blockDim.x / tpr, nvec = cols / N;
    const i64 nblk = (rows + rpb - 1) / rpb;
    const float inv_cols = 1.f / cols;
    constexpr bool REG = ACC > 0 && VPT <= 2 && !(CL > 0 && SM);
    constexpr int RV = REG ? VPT : 1, RN = REG ? N : 1;
    float aw[RV][RN], ab[RV][RN];
#pragma unroll
    for (int i = 0; i < RV; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) aw[i][j] = ab[i][j] = 0.f;
    if (ACC && !REG) parts_zero(acc, ACC * rpb * cols);
    uint4 nx[VPT], nd[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) nx[i] = nd[i] = make_uint4(0u, 0u, 0u, 0u);
    float nmu = 0.f, nrs = 0.f;
    i64 rb = blockIdx.x;
    if (rb < nblk) {
        const i64 row = rb * rpb + rg;
        fetch_row<T, VPT>(x, row, rows, cols, nvec, lane, tpr, nx);
        fetch_row<T, VPT>(dy, row, rows, cols, nvec, lane, tpr, nd);
        if (row < rows) {
            nmu = rms ? 0.f : mean[row];
            nrs = rstd[row];
        }
    }
    for (; rb < nblk; rb += gridDim.x) {
        const i64 row = rb * rpb + rg;
        const bool valid = row < rows;
        uint4 cx[VPT], cd[VPT];
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            cx[i] = nx[i];
            cd[i] = nd[i];
        }
        const float mu = nmu, rs = nrs;
        if (rb + gridDim.x < nblk) {
            const i64 nrow = (rb + gridDim.x) * rpb + rg;
            fetch_row<T, VPT>(x, nrow, rows, cols, nvec, lane, tpr, nx);
            fetch_row<T, VPT>(dy, nrow, rows, cols, nvec, lane, tpr, nd);
            if (nrow < rows) {
                nmu = rms ? 0.f : mean[nrow];
                nrs = rstd[nrow];
            }
        }
        float sg = 0.f, sgx = 0.f;
        const void* wp = opaque_ptr(w);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                float xv[N], dv[N], wv[N];
                if (wp) load_any<T, N>(wp, (i64)k * N, wf32, wv);
                unpack_f32<T>(cx[i], xv);
                unpack_f32<T>(cd[i], dv);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    xv[j] = (xv[j] - mu) * rs;
                    const float g = wp ? dv[j] * wv[j] : dv[j];
                    sg += g;
                    sgx += g * xv[j];
                }
                if constexpr (REG) {
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        aw[i][j] += dv[j] * xv[j];
                        if (ACC == 2) ab[i][j] += dv[j];
                    }
                } else if (ACC) {
                    parts_add<ACC, N>(acc, rg, rpb, cols, k * N, xv, dv);
                }
            }
        }
        rg_sum2(sg, sgx, tpr, smem);
        const float mg = rms ? 0.f : sg * inv_cols, mgx = sgx * inv_cols;
        opaque<VPT>(cx);
        opaque<VPT>(cd);
        wp = opaque_ptr(w);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int k = i * tpr + lane;
            if (valid && k < nvec) {
                float xv[N], dv[N], wv[N];
                if (wp) load_any<T, N>(wp, (i64)k * N, wf32, wv);
                unpack_f32<T>(cx[i], xv);
                unpack_f32<T>(cd[i], dv);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const float xh = (xv[j] - mu) * rs;
                    const float g = wp ? dv[j] * wv[j] : dv[j];
                    xv[j] = rs * (g - mg - xh * mgx);
                }
                if (dres) {  // another consumer's gradient of x, added before the one rounding
                    float rv[N];
                    unpack_f32<T>(*reinterpret_cast<const uint4*>(dres + row * cols + (i64)k * N), rv);
#pragma unroll
                    for (int j = 0; j < N; ++j) xv[j] += rv[j];
                }
                *reinterpret_cast<uint4*>(dx + row * cols + (i64)k * N) = pack_f32<T>(xv);
            }
        }
    }
    if constexpr (CL > 0)
        parts_write_cluster<ACC, RV, RN, CL, SM>(aw, ab, dw_part, db_part, cols, nvec, tpr, lane, rg, rpb, acc);
    else if constexpr (REG)
        parts_write_reg<ACC, RV, RN>(aw, ab, dw_part, db_part, cols, nvec, tpr, lane, rg, rpb);
    else if (ACC)
        parts_write<ACC>(acc, dw_part, db_part, cols, rpb);
}

// Any width / alignment (N = 1: scalar). The row cached when it fits; else (very wide rows, one row group per block)
// two passes over the row and the partials go straight to the block's part row.
template <typename T, int N, int VPT, int ACC>
__device__ __forceinline__ void norm_bwd_any(const T* __restrict__ dy, const T* __restrict__ x,
                                             const void* __restrict__ w, const float* __restrict__ mean,
                                             const float* __restrict__ rstd, T* __restrict__ dx,
                                             const T* __restrict__ dres, float* __restrict__ dw_part,
                                             float* __restrict__ db_part, i64 rows, int cols, int tpr, int rms,
                                             int wf32, float* smem, float* acc) {
    const int lane = threadIdx.x % tpr, rg = threadIdx.x / tpr, rpb = blockDim.x / tpr;
    const int nvec = cols / N;
    const float inv_cols = 1.f / cols;
    const i64 nblk = (rows + rpb - 1) / rpb;
    if (nvec <= tpr * VPT) {
        if (ACC) parts_zero(acc, ACC * rpb * cols);
        for (i64 rb = blockIdx.x; rb < nblk; rb += gridDim.x) {
            const i64 row = rb * rpb + rg;
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
                        const float g = w ? dv[j] * wv[j] : dv[j];
                        xv[i][j] = xh;
                        gv[i][j] = g;
                        sg += g;
                        sgx += g * xh;
                    }
                    if (ACC) parts_add<ACC, N>(acc, rg, rpb, cols, k * N, xv[i], dv);
                }
            }
            rg_sum2(sg, sgx, tpr, smem);
            const float mg = rms ? 0.f : sg * inv_cols, mgx = sgx * inv_cols;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int k = i * tpr + lane;
                if (valid && k < nvec) {
                    float o[N], rv[N];
                    if (dres) load_f32<T, N>(dres + r * cols + (i64)k * N, rv);
#pragma unroll
                    for (int j = 0; j < N; ++j) o[j] = rs * (gv[i][j] - mg - xv[i][j] * mgx) + (dres ? rv[j] : 0.f);
                    store_f32<T, N>(dx + r * cols + (i64)k * N, o);
                }
            }
        }
        if (ACC) parts_write<ACC>(acc, dw_part, db_part, cols, rpb);
    } else {  // very wide rows (rpb == 1): partials go straight to the block's part row
        const i64 part = blockIdx.x;
        if (ACC)
            for (int k = lane; k < cols; k += tpr) {
                if (dw_part) dw_part[part * cols + k] = 0.f;
                if (ACC == 2 && db_part) db_part[part * cols + k] = 0.f;
            }
        for (i64 rb = blockIdx.x; rb < nblk; rb += gridDim.x) {
            const i64 row = rb * rpb + rg;
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
                    if (ACC >= 1 && dw_part) dw_part[part * cols + k] += d * xh;
                    if (ACC == 2 && db_part) db_part[part * cols + k] += d;
                }
            rg_sum2(sg, sgx, tpr, smem);
            const float mg = rms ? 0.f : sg * inv_cols, mgx = sgx * inv_cols;
            if (valid)
                for (int k = lane; k < cols; k += tpr) {
                    const float d = to_f32(dyr[k]), xh = (to_f32(xr[k]) - mu) * rs;
                    const float g = w ? d * load_any1<T>(w, k, wf32) : d;
                    const float res = dres ? to_f32(dres[r * cols + k]) : 0.f;
                    dx[r * cols + k] = from_f32<T>(rs * (g - mg - xh * mgx) + res);
                }
        }
    }
}

template <typename T, int VPT, int ACC>
__device__ __forceinline__ void norm_bwd_impl(const T* __restrict__ dy, const T* __restrict__ x,
                                              const void* __restrict__ w, const float* __restrict__ mean,
                                              const float* __restrict__ rstd, T* __restrict__ dx,
                                              const T* __restrict__ dres, float* __restrict__ dw_part,
                                              float* __restrict__ db_part, i64 rows,
                                              int cols, int tpr, int rms, int wf32, void* __restrict__ dw_out,
                                              void* __restrict__ db_out, unsigned* __restrict__ counters, int group,
                                              int of32) {
    __shared__ float smem[NORM_MAX_RPB * 64];
    extern __shared__ __align__(16) float norm_acc[];  // ACC * rpb * cols floats where used (see parts_add)
    constexpr int N = VecT<T>::N;
    if (cols % N == 0 && aligned16(x) && aligned16(dy) && aligned16(dx) && (!dres || aligned16(dres))) {
        if (cols / N <= tpr * VPT)
            norm_bwd_vec<T, VPT, ACC>(dy, x, w, mean, rstd, dx, dres, dw_part, db_part, rows, cols, tpr, rms, wf32,
                                      smem, norm_acc);
        else
            norm_bwd_any<T, N, VPT, ACC>(dy, x, w, mean, rstd, dx, dres, dw_part, db_part, rows, cols, tpr, rms, wf32,
                                         smem, norm_acc);
    } else {
        norm_bwd_any<T, 1, VPT, ACC>(dy, x, w, mean, rstd, dx, dres, dw_part, db_part, rows, cols, tpr, rms, wf32,
                                     smem, norm_acc);
    }
    if constexpr (ACC > 0)
        if (counters)
            parts_finish<T, ACC, VPT >= 2 ? 8 : 4>(dw_part, db_part, dw_out, db_out, cols, counters, group, of32);
}

// dx of the rows, and (norm_bwd*) dw and db partials, (norm_bwdw*) dw partials only, (norm_bwdx*) none: dw_part /
// db_part are then not touched. The digit is VPT. Dynamic shared memory: ACC * rpb * cols floats (see parts_add),
// except on the 16-byte vector path with VPT <= 2 (register partials: none). counters non-null: the same launch also
// writes dw_out / db_out = the column sums of the parts (parts_finish; the part rows are scratch then), else dw_out /
// db_out are not touched and column_sum sums the parts.
template <typename T>
__global__ void norm_bwd1(NORM_BWD_PARAMS) { norm_bwd_impl<T, 1, 2>(NORM_BWD_ARGS); }
template <typename T>
__global__ void norm_bwd2(NORM_BWD_PARAMS) { norm_bwd_impl<T, 2, 2>(NORM_BWD_ARGS); }
template <typename T>
__global__ void norm_bwd4(NORM_BWD_PARAMS) { norm_bwd_impl<T, 4, 2>(NORM_BWD_ARGS); }
template <typename T>
__global__ void norm_bwdw1(NORM_BWD_PARAMS) { norm_bwd_impl<T, 1, 1>(NORM_BWD_ARGS); }
template <typename T>
__global__ void norm_bwdw2(NORM_BWD_PARAMS) { norm_bwd_impl<T, 2, 1>(NORM_BWD_ARGS); }
template <typename T>
__global__ void norm_bwdw4(NORM_BWD_PARAMS) { norm_bwd_impl<T, 4, 1>(NORM_BWD_ARGS); }
template <typename T>
__global__ void norm_bwdx1(NORM_BWD_PARAMS) { norm_bwd_impl<T, 1, 0>(NORM_BWD_ARGS); }
template <typename T>
__global__ void norm_bwdx2(NORM_BWD_PARAMS) { norm_bwd_impl<T, 2, 0>(NORM_BWD_ARGS); }
template <typename T>
__global__ void norm_bwdx4(NORM_BWD_PARAMS) { norm_bwd_impl<T, 4, 0>(NORM_BWD_ARGS); }

// The weight-gradient backward with cluster partials (parts_write_cluster): the 16-byte vector path with the row
// cached (cols % N == 0, cols / N <= tpr * VPT, 16-byte aligned pointers), ACC 1 or 2, a grid of a multiple of CL
// blocks; part rows: gridDim.x / CL. SM: the row groups add their partials into shared memory as they go (fewer
// registers: more blocks per SM), else in registers (VPT <= 2). Dynamic shared memory: ACC * cols floats, times rpb
// with SM. REGS caps the registers per thread (__maxnreg__; 255: no cap). Python asks for
// "norm_bwd_cl<T, VPT, ACC, CL, SM, REGS>" on sm_90+ only.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
template <typename T, int VPT, int ACC, int CL, int SM, int REGS>
__global__ void __cluster_dims__(CL, 1, 1) __maxnreg__(REGS) norm_bwd_cl(NORM_BWD_PARAMS) {
    static_assert((SM || VPT <= 2) && ACC >= 1 && ACC <= 2, "dw (and db); register partials for VPT <= 2");
    __shared__ float smem[NORM_MAX_RPB * 64];
    extern __shared__ __align__(16) float norm_acc[];
    norm_bwd_vec<T, VPT, ACC, CL, SM != 0>(dy, x, w, mean, rstd, dx, dres, dw_part, db_part, rows, cols, tpr, rms,
                                           wf32,
                                           smem, norm_acc);
}
#endif

// ---------------------------------------------------------------------------------------------- bulk-copy backward
// norm_bwd_tma (sm_90): the weight-gradient backward (ACC 1: dw, 2: dw and db) with the rows streamed into shared
// memory by bulk copies (cp.async.bulk on an mbarrier per stage). One row per block at a time: tpr = blockDim.x (a
// multiple of 32) threads of VPT 16-byte vectors each (nvec <= tpr * VPT, cols % N == 0, 16-byte aligned rows); each
// block keeps `stages` rows (x and dy) in flight, so the loads run ahead of the reductions without the next row
// sitting in registers, and the registers hold the weight-gradient partials instead (no per-row shared-memory adds).
// Block b handles rows b, b + gridDim.x, ... and writes its partials as part row b of dw_part / db_part (gridDim.x
// rows; either may be null); column_sum sums them after the launch (as a programmatic dependent launch: this kernel
// lets it start at once, and it waits for this grid before reading). Dynamic shared memory: stages * 2 * cols *
// sizeof(T) bytes. `opts`: bits 0-3, the stages filled at entry (0: all; the rest once the first row has arrived, so
// the first rows of all blocks are not queued behind everyone's later rows); bit 4, the per-row block reduction with
// one barrier (two scratch buffers by row parity) instead of two. LOOP: 0, the weight read through L1 in both passes
// of every row; 1, the weight in registers (fp32, loaded once); 2, as 1, and pass 1 keeps the row's xhat and g in
// registers and adds the weight-gradient partials, so pass 2 (dx) reads no shared memory and the row's stage is
// refilled as soon as the block reduction's barrier is passed (one row earlier). Python asks for
// "norm_bwd_tma<T, VPT, ACC, REGS, LOOP>" or "norm_bwd_tma_cl<T, VPT, ACC, CL, REGS, LOOP>" on sm_90+ only; REGS
// caps the registers per thread (__maxnreg__).
#define NORM_TMA_MAX_STAGES 8

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// Issues the bulk copies of row `row` (x and dy) into stage s. One thread.
template <typename T>
__device__ __forceinline__ void norm_tma_fill(T* sbuf, unsigned long long* full, int s, const T* __restrict__ x,
                                              const T* __restrict__ dy, i64 row, int cols) {
    const unsigned bytes = (unsigned)cols * sizeof(T);
    mbar_expect_tx(&full[s], 2u * bytes);
    bulk_load(sbuf + (i64)2 * s * cols, x + row * cols, bytes, &full[s]);
    bulk_load(sbuf + (i64)(2 * s + 1) * cols, dy + row * cols, bytes, &full[s]);
}

#define NORM_TMA_PARAMS const T* __restrict__ dy, const T* __restrict__ x, const void* __restrict__ w, \
    const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ dw_part, \
    float* __restrict__ db_part, i64 rows, int cols, int rms, int wf32, int stages, int opts
#define NORM_TMA_ARGS dy, x, w, mean, rstd, dx, dw_part, db_part, rows, cols, rms, wf32, stages, opts

// CL > 1 (norm_bwd_tma_cl): clusters of CL blocks add their register partials through distributed shared memory
// (parts_write_cluster; the stage buffers hold them once the rows are done): part row blockIdx.x / CL, gridDim.x / CL
// rows.
// Vector k of a staged row (xs: x, ds: dy in shared memory): xh = (x - mu) * rs, dv = dy, g = dy * w (dy where w is
// null; w read through L1).
template <typename T, int N, bool WR>
__device__ __forceinline__ void norm_tma_vec(const T* xs, const T* ds, const void* __restrict__ w, int k, int wf32,
                                             const float (&wr)[N], float mu, float rs, float (&xh)[N],
                                             float (&dv)[N], float (&g)[N]) {
    float wv[N];
    if constexpr (WR) {
#pragma unroll
        for (int j = 0; j < N; ++j) wv[j] = wr[j];
    } else if (w) {
        load_any<T, N>(w, (i64)k * N, wf32, wv);
    }
    unpack_f32<T>(*reinterpret_cast<const uint4*>(xs + k * N), xh);
    unpack_f32<T>(*reinterpret_cast<const uint4*>(ds + k * N), dv);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        xh[j] = (xh[j] - mu) * rs;
        g[j] = (WR || w) ? dv[j] * wv[j] : dv[j];
    }
}

// One pass over a staged row (xs: x, ds: dy in shared memory). The first (DX false): sg += sum(g), sgx +=
// sum(g * xhat). The second (DX): dx of the row (out: its first element) from the row means mg, mgx, and the
// weight-gradient partials aw += dy * xhat, ab += dy. wr: the thread's weight vectors where WR (else unused).
template <typename T, int VPT, int ACC, int N, bool DX, bool WR>
__device__ __forceinline__ void norm_tma_pass(const T* xs, const T* ds, const void* __restrict__ w, int nvec, int wf32,
                                              const float (&wr)[VPT][N], float mu, float rs, float& sg, float& sgx,
                                              T* __restrict__ out, float (&aw)[VPT][N], float (&ab)[VPT][N]) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int k = i * blockDim.x + threadIdx.x;
        if (k < nvec) {
            float xh[N], dv[N], g[N];
            norm_tma_vec<T, N, WR>(xs, ds, w, k, wf32, wr[i], mu, rs, xh, dv, g);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                if constexpr (DX) {
                    aw[i][j] += dv[j] * xh[j];
                    if (ACC == 2) ab[i][j] += dv[j];
                    g[j] = rs * (g[j] - sg - xh[j] * sgx);
                } else {
                    sg += g[j];
                    sgx += g[j] * xh[j];
                }
            }
            if constexpr (DX) *reinterpret_cast<uint4*>(out + (i64)k * N) = pack_f32<T>(g);
        }
    }
}

// LOOP 2, pass 1 over a staged row: xk = xhat, gk = g kept for pass 2; sg += sum(g), sgx += sum(g * xhat); the
// weight-gradient partials aw += dy * xhat, ab += dy (they need no row means). wr: the weight (1 where w is null).
template <typename T, int VPT, int ACC, int N>
__device__ __forceinline__ void norm_tma_pass_keep(const T* xs, const T* ds, int nvec, const float (&wr)[VPT][N],
                                                   float mu, float rs, float& sg, float& sgx, float (&xk)[VPT][N],
                                                   float (&gk)[VPT][N], float (&aw)[VPT][N], float (&ab)[VPT][N]) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int k = i * blockDim.x + threadIdx.x;
        if (k < nvec) {
            float dv[N];
            norm_tma_vec<T, N, true>(xs, ds, nullptr, k, 0, wr[i], mu, rs, xk[i], dv, gk[i]);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                aw[i][j] += dv[j] * xk[i][j];
                if (ACC == 2) ab[i][j] += dv[j];
                sg += gk[i][j];
                sgx += gk[i][j] * xk[i][j];
            }
        }
    }
}

// LOOP 2, pass 2: dx of the row from the kept xhat and g (out: the row's first element).
template <typename T, int VPT, int N>
__device__ __forceinline__ void norm_tma_dx_keep(int nvec, float rs, float mg, float mgx, const float (&xk)[VPT][N],
                                                 const float (&gk)[VPT][N], T* __restrict__ out) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int k = i * blockDim.x + threadIdx.x;
        if (k < nvec) {
            float o[N];
#pragma unroll
            for (int j = 0; j < N; ++j) o[j] = rs * (gk[i][j] - mg - xk[i][j] * mgx);
            *reinterpret_cast<uint4*>(out + (i64)k * N) = pack_f32<T>(o);
        }
    }
}

template <typename T, int VPT, int ACC, int CL, int LOOP>
__device__ __forceinline__ void norm_bwd_tma_body(NORM_TMA_PARAMS) {
    static_assert(ACC >= 1 && ACC <= 2, "dw (and db)");
    static_assert(LOOP >= 0 && LOOP <= 2, "row loop variant");
    constexpr int N = VecT<T>::N;
    constexpr bool WR = LOOP >= 1, KEEP = LOOP == 2;
    extern __shared__ __align__(128) unsigned char norm_rows[];
    __shared__ unsigned long long full[NORM_TMA_MAX_STAGES];
    __shared__ float2 red[2][32];  // block_sum2 (red[0]) or block_sum2_1b (red[row parity])
    grid_dependents_launch();  // a programmatic dependent launch after this one (column_sum) may start its blocks
    const int nvec = cols / N;
    const i64 mine = rows > (i64)blockIdx.x ? (rows - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int early = (opts & 15) && (opts & 15) < stages ? (opts & 15) : stages;
    const bool one_barrier = opts & 16;
    float nmu = 0.f, nrs = 0.f;
    if (mine > 0) {  // before the bulk copies, so these loads are not queued behind them
        nmu = rms ? 0.f : mean[blockIdx.x];
        nrs = rstd[blockIdx.x];
    }
    T* sbuf = reinterpret_cast<T*>(norm_rows);  // stage s: x at sbuf + 2 s cols, dy at sbuf + (2 s + 1) cols
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
        mbar_init_fence();
        for (int s = 0; s < early && s < mine; ++s)
            norm_tma_fill<T>(sbuf, full, s, x, dy, blockIdx.x + (i64)s * gridDim.x, cols);
    }
    float wr[VPT][N];  // the weight where WR
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int k = i * blockDim.x + threadIdx.x;
        if constexpr (WR) {
            if (w && k < nvec) {
                load_any<T, N>(w, (i64)k * N, wf32, wr[i]);
            } else {
#pragma unroll
                for (int j = 0; j < N; ++j) wr[i][j] = 1.f;
            }
        }
    }
    __syncthreads();
    float aw[VPT][N], ab[VPT][N];
#pragma unroll
    for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) aw[i][j] = ab[i][j] = 0.f;
    const float inv_cols = 1.f / cols;
    int s = 0;
    unsigned phase = 0;
    for (i64 it = 0; it < mine; ++it) {
        const i64 row = blockIdx.x + it * gridDim.x;
        const float mu = nmu, rs = nrs;
        if (it + 1 < mine) {
            nmu = rms ? 0.f : mean[row + gridDim.x];
            nrs = rstd[row + gridDim.x];
        }
        mbar_wait(&full[s], phase);
        if (it == 0 && threadIdx.x == 0)  // the stages not filled at entry: rows early .. stages - 1
            for (int f = early; f < stages && f < mine; ++f)
                norm_tma_fill<T>(sbuf, full, f, x, dy, blockIdx.x + (i64)f * gridDim.x, cols);
        const T* xs = sbuf + (i64)2 * s * cols;
        float sg = 0.f, sgx = 0.f;
        float xk[VPT][N], gk[VPT][N];  // LOOP 2: the row's xhat and g between the passes
        if constexpr (KEEP)
            norm_tma_pass_keep<T, VPT, ACC, N>(xs, xs + cols, nvec, wr, mu, rs, sg, sgx, xk, gk, aw, ab);
        else
            norm_tma_pass<T, VPT, ACC, N, false, WR>(xs, xs + cols, w, nvec, wf32, wr, mu, rs, sg, sgx, dx, aw, ab);
        if (one_barrier)
            block_sum2_1b(sg, sgx, red[it & 1]);
        else
            block_sum2(sg, sgx, reinterpret_cast<float*>(red[0]));
        if (threadIdx.x == 0) {
            if constexpr (KEEP) {  // every thread is past this row's pass 1, the last read of its stage: refill it
                if (it + stages < mine) {
                    fence_proxy_async();
                    norm_tma_fill<T>(sbuf, full, s, x, dy, row + (i64)stages * gridDim.x, cols);
                }
            } else if (it >= 1 && it - 1 + stages < mine) {  // every thread is past the previous row: refill its stage
                fence_proxy_async();
                norm_tma_fill<T>(sbuf, full, s == 0 ? stages - 1 : s - 1, x, dy,
                                 row + (i64)(stages - 1) * gridDim.x, cols);
            }
        }
        float mg = rms ? 0.f : sg * inv_cols, mgx = sgx * inv_cols;
        if constexpr (KEEP)
            norm_tma_dx_keep<T, VPT, N>(nvec, rs, mg, mgx, xk, gk, dx + row * cols);
        else
            norm_tma_pass<T, VPT, ACC, N, true, WR>(xs, xs + cols, w, nvec, wf32, wr, mu, rs, mg, mgx,
                                                    dx + row * cols, aw, ab);
        if (++s == stages) {
            s = 0;
            phase ^= 1u;
        }
    }
    if constexpr (CL > 1) {
        __syncthreads();  // every thread is done with the stage buffers: they take the partials
        parts_write_cluster<ACC, VPT, N, CL, false>(aw, ab, dw_part, db_part, cols, nvec, blockDim.x, threadIdx.x,
                                                    0, 1, reinterpret_cast<float*>(norm_rows));
        return;
    }
    const i64 base = (i64)blockIdx.x * cols;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int k = i * blockDim.x + threadIdx.x;
        if (k < nvec) {
            if (dw_part) store_f32<float, N>(dw_part + base + (i64)k * N, aw[i]);
            if (ACC == 2 && db_part) store_f32<float, N>(db_part + base + (i64)k * N, ab[i]);
        }
    }
}

template <typename T, int VPT, int ACC, int REGS, int LOOP>
__global__ void __maxnreg__(REGS) norm_bwd_tma(NORM_TMA_PARAMS) {
    norm_bwd_tma_body<T, VPT, ACC, 1, LOOP>(NORM_TMA_ARGS);
}

template <typename T, int VPT, int ACC, int CL, int REGS, int LOOP>
__global__ void __cluster_dims__(CL, 1, 1) __maxnreg__(REGS) norm_bwd_tma_cl(NORM_TMA_PARAMS) {
    norm_bwd_tma_body<T, VPT, ACC, CL, LOOP>(NORM_TMA_ARGS);
}
#endif

// out[c] = sum_p part[p, c], in T (the weight's dtype). Block (32, 32).
template <typename T>
__global__ void column_sum(const float* __restrict__ part, T* __restrict__ out, int parts, int cols) {
    column_sum_body<T>(part, out, parts, cols);
}
