// FlashAttention-2 backward. P is recomputed from the logsumexp saved by the forward, never stored whole.
//   flash_attn_bwd_delta: delta_i = sum_d dO[i,d] * O[i,d]  (fp32), d / 8 lanes (at most 32) per row.
//   flash_attn_bwd:       one CTA per (BN keys, head, batch[, slice of the query blocks]); for each block of BM
//                         queries: S = Q K^T, P = exp2(S*scale*log2e - lse*log2e), dP = dO V^T, dS = P (dP - delta);
//                         dV += P^T dO and dK += dS^T Q in registers; dQ += dS K through fp32 atomics.
//                         P and dS pass through shared memory (the warps split S, dK/dV and dQ differently).
//                         When the query blocks are split over several CTAs (short key sequences, e.g. SDXL's 77
//                         text tokens) dK and dV are also summed with fp32 atomics.
//   flash_attn_convert:   dst = T(src * scale) for the fp32 accumulators, into any (B, H, L, d) strides (src may
//                         start at flattened element i0: the tail schedule's accumulators hold its last rows only),
//                         8 elements per thread.
// dtypes: float16, bfloat16
#include "flash_attention.cuh"

// G = d / 8 lanes (a power of two, at most 32) per row, 256 / G rows per block: every lane holds 16-byte pieces of
// O and dO (at d = 128 a warp covers two rows; one row per warp left half of its lanes idle).
template <typename T>
__global__ void __launch_bounds__(256)
flash_attn_bwd_delta(const T* __restrict__ o, const T* __restrict__ dout, float* __restrict__ delta, int H, int Lq,
                     int d, fa_i64 o_sb, fa_i64 o_sh, fa_i64 o_sl, fa_i64 g_sb, fa_i64 g_sh, fa_i64 g_sl) {
    int G = 1;
    while (G < 32 && G * 8 < d) G *= 2;
    const int lane = threadIdx.x % G;
    const int row = blockIdx.x * (256 / G) + threadIdx.x / G;
    const int h = blockIdx.y, b = blockIdx.z;
    const bool ok = row < Lq;  // no early return: the group's shuffles need every lane of the warp
    const T* orow = o + b * o_sb + h * o_sh + (fa_i64)(ok ? row : 0) * o_sl;
    const T* grow = dout + b * g_sb + h * g_sh + (fa_i64)(ok ? row : 0) * g_sl;
    float acc = 0.f;
    if (ok)
        for (int c = lane * 8; c < d; c += G * 8) {  // 16-byte pieces (d is a multiple of 8, rows 16-byte aligned)
            union { uint4 u; T t[8]; } x, y;
            x.u = *reinterpret_cast<const uint4*>(orow + c);
            y.u = *reinterpret_cast<const uint4*>(grow + c);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc += FaType<T>::to_float(x.t[j]) * FaType<T>::to_float(y.t[j]);
        }
    for (int off = G >> 1; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (ok && lane == 0) delta[((fa_i64)b * H + h) * Lq + row] = acc;
}

// One thread per 8 consecutive elements of a row (d and i0 are multiples of 8): the row's index arithmetic once per 8
// elements, two 16-byte loads, one 16-byte store where dst's rows allow (else element stores).
template <typename T>
__global__ void __launch_bounds__(256)
flash_attn_convert(const float* __restrict__ src, T* __restrict__ dst, int H, int L, int d, fa_i64 total,
                   fa_i64 d_sb, fa_i64 d_sh, fa_i64 d_sl, float scale, fa_i64 i0) {
    const bool v16 = ((d_sb | d_sh | d_sl) & 7) == 0 && (reinterpret_cast<unsigned long long>(dst) & 15ull) == 0;
    for (fa_i64 i = ((fa_i64)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < total;
         i += (fa_i64)gridDim.x * blockDim.x * 8) {
        const int col = (int)(i % d);
        const fa_i64 r = (i + i0) / d;  // i0: src holds the elements from i0 on (a multiple of d)
        const int row = (int)(r % L);
        const fa_i64 bh = r / L;
        const fa_i64 b = bh / H, h = bh % H;
        const float4 a = *reinterpret_cast<const float4*>(src + i), c = *reinterpret_cast<const float4*>(src + i + 4);
        union { uint4 u; fa_u32 w[4]; T t[8]; } o;
        o.w[0] = FaType<T>::pack(a.x * scale, a.y * scale);
        o.w[1] = FaType<T>::pack(a.z * scale, a.w * scale);
        o.w[2] = FaType<T>::pack(c.x * scale, c.y * scale);
        o.w[3] = FaType<T>::pack(c.z * scale, c.w * scale);
        T* p = dst + b * d_sb + h * d_sh + (fa_i64)row * d_sl + col;
        if (v16) {
            *reinterpret_cast<uint4*>(p) = o.u;
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) p[j] = o.t[j];
        }
    }
}

// flash_attn_convert_tiles: the same from the Hopper backward's tiled dQ accumulator (flash_attention_bwd_sm90.cu,
// DQB = 1): [B*H][query blocks of BM][NWG parts][64 x 64 tile in wgmma fragment order], a part being 64 query rows
// of the block (rowsplit, BM = 128) or 64 columns (BM = 64). One CTA per tile (grid-stride over `tiles`): its 16 KB
// read with coalesced 16-byte loads (a float4 of fragment order is rows rl and rl + 8 at columns cl, cl + 1), scaled,
// rounded and transposed through shared memory, then written as whole 128-byte rows (16-byte stores where `vec`: dst
// 16-byte aligned with strides in multiples of 8 elements). The per-element index arithmetic (64-bit divisions) of a
// thread-per-pair mapping left this kernel at a third of the copy bandwidth.
template <typename T>
__global__ void __launch_bounds__(256)
flash_attn_convert_tiles(const float* __restrict__ src, T* __restrict__ dst, int H, int L, int d, int BM, int nwg,
                         int rowsplit, fa_i64 tiles, fa_i64 d_sb, fa_i64 d_sh, fa_i64 d_sl, float scale, int vec) {
    constexpr int RW = 36;  // a tile row in shared memory: 32 words of packed pairs + 4 (conflict-free both ways)
    __shared__ __align__(16) fa_u32 sm[64 * RW];
    const int tid = threadIdx.x, m_blocks = (L + BM - 1) / BM;
    const bool v16 = vec && (reinterpret_cast<unsigned long long>(dst) & 15ull) == 0;
    for (fa_i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int part = (int)(t % nwg);
        const fa_i64 q = t / nwg;
        const int mb = (int)(q % m_blocks);
        const fa_i64 bh = q / m_blocks;
        const float4* tile = reinterpret_cast<const float4*>(src + t * 4096);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int m = tid + j * 256;  // fragment order: [n8 tile m/128][warp m/32%4][lane/4 = m/4%8][m%4]
            const float4 x = tile[m];
            const int rl = ((m >> 5) & 3) * 16 + ((m >> 2) & 7), cw = (m >> 7) * 4 + (m & 3);  // cw: column pair
            sm[rl * RW + cw] = FaType<T>::pack(x.x * scale, x.y * scale);
            sm[(rl + 8) * RW + cw] = FaType<T>::pack(x.z * scale, x.w * scale);
        }
        __syncthreads();
        const int row0 = mb * BM + (rowsplit ? part * 64 : 0), col0 = rowsplit ? 0 : part * 64;
        const fa_i64 b = bh / H, h = bh % H;
        T* base = dst + b * d_sb + h * d_sh + col0;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int rl = (tid >> 3) + j * 32, c8 = tid & 7, row = row0 + rl;  // 8 threads per 64-column row
            if (row < L && col0 + c8 * 8 < d) {  // d (a multiple of 8): the head dim's columns, not the tile's
                T* p = base + (fa_i64)row * d_sl + c8 * 8;
                const uint4 w = *reinterpret_cast<const uint4*>(&sm[rl * RW + c8 * 4]);
                if (v16) {
                    *reinterpret_cast<uint4*>(p) = w;
                } else {
                    const fa_u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        union { fa_u32 u; T t2[2]; } c;
                        c.u = ws[k];
                        p[2 * k] = c.t2[0];
                        p[2 * k + 1] = c.t2[1];
                    }
                }
            }
        }
        __syncthreads();
    }
}

