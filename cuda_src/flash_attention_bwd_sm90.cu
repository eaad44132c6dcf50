// arch: sm_90a
// dtypes: float16, bfloat16
// FlashAttention backward for Hopper (sm_90a) on warpgroup MMAs: the same interface and result as flash_attn_bwd
// (flash_attention_bwd.cu, whose flash_attn_bwd_delta and flash_attn_convert kernels run around this one).
//
// One CTA per (BN = 64 * NWG keys, head, batch[, slice of the query blocks]), or (u_whole >= 0) the tail schedule of
// flash_attention.cuh's fa_bwd_work_tail: a 1-D grid whose last units are cut into pieces that fill the last wave. Consumer warpgroup w owns keys
// [64w, 64w + 64) of the block and keeps their dK and dV (64 x D, fp32) in registers; K and V stay in shared memory.
// A producer warpgroup (warp 0: Q, warp 1: dO, warp 2: lse and delta) streams blocks of BM queries (64, or 128 at
// D = 64) through STAGES buffers (mbarriers full / empty). Per query block, warpgroup w computes, transposed so that its keys are
// the M dimension:
//   S^T = K_w Q^T, dP^T = V_w dO^T          wgmma, both operands in shared memory (K-major)
//   P^T = exp2(S^T * scale * log2e - lse * log2e) (masked: 0), dS^T = P^T (dP^T - delta)
//   dV_w += P^T dO, dK_w += dS^T Q           wgmma, A = P^T / dS^T from registers, B = dO / Q (N-major)
//   dS^T -> shared memory (both warpgroups' halves), then dQ = dS K per warpgroup: the D/NWG column slice w (BM 64)
//   or the 64 query rows w (BM 128)  (A = dS^T M-major, B = K
//   N-major) added to the fp32 dQ accumulator (the convert kernel scales it), or, when the keys are a single block
//   (dq_acc null), stored scaled into dq directly. DQB = 1 (a warpgroup's dQ tile is 64 x 64): the tile goes to
//   shared memory in the accumulator's fragment order and one thread adds it to its 16 KB chunk of dq_acc with one
//   bulk reduction (cp.reduce.async.bulk .add.f32, as FA3 does), off the consumers' path; dq_acc is then tiled
//   [B*H][query blocks][NWG][64 x 64 in fragment order] (flash_attn_convert_tiles reads it). DQB = 0: vector
//   atomics from registers into a row-major dq_acc.
// Shared tiles: 64-column slabs [D / 64][rows][64], 16-byte chunk c of row r at c ^ (r % 8) (128-byte swizzle).
#include "flash_attention.cuh"
#include "flash_attention_keypad.cuh"
#include "wgmma.cuh"

// The Q / dO tensor maps (wgmma.cuh's TmaMap) the TMA kernel takes by value.
struct FaBwdTmaps {
    TmaMap q, g;
};

#define FA_BWD_SM90_PARAMS const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, \
    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta, \
    float* __restrict__ dq_acc, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dk_acc, \
    float* __restrict__ dv_acc, const void* __restrict__ mask, int H, int Lq, int Lk, int d, \
    int n_blocks, int m_per_split, fa_i64 q_sb, fa_i64 q_sh, fa_i64 q_sl, fa_i64 k_sb, fa_i64 k_sh, \
    fa_i64 k_sl, fa_i64 v_sb, fa_i64 v_sh, fa_i64 v_sl, fa_i64 g_sb, fa_i64 g_sh, fa_i64 g_sl, \
    fa_i64 dk_sb, fa_i64 dk_sh, fa_i64 dk_sl, fa_i64 dv_sb, fa_i64 dv_sh, fa_i64 dv_sl, fa_i64 m_sb, \
    fa_i64 m_sh, fa_i64 m_sq, fa_i64 m_sk, float scale_log2, float scale, int causal, \
    T* __restrict__ dq, fa_i64 dq_sb, fa_i64 dq_sh, fa_i64 dq_sl, int u_whole, fa_i64 acc_row0
