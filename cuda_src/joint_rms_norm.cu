// RMSNorm over the last dim of one or two strided parts (B, L_p, H, D), written as ONE contiguous (B, L0 + L1, H, D)
// tensor, part 0's tokens first: the q (or k) of a joint attention, rms_norm(q_context) w0 ++ rms_norm(q_image) w1,
// read straight from the qkv projection's strided views (no copies of them, no concatenation). The backward (dx only:
// flame_core/ops/joint_rms_norm.py takes these kernels when no gain needs a gradient) reads the same strided views
// and the joint gradient, and writes each part's dx contiguous. Statistics and math in fp32; a gain is T or fp32
// (wf32 = 1) or absent (null); y = (x * rstd) * w as the norms.cu kernels round it.
//
// Rows (b, l, h) in the joint order are handled by groups of G threads (a power of two <= 32: several rows per warp,
// shuffle reductions over the group), N elements per thread and step (vec = 1: one 16-byte vector, N = 16 /
// sizeof(T), when every row start is 16-byte aligned; else N = 1), at most 16 / N steps (16 values cached per
// thread), so D <= 16 G <= 512. Each block
// walks row blocks b, b + gridDim.x, ... (the loop bound is uniform over the block: the shuffles see full warps).
//
// rope (null: none): Flux's rotary embedding applied to the normalised rows before the one rounding -- per joint token
// row (b, l) a table of D / 2 row-major 2x2 fp32 matrices at rope + ((b (L0 + L1) + l) D / 2) 4 (the layout of
// flame_models.bfl.ops.rope_rows) -- so the attention reads q / k rotated without a RoPE pass over them; the backward
// rotates the incoming gradient back (the transposed matrices) before the norm's rule. Only with vec = 1 (the pairs
// of a row lie within one thread's vector; the host checks).
#include "rope_pairs.cuh"
#include "row_gain.cuh"

template <typename T>
struct JrmsPart {
    const T* x;
    i64 sb, sl, sh;
    int L;
    const void* w;
};

// Row rr of the joint order (b, l, h): its part (second), token within the part (lp), input row and gain.
template <typename T>
struct JrmsRow {
    const T* src;
    const void* w;
    int b, h, l, lp;
    bool second;
    JrmsRow() = default;
    __device__ __forceinline__ JrmsRow(const JrmsPart<T>& p0, const JrmsPart<T>& p1, i64 rr, int H) {
        const int Lt = p0.L + p1.L;
        l = (int)((rr / H) % Lt);
        h = (int)(rr % H);
        b = (int)(rr / ((i64)H * Lt));
        second = l >= p0.L;
        lp = second ? l - p0.L : l;
        src = second ? p1.x + b * p1.sb + (i64)lp * p1.sl + h * p1.sh : p0.x + b * p0.sb + (i64)lp * p0.sl + h * p0.sh;
        w = second ? p1.w : p0.w;
    }
    // this row's RoPE tables from column c on (rope non-null)
    __device__ __forceinline__ const float* rope_at(const float* rope, int Lt, int D, int c) const {
        return rope + (((i64)b * Lt + l) * (D / 2) + c / 2) * 4;
    }
};

// The bodies: each group of G threads holds R rows at once (R = 2 on the vector path when one step covers the row,
// K = 1: two rows' loads in flight per thread, where one left the copy bandwidth half used), K steps of N values.
template <typename T, int N, int K, int R>
__device__ __forceinline__ void jrms_fwd_body(JrmsPart<T> p0, JrmsPart<T> p1, T* __restrict__ y,
                                              const float* __restrict__ rope, int B, int H, int D, int G, float eps,
                                              int wf32) {
    const int Lt = p0.L + p1.L, t = threadIdx.x % G, rpb = blockDim.x / G;
    const i64 rows = (i64)B * Lt * H;
    for (i64 base = (i64)blockIdx.x * rpb * R; base < rows; base += (i64)gridDim.x * rpb * R) {
        JrmsRow<T> row[R];
        bool valid[R];
        float v[R][K][N], ss[R];
#pragma unroll
        for (int q = 0; q < R; ++q) {
            const i64 r = base + q * rpb + threadIdx.x / G;
            valid[q] = r < rows;
            row[q] = JrmsRow<T>(p0, p1, valid[q] ? r : 0, H);
            ss[q] = 0.f;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int c = (t + k * G) * N;
                if (valid[q] && c < D) load_f32<T, N>(row[q].src + c, v[q][k]);
            }
        }
#pragma unroll
        for (int q = 0; q < R; ++q)
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (valid[q] && (t + k * G) * N < D)
#pragma unroll
                    for (int j = 0; j < N; ++j) ss[q] += v[q][k][j] * v[q][k][j];
        for (int o = G >> 1; o > 0; o >>= 1)
#pragma unroll
            for (int q = 0; q < R; ++q) ss[q] += __shfl_xor_sync(0xffffffffu, ss[q], o);
#pragma unroll
        for (int q = 0; q < R; ++q) {
            if (!valid[q]) continue;
            const float rs = rsqrtf(ss[q] / D + eps);
            T* dst = y + (base + q * rpb + threadIdx.x / G) * D;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int c = (t + k * G) * N;
                if (c < D) {
                    float o[N];
#pragma unroll
                    for (int j = 0; j < N; ++j) o[j] = v[q][k][j] * rs;
                    mul_gain<T, N>(row[q].w, c, wf32, o);
                    if constexpr (N % 2 == 0) {
                        if (rope) {
                            float rot[N];
                            rope_pairs<N>(row[q].rope_at(rope, Lt, D, c), o, rot, 0);
                            store_f32<T, N>(dst + c, rot);
                            continue;
                        }
                    }
                    store_f32<T, N>(dst + c, o);
                }
            }
        }
    }
}

