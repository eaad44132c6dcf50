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
};

template <typename T, int N>
__device__ __forceinline__ void jrms_fwd_body(JrmsPart<T> p0, JrmsPart<T> p1, T* __restrict__ y,
                                              const float* __restrict__ rope, int B, int H, int D, int G, float eps,
                                              int wf32) {
    constexpr int K = N >= 16 ? 1 : 16 / N;
    const int Lt = p0.L + p1.L, t = threadIdx.x % G, rpb = blockDim.x / G;
    const i64 rows = (i64)B * Lt * H;
    for (i64 base = (i64)blockIdx.x * rpb; base < rows; base += (i64)gridDim.x * rpb) {
        const i64 r = base + threadIdx.x / G;
        const bool valid = r < rows;
        const i64 rr = valid ? r : 0;
        const JrmsRow<T> row(p0, p1, rr, H);
        const T* src = row.src;
        const void* wp = row.w;
        float v[K][N];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (valid && c < D) {
                load_f32<T, N>(src + c, v[k]);
#pragma unroll
                for (int j = 0; j < N; ++j) ss += v[k][j] * v[k][j];
            }
        }
        for (int o = G >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float rs = rsqrtf(ss / D + eps);
        if (!valid) continue;
        T* dst = y + rr * D;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (c < D) {
                float o[N];
#pragma unroll
                for (int j = 0; j < N; ++j) o[j] = v[k][j] * rs;
                mul_gain<T, N>(wp, c, wf32, o);
                if constexpr (N % 2 == 0) {
                    if (rope) {
                        float r[N];
                        rope_pairs<N>(rope + (((i64)row.b * Lt + row.l) * (D / 2) + c / 2) * 4, o, r, 0);
                        store_f32<T, N>(dst + c, r);
                        continue;
                    }
                }
                store_f32<T, N>(dst + c, o);
            }
        }
    }
}

// dx = rstd (g w - xhat mean(g w xhat)), xhat = x rstd, rstd recomputed from x (the forward's, bit for bit);
// g: the joint gradient (B, L0 + L1, H, D) contiguous; dx0 / dx1: (B, L_p, H, D) contiguous.
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
        const T* src = row.src;
        const void* wp = row.w;
        const T* gr = g + rr * D;
        float v[K][N], gw[K][N];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (t + k * G) * N;
            if (valid && c < D) {
                load_f32<T, N>(src + c, v[k]);
                load_f32<T, N>(gr + c, gw[k]);
                if constexpr (N % 2 == 0) {
                    if (rope) {  // the gradient of the normalised row: the rotation transposed
                        float r[N];
                        rope_pairs<N>(rope + (((i64)row.b * Lt + row.l) * (D / 2) + c / 2) * 4, gw[k], r, 1);
#pragma unroll
                        for (int j = 0; j < N; ++j) gw[k][j] = r[j];
                    }
                }
                mul_gain<T, N>(wp, c, wf32, gw[k]);
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
        T* dst = (row.second ? dx1 : dx0) + (((i64)row.b * (row.second ? p1.L : p0.L) + row.lp) * H + row.h) * D;
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

#define JRMS_PART_PARAMS(i) const T *x##i, i64 sb##i, i64 sl##i, i64 sh##i, int L##i, const void *w##i
#define JRMS_PART(i) JrmsPart<T>{x##i, sb##i, sl##i, sh##i, L##i, w##i}

template <typename T>
__global__ void __launch_bounds__(256, 4) joint_rms_norm_fwd(JRMS_PART_PARAMS(0), JRMS_PART_PARAMS(1), T* __restrict__ y,
                                   const float* __restrict__ rope, int B, int H, int D, int G, float eps, int wf32,
                                   int vec) {
    if (vec)
        jrms_fwd_body<T, VecT<T>::N>(JRMS_PART(0), JRMS_PART(1), y, rope, B, H, D, G, eps, wf32);
    else
        jrms_fwd_body<T, 1>(JRMS_PART(0), JRMS_PART(1), y, nullptr, B, H, D, G, eps, wf32);
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