#define FA_BWD_SM90_ARGS \
    q, k, v, dout, lse, delta, dq_acc, dk, dv, dk_acc, dv_acc, mask, H, Lq, Lk, d, n_blocks, m_per_split, q_sb, \
    q_sh, q_sl, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, g_sb, g_sh, g_sl, dk_sb, dk_sh, dk_sl, dv_sb, dv_sh, dv_sl, \
    m_sb, m_sh, m_sq, m_sk, scale_log2, scale, causal, dq, dq_sb, dq_sh, dq_sl, u_whole, acc_row0

// TMA = 1: the producer's Q / dO tiles come by the tensor memory accelerator (one thread issues a 64-column box of
// BM rows per slab, zero-filled past the queries and the head dim; `tm` holds the maps of Q and dO as 4-D (d, Lq, H,
// B) tensors); TMA = 0: its warps 0 and 1 copy them with cp.async.
template <typename T, int D, int NWG, int STAGES, int MASK, int BM, int DQB, int TMA>
__device__ __forceinline__ void fa_bwd_sm90_body(FA_BWD_SM90_PARAMS, const FaBwdTmaps* tm) {
    constexpr int BN = 64 * NWG;
    constexpr int SLABS = D / 64;
    constexpr int NTD = D / 8;          // n8 tiles of dK / dV rows
    // dQ (BM x D) per warpgroup: with BM = 64 a slice of D / NWG columns, with BM = 128 its own 64 rows
    constexpr bool ROWSPLIT = BM == 128;
    constexpr int NQ = ROWSPLIT ? D : D / NWG;
    constexpr int NTQ = NQ / 8;
    static_assert(D % 64 == 0 && D <= 128 && NQ % 32 == 0, "tile shape");
    static_assert(BM == 64 || (BM == 128 && NWG == 2 && D == 64), "BM = 128 fits the registers at D = 64 only");
    static_assert(!DQB || NQ == 64, "the bulk dQ path moves 64 x 64 tiles");
    constexpr unsigned DQ_BYTES = DQB ? 64 * 64 * 4 : 0;  // one per consumer warpgroup
    constexpr unsigned KV_BYTES = BN * D * 2, QG_BYTES = BM * D * 2, S_BYTES = BN * BM * 2;

    extern __shared__ unsigned char fa_smem[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full[S], empty[S]
    const unsigned base = (fa_smem_addr(fa_smem) + 1023u) & ~1023u;
    const unsigned sK = base, sV = sK + KV_BYTES, sQ = sV + KV_BYTES, sG = sQ + STAGES * QG_BYTES;
    const unsigned sS = sG + STAGES * QG_BYTES;               // dS^T, two buffers
    const unsigned sLD = sS + 2 * S_BYTES;                    // [STAGES][lse BM | delta BM] floats
    const unsigned sDQ = sLD + STAGES * 2 * BM * 4;            // [NWG][64 x 64] fp32 dQ tiles (DQB)
    const float* sLDg = reinterpret_cast<const float*>(fa_smem + (sLD - fa_smem_addr(fa_smem)));
    const unsigned bar0 = fa_smem_addr(bars);
    auto full = [&](int s) { return bar0 + 8u * s; };
    auto empty = [&](int s) { return bar0 + 8u * (STAGES + s); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const FaBwdWork work = u_whole >= 0 ? fa_bwd_work_tail(n_blocks, m_per_split, BN, BM, Lq, H, u_whole)
                                        : fa_bwd_work(n_blocks, m_per_split, BN, BM, Lq, causal);
    const int h = work.h, b = work.b;
    const int n0 = work.n0, m_lo = work.m_lo, m_hi = work.m_hi;
    const bool atomic_kv = u_whole >= 0 ? work.piece : dk_acc != nullptr;
    if (atomic_kv && m_lo >= m_hi) return;
    const int n_it = max(0, m_hi - m_lo);
    const fa_i64 bhq = ((fa_i64)b * H + h) * Lq;

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), TMA ? 33 : 96);  // TMA: the issuing thread's expect_tx and warp 2's 32 lanes
            mbar_init(empty(s), NWG * 4);
        }
        if (TMA) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    constexpr int REG_P = 40;
    constexpr int REG_C = ((65536 / 128 - REG_P) / NWG) / 8 * 8 > 240 ? 240 : ((65536 / 128 - REG_P) / NWG) / 8 * 8;
    if (warp >= NWG * 4) {  // ------------------------------------------------ producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_P));
        const int pw = warp - NWG * 4;
        if (TMA && pw == 0) {
            if (lane == 0) {
                for (int it = 0; it < n_it; ++it) {
                    const int r0 = (m_lo + it) * BM, s = it % STAGES;
                    if (it >= STAGES) mbar_wait(empty(s), ((it / STAGES) - 1) & 1);
                    mbar_arrive_expect_tx(full(s), 2 * QG_BYTES);
#pragma unroll
                    for (int sl = 0; sl < SLABS; ++sl)
                        tma_load_4d(sQ + s * QG_BYTES + sl * BM * 128, &tm->q, sl * 64, r0, h, b, full(s));
#pragma unroll
                    for (int sl = 0; sl < SLABS; ++sl)
                        tma_load_4d(sG + s * QG_BYTES + sl * BM * 128, &tm->g, sl * 64, r0, h, b, full(s));
                }
            }
        } else if (pw < 3 && !(TMA && pw == 1)) {
            for (int it = 0; it < n_it; ++it) {
                const int r0 = (m_lo + it) * BM, s = it % STAGES;
                if (it >= STAGES) mbar_wait(empty(s), ((it / STAGES) - 1) & 1);
                if (pw == 0) {
                    fa_load_slabs<BM, SLABS>(sQ + s * QG_BYTES, q + b * q_sb + h * q_sh + (fa_i64)r0 * q_sl, q_sl,
                                                 Lq - r0, d, lane);
                } else if (pw == 1) {
                    fa_load_slabs<BM, SLABS>(sG + s * QG_BYTES, dout + b * g_sb + h * g_sh + (fa_i64)r0 * g_sl,
                                                 g_sl, Lq - r0, d, lane);
                } else {
#pragma unroll
                    for (int j = 0; j < BM / 32; ++j) {
                        const int i = lane + 32 * j;
                        const bool ok = r0 + i < Lq;
                        fa_cp_async4(sLD + (s * 2 * BM + i) * 4, ok ? (const void*)(lse + bhq + r0 + i) : (const void*)lse,
                                     ok ? 4 : 0);
                        fa_cp_async4(sLD + (s * 2 * BM + BM + i) * 4,
                                     ok ? (const void*)(delta + bhq + r0 + i) : (const void*)delta, ok ? 4 : 0);
                    }
                }
                mbar_cp_async_arrive(full(s));
            }
            fa_cp_async_wait_all();
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_C));

    // ------------------------------------------------------------------------ consumer warpgroups
    const int wg = warp >> 2, wl = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int krow = wg * 64 + wl * 16;  // first key row (within the block) of this warp
    {
        const int ct = tid;  // consumer thread 0 .. NWG*128-1: K and V tiles, all consumers together
        constexpr int CT = NWG * 128;
        const T* kg = k + b * k_sb + h * k_sh + (fa_i64)n0 * k_sl;
        const T* vg = v + b * v_sb + h * v_sh + (fa_i64)n0 * v_sl;
#pragma unroll
        for (int sl = 0; sl < SLABS; ++sl) {
            fa_load_tile<BN, 64, CT>(sK + sl * BN * 128, kg + sl * 64, k_sl, Lk - n0, d - sl * 64, ct);
            fa_load_tile<BN, 64, CT>(sV + sl * BN * 128, vg + sl * 64, v_sl, Lk - n0, d - sl * 64, ct);
        }
        fa_cp_async_commit();
        fa_cp_async_wait_all();
        fence_proxy_async();
        named_bar_sync(1, NWG * 128);
    }
    const fa_i64 moff = b * m_sb + h * m_sh;
    // FA_MASK_KEYPAD: the mask is the same for every query, so this thread's two keys are read once (key_bits bit
    // e2: key n0 + krow + g + 8 e2 kept); a warp whose keys are all kept applies no mask
    constexpr bool KEYPAD = MASK == FA_MASK_KEYPAD;
    unsigned key_bits = 3u;
    bool warp_masked = MASK != FA_MASK_NONE;
    if constexpr (KEYPAD) {
        key_bits = 0u;
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
            const int key = n0 + krow + g + e2 * 8;
            if (key < Lk && static_cast<const unsigned char*>(mask)[moff + (fa_i64)key * m_sk] != 0)
                key_bits |= 1u << e2;
        }
        warp_masked = !__all_sync(0xffffffffu, key_bits == 3u);
    }

    float acc_dk[NTD][4], acc_dv[NTD][4];
