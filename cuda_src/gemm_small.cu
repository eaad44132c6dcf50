// GEMMs of SMALL problems (the per-op host overhead path, flame_core/kernels/gemm_small.py): where a product has a
// few hundred thousand multiply-adds the GPU finishes it in a few microseconds and the cost of an eager linear layer
// is the host's -- a cuBLAS or cuBLASLt call spends 10-15 us of host time in the library (its heuristics and
// checks) on top of the Python call. These kernels are launched through launching.PackedLaunch (a dict hit and one
// driver launch), and a linear layer's whole backward (dx, dW and db) is ONE launch.
//
// Classic shared-memory tiling: a 16 x 16 thread block computes a 16 x 16 tile of C, stepping over the reduction in
// 64-wide slabs of A and B staged in shared memory as fp32 (the load mapping picked per operand so that consecutive
// threads read consecutive addresses); fp32 accumulation, one rounding to T (with the bias added in fp32 first, as
// cuBLASLt's bias epilogue). The host sends problems of at most 2^20 multiply-adds with every dimension below 2^16.
//
//   C[i, j] = sum_r A[i * sai + r * sar] * B[j * sbj + r * sbr] (+ bias[j]), C row-major (I, J);
//   rsum[i] = sum_r A[i * sai + r * sar] (the bias gradient of a linear layer: db[n] = sum_m g[m, n]).
#include "common.cuh"

#define GS_T 16   // the output tile's edge (the block is GS_T x GS_T threads)
#define GS_R 64   // the reduction slab: each thread stages GS_R / GS_T elements of A and of B per slab

typedef float GsSlab[GS_T][GS_R + 1];   // one operand's slab in shared memory, [i or j][r], fp32

// The tile's work for one layout of the operands, fixed at compile time (no per-element branch on it): AROW / BROW
// when r is A's / B's contiguous axis (the slab is loaded with threads along r), else the transposed read (threads
// along i / j); DO_C false computes only the row sums.
template <typename T, bool AROW, bool BROW, bool DO_C>
__device__ __forceinline__ void gs_tile_t(const T* __restrict__ A, int sai, int sar, const T* __restrict__ B,
                                          int sbj, int sbr, const T* bias, T* C, int I, int J, int R, T* rsum,
                                          GsSlab& As, GsSlab& Bs) {
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int i0 = blockIdx.y * GS_T, j0 = blockIdx.x * GS_T;
    // the thread's (row, first r) in each slab: along r (row ty, r tx) or transposed (row tx, r ty)
    const int ai = i0 + (AROW ? ty : tx), ar = AROW ? tx : ty;
    const int bj = j0 + (BROW ? ty : tx), br = BROW ? tx : ty;
    float acc = 0.f, rs = 0.f;
    for (int r0 = 0; r0 < R; r0 += GS_R) {
        // every load of the slab into registers first, then into shared memory: the loads are issued together
        float ra[GS_R / GS_T], rb[GS_R / GS_T];
#pragma unroll
        for (int q = 0; q < GS_R / GS_T; ++q) {
            const int r = r0 + ar + q * GS_T;
            ra[q] = (ai < I && r < R) ? to_f32(A[ai * sai + (AROW ? r : r * sar)]) : 0.f;
            if (DO_C) {
                const int rr = r0 + br + q * GS_T;
                rb[q] = (bj < J && rr < R) ? to_f32(B[bj * sbj + (BROW ? rr : rr * sbr)]) : 0.f;
            }
        }
#pragma unroll
        for (int q = 0; q < GS_R / GS_T; ++q) {
            As[AROW ? ty : tx][ar + q * GS_T] = ra[q];
            if (DO_C) Bs[BROW ? ty : tx][br + q * GS_T] = rb[q];
        }
        __syncthreads();
        if (DO_C) {
#pragma unroll 16
            for (int r = 0; r < GS_R; ++r) acc = fmaf(As[ty][r], Bs[tx][r], acc);
        }
        if (rsum != nullptr && tx == 0) {
#pragma unroll 16
            for (int r = 0; r < GS_R; ++r) rs += As[ty][r];
        }
        __syncthreads();
    }
    const int i = i0 + ty, j = j0 + tx;
    if (DO_C && i < I && j < J) {
        if (bias != nullptr) acc += to_f32(bias[j]);
        C[i * J + j] = from_f32<T>(acc);
    }
    if (rsum != nullptr && tx == 0 && i < I) rsum[i] = from_f32<T>(rs);
}

