// FlashAttention-2 forward: O = softmax(scale * Q K^T + mask) V, tiled with an online softmax so that no Lq x Lk
// matrix exists; stores O and the row logsumexp (natural log, fp32; +inf for a row that attends nothing).
// One CTA per (BM query rows, head, batch); each of the NW warps owns BM/NW rows. K and V tiles of BN keys stream
// through shared memory with cp.async (V(n) loads during S = Q K(n)^T, K(n-1) during O += P V(n)); P stays in
// registers as the A operand of the second product. Scores are kept in log2 units (exp2, scale folded in).
// Q, K, V, O: (B, H, L, ·) with any batch/head/row strides (elements), unit column stride, 16-byte aligned rows;
// the head dim d (a multiple of 8, <= D) is zero-padded to the tile width D inside shared memory.
// OPT bit 0: wait for V(n) and issue K(n-1) before the softmax (FlashAttention-2's order) instead of after it;
// OPT bit 1: software-pipelined fragment reads (fa_warp_gemm PIPE) in both products.
#include "flash_attention.cuh"

template <typename T, int D, int BM, int BN, int NW, int MASK, int OPT>
__global__ void __launch_bounds__(NW * 32)
flash_attn_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
               float* __restrict__ lse, const void* __restrict__ mask, int H, int Lq, int Lk, int d,
               fa_i64 q_sb, fa_i64 q_sh, fa_i64 q_sl, fa_i64 k_sb, fa_i64 k_sh, fa_i64 k_sl,
               fa_i64 v_sb, fa_i64 v_sh, fa_i64 v_sl, fa_i64 o_sb, fa_i64 o_sh, fa_i64 o_sl,
               fa_i64 m_sb, fa_i64 m_sh, fa_i64 m_sq, fa_i64 m_sk, float scale_log2, int causal) {
    constexpr int NTHREADS = NW * 32;
    constexpr int RW = BM / NW;      // query rows per warp
    constexpr int MT = RW / 16;      // m16 tiles per warp
    constexpr int NTS = BN / 8;      // n8 tiles of S per warp
    constexpr int NTO = D / 8;       // n8 tiles of O per warp
    constexpr bool PRESCALED = MASK == FA_MASK_FLOAT;  // scores carry scale and mask before the max
    static_assert(RW % 16 == 0 && BN % 16 == 0, "tile shape");

    extern __shared__ __align__(128) unsigned char fa_smem[];
    const fa_u32 sQ = fa_smem_addr(fa_smem);
    const fa_u32 sK = sQ + BM * D * 2;
    const fa_u32 sV = sK + BN * D * 2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int m_block = gridDim.x - 1 - blockIdx.x;  // under a causal mask the longest blocks start first
    const int h = blockIdx.y, b = blockIdx.z;
    const int m0 = m_block * BM;
    const int wrow = m0 + warp * RW;  // first query row of this warp

    const T* qg = q + b * q_sb + h * q_sh + (fa_i64)m0 * q_sl;
    const T* kg = k + b * k_sb + h * k_sh;
    const T* vg = v + b * v_sb + h * v_sh;
    const fa_i64 moff = b * m_sb + h * m_sh;

    int n_blocks = (Lk + BN - 1) / BN;
    if (causal) n_blocks = min(n_blocks, (min(m0 + BM, Lq) - 1) / BN + 1);

    fa_load_tile<BM, D, NTHREADS>(sQ, qg, q_sl, Lq - m0, d, tid);
    if (n_blocks > 0)
        fa_load_tile<BN, D, NTHREADS>(sK, kg + (fa_i64)(n_blocks - 1) * BN * k_sl, k_sl, Lk - (n_blocks - 1) * BN,
                                      d, tid);
    fa_cp_async_commit();

    float acc_o[MT][NTO][4];
    fa_zero(acc_o);
    float row_m[MT][2], row_l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) row_m[mt][hh] = FA_NEG_INF, row_l[mt][hh] = 0.f;
    const float sl2 = PRESCALED ? 1.f : scale_log2;

    for (int n = n_blocks - 1; n >= 0; --n) {
        const int n0 = n * BN;
        fa_cp_async_wait_all();
        __syncthreads();  // K(n) visible; every warp is done with V(n+1)
        fa_load_tile<BN, D, NTHREADS>(sV, vg + (fa_i64)n0 * v_sl, v_sl, Lk - n0, d, tid);
        fa_cp_async_commit();

        // S = Q K^T
        float s[MT][NTS][4];
        fa_zero(s);
        fa_warp_gemm<T, MT, NTS, D / 16, false, false, D, D, (OPT & 2) != 0>(
            s, FaFrag<D>(sQ, warp * RW, 0, lane, false), FaFrag<D>(sK, 0, 0, lane, true));

        // mask: key padding, causal, user mask (uniform per warp)
        if (MASK != FA_MASK_NONE || n0 + BN > Lk || (causal && n0 + BN - 1 > wrow)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = wrow + mt * 16 + g + (e >> 1) * 8;
                        const int col = n0 + nt * 8 + t4 * 2 + (e & 1);
                        float add;
                        const bool keep = fa_keep<MASK>(row, col, Lq, Lk, causal, mask, moff, m_sq, m_sk, add);
                        float x = s[mt][nt][e];
                        if (PRESCALED) x = fmaf(x, scale_log2, add);
                        s[mt][nt][e] = keep ? x : FA_NEG_INF;
                    }
        }

        if (OPT & 1) {
            fa_cp_async_wait_all();
            __syncthreads();  // V(n) visible; every warp is done with K(n)
            if (n > 0) {
                fa_load_tile<BN, D, NTHREADS>(sK, kg + (fa_i64)(n0 - BN) * k_sl, k_sl, Lk - (n0 - BN), d, tid);
                fa_cp_async_commit();
            }
        }

        // online softmax: rescale the running output, P = exp2(S - rowmax) in place
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float mx = FA_NEG_INF;
#pragma unroll
                for (int nt = 0; nt < NTS; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(row_m[mt][hh], mx);
                const float ms = m_new == FA_NEG_INF ? 0.f : m_new * sl2;
                const float corr = fa_exp2(row_m[mt][hh] * sl2 - ms);
                row_m[mt][hh] = m_new;
                float l = row_l[mt][hh] * corr;
#pragma unroll
                for (int dt = 0; dt < NTO; ++dt) acc_o[mt][dt][2 * hh] *= corr, acc_o[mt][dt][2 * hh + 1] *= corr;
#pragma unroll
                for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = fa_exp2(fmaf(s[mt][nt][2 * hh + e], sl2, -ms));
                        s[mt][nt][2 * hh + e] = p;
                        l += p;
                    }
                row_l[mt][hh] = l;
            }

        // P as bf16/fp16 A fragments of the second product (the fp32 scores die here)
        fa_u32 pa[BN / 16][MT][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[kk][mt][0] = FaType<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[kk][mt][1] = FaType<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[kk][mt][2] = FaType<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[kk][mt][3] = FaType<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }

        if (!(OPT & 1)) {
            fa_cp_async_wait_all();
            __syncthreads();  // V(n) visible; every warp is done with K(n)
            if (n > 0) {
                fa_load_tile<BN, D, NTHREADS>(sK, kg + (fa_i64)(n0 - BN) * k_sl, k_sl, Lk - (n0 - BN), d, tid);
                fa_cp_async_commit();
            }
        }

        // O += P V
        const FaFrag<D> fv(sV, 0, 0, lane, false);
        constexpr int DP = D / 16;
        fa_u32 bb[2][4];
        if (OPT & 2) fa_ldsm_x4_t(bb[0], fv.at(0, 0));
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int dp = 0; dp < DP; ++dp) {
                const int step = kk * DP + dp, cur = (OPT & 2) ? (step & 1) : 0;
                if (OPT & 2) {
                    if (step + 1 < (BN / 16) * DP)
                        fa_ldsm_x4_t(bb[(step + 1) & 1], fv.at((step + 1) / DP * 16, (step + 1) % DP * 2));
                } else {
                    fa_ldsm_x4_t(bb[0], fv.at(kk * 16, dp * 2));
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    FaType<T>::mma(acc_o[mt][2 * dp], pa[kk][mt], bb[cur][0], bb[cur][1]);
                    FaType<T>::mma(acc_o[mt][2 * dp + 1], pa[kk][mt], bb[cur][2], bb[cur][3]);
                }
            }
        }
    }

    // O /= rowsum; logsumexp
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = row_l[mt][hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int row = wrow + mt * 16 + g + hh * 8;
            if (row < Lq) {
                T* orow = o + b * o_sb + h * o_sh + (fa_i64)row * o_sl;
#pragma unroll
                for (int dt = 0; dt < NTO; ++dt) {
                    const int col = dt * 8 + t4 * 2;
                    if (col < d)
                        *reinterpret_cast<fa_u32*>(orow + col) =
                            FaType<T>::pack(acc_o[mt][dt][2 * hh] * inv, acc_o[mt][dt][2 * hh + 1] * inv);
                }
                if (t4 == 0)
                    lse[((fa_i64)b * H + h) * Lq + row] =
                        l > 0.f ? (row_m[mt][hh] * sl2 + log2f(l)) * FA_LN2 : FA_POS_INF;
            }
        }
}