#pragma unroll
    for (int j = 0; j < NTD; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[j][e] = 0.f, acc_dv[j][e] = 0.f;

    for (int it = 0; it < n_it; ++it) {
        const int r0 = (m_lo + it) * BM, s = it % STAGES;
        const unsigned sQs = sQ + s * QG_BYTES, sGs = sG + s * QG_BYTES, sSb = sS + (it & 1) * S_BYTES;
        mbar_wait(full(s), (it / STAGES) & 1);
        // tiles a TMA wrote (the async proxy, as the wgmma that reads them) are visible once the barrier's
        // phase completes; cp.async writes through the generic proxy and needs the proxy fence (a
        // MEMBAR.ALL.CTA that drains this thread's outstanding memory operations)
        if constexpr (!TMA) fence_proxy_async();

        // S^T = K_w Q^T and dP^T = V_w dO^T
        float st[BM / 8][4], dpt[BM / 8][4];  // rows: this warp's 16 keys, columns: the BM queries
        wg_fence();
        wg_pin(st);
        wg_pin(dpt);
        wg_gemm_kmajor<T, BM, D>(st, sK + wg * 64 * 128, BN, sQs, BM);
        wg_commit();
        wg_gemm_kmajor<T, BM, D>(dpt, sV + wg * 64 * 128, BN, sGs, BM);
        wg_commit();
        // this thread's lse pairs (two query columns per n8 tile, one 8-byte load each) are read while the products
        // run, their shared-memory latency off the path from S^T to P^T -- where the registers allow it (BM = 64:
        // 16 more; at BM = 128 the 32 would spill, and the pairs are read where they are used)
        const float* sL = sLDg + s * 2 * BM;
        constexpr bool PRELOAD = BM <= 64;
        float2 lse_r[PRELOAD ? BM / 8 : 1], delta_r[PRELOAD ? BM / 8 : 1];
        auto pair = [&](const float2* r, int off, int j) {
            return PRELOAD ? r[j] : *reinterpret_cast<const float2*>(sL + off + j * 8 + t4 * 2);
        };
        if constexpr (PRELOAD) {
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) lse_r[j] = *reinterpret_cast<const float2*>(sL + j * 8 + t4 * 2);
        }
        wg_wait<1>();
        wg_pin(st);

        // P^T (rows: keys, columns: queries)
        // (warp-uniform) the mask test is outside the unrolled loops: a test per element made the compiler branch
        // and reconverge around each of them (BSSY / BRA / BSYNC, 32 times per query block)
        const bool need_mask = warp_masked || n0 + BN > Lk || r0 + BM > Lq || (causal && n0 + krow + 15 > r0);
        if (need_mask) {
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
                const float2 l2 = pair(lse_r, 0, j);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qc = j * 8 + t4 * 2 + (e & 1);
                    const float lse2 = ((e & 1) ? l2.y : l2.x) * FA_LOG2E;
                    float& x = st[j][e];
                    const int key = n0 + krow + g + (e >> 1) * 8, qrow = r0 + qc;
                    float add;
                    bool keep;
                    if constexpr (KEYPAD)
                        keep = qrow < Lq && ((key_bits >> (e >> 1)) & 1u) &&
                               fa_keep<FA_MASK_NONE>(qrow, key, Lq, Lk, causal, mask, moff, m_sq, m_sk, add);
                    else
                        keep = qrow < Lq && fa_keep<MASK>(qrow, key, Lq, Lk, causal, mask, moff, m_sq, m_sk, add);
                    x = keep ? fa_exp2(fmaf(x, scale_log2, add) - lse2) : 0.f;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
                const float2 l2 = pair(lse_r, 0, j);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    st[j][e] = fa_exp2(fmaf(st[j][e], scale_log2, -((e & 1) ? l2.y : l2.x) * FA_LOG2E));
            }
        }
        if constexpr (PRELOAD) {  // likewise the delta pairs, before waiting for dP^T
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) delta_r[j] = *reinterpret_cast<const float2*>(sL + BM + j * 8 + t4 * 2);
        }
        wg_wait<0>();
        wg_pin(dpt);

        // dS^T = P^T (dP^T - delta); A fragments of P^T and dS^T; dS^T to shared memory for dQ
        fa_u32 pa[BM / 16][4], sa[BM / 16][4];
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
            const float2 d2 = pair(delta_r, BM, j);
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[j][e] = st[j][e] * (dpt[j][e] - ((e & 1) ? d2.y : d2.x));
        }
        fa_sm90_pack<T, BM / 8>(pa, st);
        fa_sm90_pack<T, BM / 8>(sa, dpt);
        {
            // stmatrix x4 per 16 queries: matrix mi = lane / 8 is sa[kk][mi] = (keys + 8 (mi & 1), queries + 8 (mi >> 1));
            // lane gives the address of row lane % 8 of its matrix (one 16-byte swizzled chunk)
            const int mi = lane >> 3, r = krow + (lane & 7) + (mi & 1) * 8;
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                const int c = kk * 16 + (mi >> 1) * 8;  // (key r, first query c of the chunk)
                const unsigned addr = sSb + (c / 64) * S_BYTES / (BM / 64) + 2 * fa_swz<64>(r, c % 64);
                asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                             ::"r"(addr), "r"(sa[kk][0]), "r"(sa[kk][1]), "r"(sa[kk][2]), "r"(sa[kk][3]) : "memory");
            }
        }

        // dV += P^T dO; then dQ; then dK += dS^T Q, whose GEMM runs while the dQ tile leaves (groups: dV, dQ, dK)
        wg_fence();
        wg_pin(acc_dv);
        wg_pin(acc_dk);
        const wg_u64 d_g = wg_desc(sGs, BM * 128), d_q = wg_desc(sQs, BM * 128);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            Wg<T, D>::template rs<1>(acc_dv, pa[kk], wg_desc_at(d_g, kk * 16 * 128), 1);
        wg_commit();

        // dQ[:, NQ slice of this warpgroup] = dS K, once both halves of dS^T are in shared memory
        fence_proxy_async();
        named_bar_sync(1, NWG * 128);
        float acc_dq[NTQ][4];
        wg_pin(acc_dq);
        const int c0 = ROWSPLIT ? 0 : wg * NQ, q0 = ROWSPLIT ? wg * 64 : 0;  // this warpgroup's dQ columns / rows
        const wg_u64 d_s = wg_desc(sSb + (ROWSPLIT ? wg * BN * 128 : 0), 16),
                     d_k = wg_desc(sK + (c0 / 64) * BN * 128 + (c0 % 64) * 2, BN * 128);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wg<T, NQ>::template ss<1, 1>(acc_dq, wg_desc_at(d_s, kk * 16 * 128), wg_desc_at(d_k, kk * 16 * 128),
                                         kk > 0);
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            Wg<T, D>::template rs<1>(acc_dk, sa[kk], wg_desc_at(d_q, kk * 16 * 128), 1);
        wg_commit();
        wg_wait<1>();  // dV and dQ done, dK in flight
        wg_pin(acc_dv);
        wg_pin(acc_dq);