// Warp layouts (NW warps): S and dP tiles BM x BN as WMS x (NW/WMS) warps; dK and dV tiles BN x D as
// WNKV x (NW/WNKV); the dQ tile BM x D as WMQ x (NW/WMQ). OPT bit 1: software-pipelined fragment reads.
template <typename T, int D, int BM, int BN, int NW, int WMS, int WNKV, int WMQ, int MASK, int OPT>
__global__ void __launch_bounds__(NW * 32, 1)
flash_attn_bwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
               float* __restrict__ dq_acc, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dk_acc,
               float* __restrict__ dv_acc, const void* __restrict__ mask, int H, int Lq, int Lk, int d,
               int n_blocks, int m_per_split, fa_i64 q_sb, fa_i64 q_sh, fa_i64 q_sl, fa_i64 k_sb, fa_i64 k_sh,
               fa_i64 k_sl, fa_i64 v_sb, fa_i64 v_sh, fa_i64 v_sl, fa_i64 g_sb, fa_i64 g_sh, fa_i64 g_sl,
               fa_i64 dk_sb, fa_i64 dk_sh, fa_i64 dk_sl, fa_i64 dv_sb, fa_i64 dv_sh, fa_i64 dv_sl, fa_i64 m_sb,
               fa_i64 m_sh, fa_i64 m_sq, fa_i64 m_sk, float scale_log2, float scale, int causal) {
    constexpr int NTHREADS = NW * 32;
    constexpr int WNS = NW / WMS, RS = BM / WMS, CS = BN / WNS, MTS = RS / 16, NTS = CS / 8;
    constexpr int WDK = NW / WNKV, RK = BN / WNKV, CK = D / WDK, MTK = RK / 16, NTK = CK / 8;
    constexpr int WDQ = NW / WMQ, RQ = BM / WMQ, CQ = D / WDQ, MTQ = RQ / 16, NTQ = CQ / 8;
    constexpr bool PIPE = (OPT & 2) != 0;
    static_assert(RS % 16 == 0 && CS % 16 == 0 && RK % 16 == 0 && CK % 16 == 0 && RQ % 16 == 0 && CQ % 16 == 0,
                  "warp tiles must be multiples of 16 x 16");

    extern __shared__ __align__(128) unsigned char fa_smem[];
    const fa_u32 sK = fa_smem_addr(fa_smem);
    const fa_u32 sV = sK + BN * D * 2;
    const fa_u32 sQ0 = sV + BN * D * 2;        // two buffers
    const fa_u32 sG0 = sQ0 + 2 * BM * D * 2;   // dO, two buffers
    const fa_u32 sP = sG0 + 2 * BM * D * 2;
    const fa_u32 sS = sP + BM * BN * 2;        // dS
    unsigned short* sPg = reinterpret_cast<unsigned short*>(fa_smem + (sP - sK));
    unsigned short* sSg = reinterpret_cast<unsigned short*>(fa_smem + (sS - sK));
    float* sL = reinterpret_cast<float*>(fa_smem + (sS - sK) + BM * BN * 2);  // lse * log2e of the query block
    float* sDd = sL + BM;                                                       // delta of the query block

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const FaBwdWork work = fa_bwd_work(n_blocks, m_per_split, BN, BM, Lq, causal);
    const int h = blockIdx.y, b = blockIdx.z;
    const int n0 = work.n0, m_lo = work.m_lo, m_hi = work.m_hi;
    const bool atomic_kv = dk_acc != nullptr;
    if (atomic_kv && m_lo >= m_hi) return;

    const T* qg = q + b * q_sb + h * q_sh;
    const T* gg = dout + b * g_sb + h * g_sh;
    const fa_i64 bhq = ((fa_i64)b * H + h) * Lq;
    const fa_i64 moff = b * m_sb + h * m_sh;

    // warp coordinates in the three layouts
    const int s_r = (warp % WMS) * RS, s_c = (warp / WMS) * CS;
    const int k_r = (warp % WNKV) * RK, k_c = (warp / WNKV) * CK;
    const int q_r = (warp % WMQ) * RQ, q_c = (warp / WMQ) * CQ;

    fa_load_tile<BN, D, NTHREADS>(sK, k + b * k_sb + h * k_sh + (fa_i64)n0 * k_sl, k_sl, Lk - n0, d, tid);
    fa_load_tile<BN, D, NTHREADS>(sV, v + b * v_sb + h * v_sh + (fa_i64)n0 * v_sl, v_sl, Lk - n0, d, tid);
    if (m_lo < m_hi) {
        const int r0 = m_lo * BM;
        fa_load_tile<BM, D, NTHREADS>(sQ0, qg + (fa_i64)r0 * q_sl, q_sl, Lq - r0, d, tid);
        fa_load_tile<BM, D, NTHREADS>(sG0, gg + (fa_i64)r0 * g_sl, g_sl, Lq - r0, d, tid);
    }
    fa_cp_async_commit();

    float acc_dk[MTK][NTK][4], acc_dv[MTK][NTK][4];
    fa_zero(acc_dk);
    fa_zero(acc_dv);

    // lse * log2e and delta of row tid of the next query block, read one block ahead (the latency hides behind
    // a block of work); padded rows get lse = +inf, so P = 0 there
    static_assert(BM <= NTHREADS, "one thread per query row of a block");
    float next_l = FA_POS_INF, next_d = 0.f;
    if (tid < BM && m_lo < m_hi && m_lo * BM + tid < Lq)
        next_l = lse[bhq + m_lo * BM + tid] * FA_LOG2E, next_d = delta[bhq + m_lo * BM + tid];

    for (int m = m_lo, it = 0; m < m_hi; ++m, ++it) {
        const int r0 = m * BM;
        const fa_u32 sQ = sQ0 + (it & 1) * BM * D * 2, sG = sG0 + (it & 1) * BM * D * 2;
        if (tid < BM) sL[tid] = next_l, sDd[tid] = next_d;
        fa_cp_async_wait_all();
        __syncthreads();  // Q, dO, lse, delta of this block visible
        if (m + 1 < m_hi) {
            const fa_u32 nQ = sQ0 + ((it + 1) & 1) * BM * D * 2, nG = sG0 + ((it + 1) & 1) * BM * D * 2;
            fa_load_tile<BM, D, NTHREADS>(nQ, qg + (fa_i64)(r0 + BM) * q_sl, q_sl, Lq - r0 - BM, d, tid);
            fa_load_tile<BM, D, NTHREADS>(nG, gg + (fa_i64)(r0 + BM) * g_sl, g_sl, Lq - r0 - BM, d, tid);
            fa_cp_async_commit();
            const int row = r0 + BM + tid;
            next_l = FA_POS_INF, next_d = 0.f;
            if (tid < BM && row < Lq) next_l = lse[bhq + row] * FA_LOG2E, next_d = delta[bhq + row];
        }

        // P = exp2(S * scale * log2e - lse * log2e), masked entries 0
        float s[MTS][NTS][4];
        fa_zero(s);
        fa_warp_gemm<T, MTS, NTS, D / 16, false, false, D, D, PIPE>(s, FaFrag<D>(sQ, s_r, 0, lane, false),
                                                               FaFrag<D>(sK, s_c, 0, lane, true));
        const bool need_mask = MASK != FA_MASK_NONE || n0 + BN > Lk || (causal && n0 + s_c + CS - 1 > r0 + s_r);
#pragma unroll
        for (int mt = 0; mt < MTS; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int lr = s_r + mt * 16 + g + hh * 8;
                const float lse2 = sL[lr];
#pragma unroll
                for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& x = s[mt][nt][2 * hh + e];
                        if (need_mask) {
                            float add;
                            const bool keep = fa_keep<MASK>(r0 + lr, n0 + s_c + nt * 8 + t4 * 2 + e, Lq, Lk, causal,
                                                            mask, moff, m_sq, m_sk, add);
                            x = keep ? fa_exp2(fmaf(x, scale_log2, add) - lse2) : 0.f;
                        } else {
                            x = fa_exp2(fmaf(x, scale_log2, -lse2));
                        }
                    }
            }

        // dS = P (dP - delta), dP = dO V^T
        float dpp[MTS][NTS][4];
        fa_zero(dpp);
        fa_warp_gemm<T, MTS, NTS, D / 16, false, false, D, D, PIPE>(dpp, FaFrag<D>(sG, s_r, 0, lane, false),
                                                               FaFrag<D>(sV, s_c, 0, lane, true));
#pragma unroll
        for (int mt = 0; mt < MTS; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int lr = s_r + mt * 16 + g + hh * 8;
                const float dl = sDd[lr];
#pragma unroll
                for (int nt = 0; nt < NTS; ++nt) {
                    const int c = s_c + nt * 8 + t4 * 2;
                    const float p0 = s[mt][nt][2 * hh], p1 = s[mt][nt][2 * hh + 1];
                    const float d0 = p0 * (dpp[mt][nt][2 * hh] - dl), d1 = p1 * (dpp[mt][nt][2 * hh + 1] - dl);
                    *reinterpret_cast<fa_u32*>(sPg + fa_swz<BN>(lr, c)) = FaType<T>::pack(p0, p1);
                    *reinterpret_cast<fa_u32*>(sSg + fa_swz<BN>(lr, c)) = FaType<T>::pack(d0, d1);
                }
            }
        __syncthreads();  // P, dS visible

        // dV += P^T dO ; dK += dS^T Q
        fa_warp_gemm<T, MTK, NTK, BM / 16, true, true, BN, D, PIPE>(acc_dv, FaFrag<BN>(sP, 0, k_r / 8, lane, true),
                                                              FaFrag<D>(sG, 0, k_c / 8, lane, false));
        fa_warp_gemm<T, MTK, NTK, BM / 16, true, true, BN, D, PIPE>(acc_dk, FaFrag<BN>(sS, 0, k_r / 8, lane, true),
                                                              FaFrag<D>(sQ, 0, k_c / 8, lane, false));

        // dQ += dS K (unscaled; the convert kernel applies the softmax scale)
        {
            float acc_dq[MTQ][NTQ][4];
            fa_zero(acc_dq);
            fa_warp_gemm<T, MTQ, NTQ, BN / 16, false, true, BN, D, PIPE>(acc_dq, FaFrag<BN>(sS, q_r, 0, lane, false),
                                                                   FaFrag<D>(sK, 0, q_c / 8, lane, false));
#pragma unroll
            for (int mt = 0; mt < MTQ; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = r0 + q_r + mt * 16 + g + hh * 8;
                    if (row < Lq) {
                        float* dst = dq_acc + (bhq + row) * d;
#pragma unroll
                        for (int nt = 0; nt < NTQ; ++nt) {
                            const int col = q_c + nt * 8 + t4 * 2;
                            if (col < d) fa_red_add2(dst + col, acc_dq[mt][nt][2 * hh], acc_dq[mt][nt][2 * hh + 1]);
                        }
                    }
                }
        }
        __syncthreads();  // done with Q, dO, P, dS, lse, delta of this block
    }

    // dK (scaled), dV: stored, or summed over the CTAs that split the query blocks
    const fa_i64 bhk = ((fa_i64)b * H + h) * Lk;
#pragma unroll
    for (int mt = 0; mt < MTK; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = n0 + k_r + mt * 16 + g + hh * 8;
            if (row >= Lk) continue;
#pragma unroll
            for (int nt = 0; nt < NTK; ++nt) {
                const int col = k_c + nt * 8 + t4 * 2;
                if (col >= d) continue;
                const float k0 = acc_dk[mt][nt][2 * hh] * scale, k1 = acc_dk[mt][nt][2 * hh + 1] * scale;
                const float v0 = acc_dv[mt][nt][2 * hh], v1 = acc_dv[mt][nt][2 * hh + 1];
                if (atomic_kv) {
                    fa_red_add2(dk_acc + (bhk + row) * d + col, k0, k1);
                    fa_red_add2(dv_acc + (bhk + row) * d + col, v0, v1);
                } else {
                    *reinterpret_cast<fa_u32*>(dk + b * dk_sb + h * dk_sh + (fa_i64)row * dk_sl + col) =
                        FaType<T>::pack(k0, k1);
                    *reinterpret_cast<fa_u32*>(dv + b * dv_sb + h * dv_sh + (fa_i64)row * dv_sl + col) =
                        FaType<T>::pack(v0, v1);
                }
            }
        }
}