// The layouts picked once per block (a uniform branch), the slabs declared once for every variant.
template <typename T>
__device__ __forceinline__ void gs_tile(const T* A, int sai, int sar, const T* B, int sbj, int sbr, const T* bias,
                                        T* C, int I, int J, int R, T* rsum, bool do_c) {
    __shared__ GsSlab As, Bs;
    if (!do_c) {
        if (sar == 1) gs_tile_t<T, true, true, false>(A, sai, sar, B, sbj, sbr, bias, C, I, J, R, rsum, As, Bs);
        else gs_tile_t<T, false, true, false>(A, sai, sar, B, sbj, sbr, bias, C, I, J, R, rsum, As, Bs);
    } else if (sar == 1) {
        if (sbr == 1) gs_tile_t<T, true, true, true>(A, sai, sar, B, sbj, sbr, bias, C, I, J, R, rsum, As, Bs);
        else gs_tile_t<T, true, false, true>(A, sai, sar, B, sbj, sbr, bias, C, I, J, R, rsum, As, Bs);
    } else {
        if (sbr == 1) gs_tile_t<T, false, true, true>(A, sai, sar, B, sbj, sbr, bias, C, I, J, R, rsum, As, Bs);
        else gs_tile_t<T, false, false, true>(A, sai, sar, B, sbj, sbr, bias, C, I, J, R, rsum, As, Bs);
    }
}

// C (I, J) = A @ B (+ bias) with A's and B's element strides as above (a linear layer's forward: A = x (M, K) with
// strides (K, 1), B = w (N, K) read as (j = n, r = k): (K, 1); a plain x @ w: B strides (1, N)). grid (ceil(J / 16),
// ceil(I / 16)), block (16, 16). bias may be null.
template <typename T>
__global__ void gs_gemm(const T* A, const T* B, const T* bias, T* C, int I, int J, int R, int sai, int sar, int sbj,
                        int sbr) {
    gs_tile<T>(A, sai, sar, B, sbj, sbr, bias, C, I, J, R, nullptr, true);
}

// A linear layer's backward from g (M, N), x (M, K) and w (N, K), every one C-contiguous, in one launch:
//   blockIdx.z == 0: dx (M, K) = g @ w          (i = m, j = k, r = n)
//   blockIdx.z == 1: dw (N, K) = g^T @ x        (i = n, j = k, r = m), and db (N) = g summed over m by the blocks of
//                    the first column of tiles (db may be written without dw: x may then be null)
// A null output is not computed (its operands may be null too). grid (ceil(K / 16), ceil(max(M, N) / 16), 2).
template <typename T>
__global__ void gs_linear_bwd(const T* g, const T* x, const T* w, T* dx, T* dw, T* db, int M, int N, int K) {
    if (blockIdx.z == 0) {
        if (dx == nullptr || blockIdx.y * GS_T >= M) return;  // uniform over the block: no barrier is left waiting
        gs_tile<T>(g, N, 1, w, 1, K, nullptr, dx, M, K, N, nullptr, true);
    } else {
        T* rs = (db != nullptr && blockIdx.x == 0) ? db : nullptr;
        const bool c = dw != nullptr;
        if ((!c && rs == nullptr) || blockIdx.y * GS_T >= N) return;
        gs_tile<T>(g, 1, N, x, 1, K, nullptr, dw, N, K, M, rs, c);
    }
}