#pragma unroll
        for (int hh = 0; hh < 2 && dq_acc == nullptr; ++hh) {
            const int row = r0 + q0 + wl * 16 + g + hh * 8;
            if (row < Lq) {
                {  // a single key block: this CTA's dQ rows are complete, stored scaled
                    T* dst = dq + b * dq_sb + h * dq_sh + (fa_i64)row * dq_sl;
#pragma unroll
                    for (int j = 0; j < NTQ; ++j) {
                        const int col = c0 + j * 8 + t4 * 2;
                        if (col < d)
                            *reinterpret_cast<fa_u32*>(dst + col) =
                                FaType<T>::pack(acc_dq[j][2 * hh] * scale, acc_dq[j][2 * hh + 1] * scale);
                    }
                }
            }
        }
        if (DQB && dq_acc != nullptr) {
            // the tile to shared memory in fragment order ([j][thread][4]: a warp's 16-byte stores are contiguous),
            // then one bulk reduction into this warpgroup's chunk; the previous one must have read the buffer first
            const int wtid = tid & 127;
            const unsigned sdq = sDQ + wg * DQ_BYTES;
            if (wtid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
            named_bar_sync(2 + wg, 128);
#pragma unroll
            for (int j = 0; j < NTQ; ++j)
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(sdq + (j * 128 + wtid) * 16),
                             "f"(acc_dq[j][0]), "f"(acc_dq[j][1]), "f"(acc_dq[j][2]), "f"(acc_dq[j][3])
                             : "memory");
            fence_proxy_async();
            named_bar_sync(2 + wg, 128);
            if (wtid == 0) {
                const int m_blocks = (Lq + BM - 1) / BM;
                float* dst = dq_acc + ((((fa_i64)b * H + h) * m_blocks + (m_lo + it)) * NWG + wg) * 4096;
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                             ::"l"(dst), "r"(sdq), "r"(DQ_BYTES) : "memory");
                asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            }
        } else if (dq_acc != nullptr) {
            // fp32 atomics, four columns at a time: lanes t4 = 2i, 2i+1 swap halves so that the even lane holds
            // row g, columns 4i..4i+3 and the odd lane row g + 8, the same columns
            const bool odd = t4 & 1;
            const int row = r0 + q0 + wl * 16 + g + (odd ? 8 : 0);
            float* dst = dq_acc + (bhq + row) * d + c0 + (t4 >> 1) * 4;
#pragma unroll
            for (int j = 0; j < NTQ; ++j) {
                const float x0 = __shfl_xor_sync(0xffffffffu, odd ? acc_dq[j][0] : acc_dq[j][2], 1);
                const float x1 = __shfl_xor_sync(0xffffffffu, odd ? acc_dq[j][1] : acc_dq[j][3], 1);
                if (row < Lq && c0 + j * 8 + (t4 >> 1) * 4 < d) {
                    if (odd) fa_red_add4(dst + j * 8, x0, x1, acc_dq[j][2], acc_dq[j][3]);
                    else fa_red_add4(dst + j * 8, acc_dq[j][0], acc_dq[j][1], x0, x1);
                }
            }
        }
        wg_wait<0>();  // dK: the stage's Q and dO are read
        wg_pin(acc_dk);
        if (lane == 0) mbar_arrive(empty(s));
    }

    if (DQB && (tid & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");

    // dK (scaled), dV: stored, or summed over the CTAs that split the query blocks
    const fa_i64 bhk = ((fa_i64)b * H + h) * Lk - acc_row0;  // acc_row0: the first row the accumulators hold
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = n0 + krow + g + hh * 8;
        if (row >= Lk) continue;
#pragma unroll
        for (int j = 0; j < NTD; ++j) {
            const int col = j * 8 + t4 * 2;
            if (col >= d) continue;
            const float k0 = acc_dk[j][2 * hh] * scale, k1 = acc_dk[j][2 * hh + 1] * scale;
            const float v0 = acc_dv[j][2 * hh], v1 = acc_dv[j][2 * hh + 1];
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

template <typename T, int D, int NWG, int STAGES, int MASK, int BM, int DQB>
__global__ void __launch_bounds__(NWG * 128 + 128, 1) flash_attn_bwd_sm90(FA_BWD_SM90_PARAMS) {
    fa_bwd_sm90_body<T, D, NWG, STAGES, MASK, BM, DQB, 0>(FA_BWD_SM90_ARGS, nullptr);
}

template <typename T, int D, int NWG, int STAGES, int MASK, int BM, int DQB>
__global__ void __launch_bounds__(NWG * 128 + 128, 1)
flash_attn_bwd_sm90_tma(FA_BWD_SM90_PARAMS, const __grid_constant__ FaBwdTmaps tm) {
    fa_bwd_sm90_body<T, D, NWG, STAGES, MASK, BM, DQB, 1>(FA_BWD_SM90_ARGS, &tm);
}