// dx = rstd (g w - xhat mean(g w xhat)), xhat = x rstd, rstd recomputed from x (the forward's, bit for bit);
// g: the joint gradient (B, L0 + L1, H, D) contiguous; dx0 / dx1: (B, L_p, H, D) contiguous. gw = the incoming
// gradient rotated back (rope) and times the gain: the gradient of the normalised row.
template <typename T, int N>
__device__ __forceinline__ void jrms_grad_in(const JrmsRow<T>& row, const float* __restrict__ rope, int Lt, int D,
                                             int c, int wf32, float (&gw)[N]) {
    if constexpr (N % 2 == 0) {
        if (rope) {  // the rotation transposed
            float rot[N];
            rope_pairs<N>(row.rope_at(rope, Lt, D, c), gw, rot, 1);
#pragma unroll
            for (int j = 0; j < N; ++j) gw[j] = rot[j];
        }
    }
    mul_gain<T, N>(row.w, c, wf32, gw);
}

template <typename T>
__device__ __forceinline__ T* jrms_dx_row(const JrmsRow<T>& row, const JrmsPart<T>& p0, const JrmsPart<T>& p1,
                                          T* __restrict__ dx0, T* __restrict__ dx1, int H, int D) {
    return (row.second ? dx1 : dx0) + (((i64)row.b * (row.second ? p1.L : p0.L) + row.lp) * H + row.h) * D;
}

template <typename T, int N>
__device__ __forceinline__ void jrms_bwd_body(JrmsPart<T> p0, JrmsPart<T> p1, const T* __restrict__ g,
                                              T* __restrict__ dx0, T* __restrict__ dx1, const float* __restrict__ rope,
                                              int B, int H, int D, int G, float eps, int wf32) {
    constexpr int K = N >= 16 ? 1 : 16 / N;
    const int Lt = p0.L + p1.L, t = threadIdx.x % G, rpb = blockDim.x / G;
    const i64 rows = (i64)B * Lt * H;
    for (i64 base = (i64)blockIdx.x * rpb; base < rows; base += (i64)gridDim.x * rpb) {
        const i64 r = base + threadIdx.x / G;
        const bool valid = r < rows;
        const i64 rr = valid ? r : 0;
        const JrmsRow<T> row(p0, p1, rr, H);
        const T* gr = g + rr * D;
        float v[K][N], gw[K][N];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (valid && c < D) {
                load_f32<T, N>(row.src + c, v[k]);
                load_f32<T, N>(gr + c, gw[k]);
                jrms_grad_in<T, N>(row, rope, Lt, D, c, wf32, gw[k]);
#pragma unroll
                for (int j = 0; j < N; ++j) ss += v[k][j] * v[k][j];
            }
        }
        for (int o = G >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float rs = rsqrtf(ss / D + eps);
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (valid && c < D) {
#pragma unroll
                for (int j = 0; j < N; ++j) dot += gw[k][j] * (v[k][j] * rs);
            }
        }
        for (int o = G >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        dot /= D;
        if (!valid) continue;
        T* dst = jrms_dx_row(row, p0, p1, dx0, dx1, H, D);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (c < D) {
                float o[N];
#pragma unroll
                for (int j = 0; j < N; ++j) o[j] = rs * (gw[k][j] - (v[k][j] * rs) * dot);
                store_f32<T, N>(dst + c, o);
            }
        }
    }
}

// The vector path where one 16-byte step covers a row (G N >= D): two rows per group at once (both rows' x and g
// loads in flight before any use), x kept as its raw 16 bytes and widened where it is used (registers for two rows
// at the one-row path's count).
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float (&v)[VecT<T>::N]) {
    union { uint4 q; T t[VecT<T>::N]; } u;
    u.q = raw;
#pragma unroll
    for (int j = 0; j < VecT<T>::N; ++j) v[j] = to_f32(u.t[j]);
}

template <typename T>
__device__ __forceinline__ void jrms_bwd_rows2(JrmsPart<T> p0, JrmsPart<T> p1, const T* __restrict__ g,
                                               T* __restrict__ dx0, T* __restrict__ dx1,
                                               const float* __restrict__ rope, int B, int H, int D, int G, float eps,
                                               int wf32) {
    constexpr int N = VecT<T>::N;
    const int Lt = p0.L + p1.L, t = threadIdx.x % G, rpb = blockDim.x / G, c = t * N;
    const bool in = c < D;
    const i64 rows = (i64)B * Lt * H;
    for (i64 base = (i64)blockIdx.x * rpb * 2; base < rows; base += (i64)gridDim.x * rpb * 2) {
        JrmsRow<T> row[2];
        bool ok[2];
        uint4 xr[2];
        float gw[2][N], ss[2], dot[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const i64 r = base + q * rpb + threadIdx.x / G;
            ok[q] = r < rows && in;
            row[q] = JrmsRow<T>(p0, p1, r < rows ? r : 0, H);
            if (ok[q]) {
                xr[q] = *reinterpret_cast<const uint4*>(row[q].src + c);
                load_f32<T, N>(g + r * D + c, gw[q]);
            }
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            ss[q] = dot[q] = 0.f;
            if (ok[q]) {
                float v[N];
                unpack16<T>(xr[q], v);
                jrms_grad_in<T, N>(row[q], rope, Lt, D, c, wf32, gw[q]);
#pragma unroll
                for (int j = 0; j < N; ++j) ss[q] += v[j] * v[j];
            }
        }
        for (int o = G >> 1; o > 0; o >>= 1)
#pragma unroll
            for (int q = 0; q < 2; ++q) ss[q] += __shfl_xor_sync(0xffffffffu, ss[q], o);
        float rs[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            rs[q] = rsqrtf(ss[q] / D + eps);
            if (ok[q]) {
                float v[N];
                unpack16<T>(xr[q], v);
#pragma unroll
                for (int j = 0; j < N; ++j) dot[q] += gw[q][j] * (v[j] * rs[q]);
            }
        }
        for (int o = G >> 1; o > 0; o >>= 1)
#pragma unroll
            for (int q = 0; q < 2; ++q) dot[q] += __shfl_xor_sync(0xffffffffu, dot[q], o);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            if (!ok[q]) continue;
            float v[N], o[N];
            unpack16<T>(xr[q], v);
            const float dq = dot[q] / D;
#pragma unroll
            for (int j = 0; j < N; ++j) o[j] = rs[q] * (gw[q][j] - (v[j] * rs[q]) * dq);
            store_f32<T, N>(jrms_dx_row(row[q], p0, p1, dx0, dx1, H, D) + c, o);
        }
    }
}

#define JRMS_PART_PARAMS(i) const T *x##i, i64 sb##i, i64 sl##i, i64 sh##i, int L##i, const void *w##i
#define JRMS_PART(i) JrmsPart<T>{x##i, sb##i, sl##i, sh##i, L##i, w##i}

template <typename T>
__global__ void __launch_bounds__(256, 4) joint_rms_norm_fwd(JRMS_PART_PARAMS(0), JRMS_PART_PARAMS(1), T* __restrict__ y,
                                   const float* __restrict__ rope, int B, int H, int D, int G, float eps, int wf32,
                                   int vec) {
    constexpr int N = VecT<T>::N;
    if (vec && G * N >= D)  // one step covers the row: two rows per group at once
        jrms_fwd_body<T, N, 1, 2>(JRMS_PART(0), JRMS_PART(1), y, rope, B, H, D, G, eps, wf32);
    else if (vec)
        jrms_fwd_body<T, N, (N >= 16 ? 1 : 16 / N), 1>(JRMS_PART(0), JRMS_PART(1), y, rope, B, H, D, G, eps, wf32);
    else
        jrms_fwd_body<T, 1, 16, 1>(JRMS_PART(0), JRMS_PART(1), y, nullptr, B, H, D, G, eps, wf32);
}

template <typename T>
__global__ void __launch_bounds__(256, 3) joint_rms_norm_bwd(JRMS_PART_PARAMS(0), JRMS_PART_PARAMS(1), const T* __restrict__ g,
                                   T* __restrict__ dx0, T* __restrict__ dx1, const float* __restrict__ rope, int B,
                                   int H, int D, int G, float eps, int wf32, int vec) {
    if (vec)
        jrms_bwd_body<T, VecT<T>::N>(JRMS_PART(0), JRMS_PART(1), g, dx0, dx1, rope, B, H, D, G, eps, wf32);
    else
        jrms_bwd_body<T, 1>(JRMS_PART(0), JRMS_PART(1), g, dx0, dx1, nullptr, B, H, D, G, eps, wf32);
}

// The backward where 16-byte vectors hold the rows and one step covers a row (vec, G N >= D: the host picks it),
// two rows per group at once -- its own kernel: inside joint_rms_norm_bwd the three paths together spilled
template <typename T>
__global__ void __launch_bounds__(256, 3) joint_rms_norm_bwd_rows2(JRMS_PART_PARAMS(0), JRMS_PART_PARAMS(1),
                                   const T* __restrict__ g, T* __restrict__ dx0, T* __restrict__ dx1,
                                   const float* __restrict__ rope, int B, int H, int D, int G, float eps, int wf32,
                                   int vec) {
    jrms_bwd_rows2<T>(JRMS_PART(0), JRMS_PART(1), g, dx0, dx1, rope, B, H, D, G, eps, wf32);
}
