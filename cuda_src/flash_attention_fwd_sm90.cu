// arch: sm_90a
// dtypes: float16, bfloat16
// FlashAttention forward for Hopper (sm_90a): the same algorithm and interface as flash_attn_fwd
// (flash_attention_fwd.cu) on warpgroup MMAs (wgmma.mma_async) with a producer warp.
//
// One CTA per (NWG * 64 query rows, head, batch): NWG consumer warpgroups of 128 threads each own 64 query rows; a
// producer warpgroup (it gives its registers to the consumers with setmaxnreg) streams K and V tiles of BN keys
// through STAGES shared-memory buffers and signals each tile on an mbarrier (full_k / full_v): flash_attn_fwd_sm90_tma
// by TMA (one thread issues the boxes; the tensor maps come by value), flash_attn_fwd_sm90 with cp.async (warp 0: K,
// warp 1: V; for strides TMA cannot describe). The consumers release a stage (empty) when both products that read it
// are done. (H200, Flux 1024²: the cp.async producer bounded the forward -- 0.629 ms, or 0.464 with its copies
// removed.) PP = 0: the warpgroups
// are not in lock-step with each other, so one's softmax overlaps the other's tensor-core work when they drift apart.
// PP = 1 (two consumer warpgroups): FA3's ping-pong, enforced with two named barriers -- a warpgroup issues each of
// its products (S, then P V) only after the other issued its previous one, so the tensor cores alternate between
// them: S(wg0), S(wg1) while wg0 runs its softmax, P V(wg0) while wg1 runs its softmax, P V(wg1), S(wg0) ...
// OV = 1: FA3's intra-warpgroup overlap (fa_fwd_sm90_overlap_loop), with or without the ping-pong.
// Per key tile, a consumer warpgroup:
//   S = Q K^T        wgmma, A = Q and B = K from shared memory (both K-major, 128-byte swizzle), fp32 in registers
//   mask, online softmax in log2 units (scale folded in), P = exp2(S - rowmax) packed to bf16/fp16 registers
//   O += P V         wgmma, A = P from registers, B = V from shared memory (N-major: V rows are keys)
// Shared tiles are stored as 64-column slabs [D / 64][rows][64] with the 16-byte chunk c of row r at c ^ (r % 8),
// which is the layout the 128-byte-swizzle descriptors describe (every slab 1024-byte aligned).
// Output O / rowsum and the row logsumexp (natural log; +inf for a row that attends nothing), as flash_attn_fwd.
#include "flash_attention.cuh"
#include "flash_attention_keypad.cuh"
#include "wgmma.cuh"

// The ping-pong's named barriers FA_FWD_PP_BAR + wg: "wg may issue its next products" (1, 2: the Q loads).
constexpr int FA_FWD_PP_BAR = 3;

// The K / V tensor maps (wgmma.cuh's TmaMap) the TMA kernel takes by value.
struct FaTmaps {
    TmaMap k, v;
};

#define FA_FWD_SM90_PARAMS                                                                                          \
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ o,                   \
        float *__restrict__ lse, const void *__restrict__ mask, int H, int Lq, int Lk, int d, fa_i64 q_sb,          \
        fa_i64 q_sh, fa_i64 q_sl, fa_i64 k_sb, fa_i64 k_sh, fa_i64 k_sl, fa_i64 v_sb, fa_i64 v_sh, fa_i64 v_sl,     \
        fa_i64 o_sb, fa_i64 o_sh, fa_i64 o_sl, fa_i64 m_sb, fa_i64 m_sh, fa_i64 m_sq, fa_i64 m_sk, float scale_log2, \
        int causal
#define FA_FWD_SM90_ARGS                                                                                            \
    q, k, v, o, lse, mask, H, Lq, Lk, d, q_sb, q_sh, q_sl, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, o_sb, o_sh, o_sl, m_sb, \
        m_sh, m_sq, m_sk, scale_log2, causal

// The online softmax of one key tile's scores (fp32 in s_acc, in place): P = exp2(S * sl2 - rowmax), the running
// maxima and sums, and corr, the factor that moves O from the old row maximum to the new one (O is not touched:
// fa_sm90_rescale applies it, when no P V is in flight).
template <int NTS>
__device__ __forceinline__ void fa_sm90_softmax(float (&s_acc)[NTS][4], float (&row_m)[2], float (&row_l)[2],
                                                float (&corr)[2], float sl2) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float mx = FA_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt) mx = fmaxf(mx, fmaxf(s_acc[nt][2 * hh], s_acc[nt][2 * hh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_m[hh], mx);
        const float ms = m_new == FA_NEG_INF ? 0.f : m_new * sl2;
        corr[hh] = fa_exp2(row_m[hh] * sl2 - ms);
        row_m[hh] = m_new;
        float l = row_l[hh] * corr[hh];
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = fa_exp2(fmaf(s_acc[nt][2 * hh + e], sl2, -ms));
                s_acc[nt][2 * hh + e] = p;
                l += p;
            }
        row_l[hh] = l;
    }
}

// The kind of the key tile at n0: FA_MASK_KEYPAD classifies it by its granules' kinds in kpad (kept, masked or
// mixed); under the other mask kinds every tile is mixed (read element by element).
template <int MASK, int BN>
__device__ __forceinline__ int fa_sm90_tile_kind(int n0, int Lk, const unsigned char* kpad) {
    int tile = FA_KEYPAD_MIXED;
    if constexpr (MASK == FA_MASK_KEYPAD) {
        bool any = false, all = true;
        for (int gi = n0 / 64; gi < min((Lk + 63) / 64, (n0 + BN) / 64); ++gi) {
            any |= kpad[gi] != FA_KEYPAD_MASKED;
            all &= kpad[gi] == FA_KEYPAD_KEPT;
        }
        tile = all ? FA_KEYPAD_KEPT : (any ? FA_KEYPAD_MIXED : FA_KEYPAD_MASKED);
    }
    return tile;
}

// Masks the scores of the key tile at n0 (of kind `tile`) in place: key padding past Lk, causal, the user's mask
// (FA_MASK_FLOAT: scaled and added here); a FA_MASK_KEYPAD tile of masked keys goes through the same loop (a separate
// fill costs registers). Uniform per warp: a tile that needs none of it is left as it is.
template <int MASK, int BN, int NTS>
__device__ __forceinline__ void fa_sm90_mask_scores(float (&s_acc)[NTS][4], int n0, int tile, int wrow, int g, int t4,
                                                    int Lq, int Lk, int causal, const void* mask, fa_i64 moff,
                                                    fa_i64 m_sq, fa_i64 m_sk, float scale_log2) {
    constexpr bool PRESCALED = MASK == FA_MASK_FLOAT;
    constexpr bool KEYPAD = MASK == FA_MASK_KEYPAD;
    constexpr int EMASK = KEYPAD ? FA_MASK_BOOL : MASK;  // a mixed tile's element-wise rule
    const bool masked = KEYPAD && tile == FA_KEYPAD_MASKED;
    if (masked || (MASK != FA_MASK_NONE && tile == FA_KEYPAD_MIXED) || n0 + BN > Lk ||
        (causal && n0 + BN - 1 > wrow)) {
        const bool elementwise = MASK != FA_MASK_NONE && tile == FA_KEYPAD_MIXED;
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = wrow + g + (e >> 1) * 8;
                const int col = n0 + nt * 8 + t4 * 2 + (e & 1);
                float add;
                const bool keep = elementwise
                    ? fa_keep<EMASK>(row, col, Lq, Lk, causal, mask, moff, m_sq, m_sk, add)
                    : fa_keep<FA_MASK_NONE>(row, col, Lq, Lk, causal, mask, moff, m_sq, m_sk, add);
                float x = s_acc[nt][e];
                if (PRESCALED) x = fmaf(x, scale_log2, add);
                s_acc[nt][e] = keep && !masked ? x : FA_NEG_INF;
            }
    }
}

// Issues O += P V (P: register fragments, V: the stage's BN x D tile at sv, N-major) as one commit group.
template <typename T, int D, int BN>
__device__ __forceinline__ void fa_sm90_issue_pv(float (&acc_o)[D / 8][4], const fa_u32 (&pa)[BN / 16][4], unsigned sv) {
    wg_fence();
    wg_pin(acc_o);
    const wg_u64 d_v = wg_desc(sv, BN * 128);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        Wg<T, D>::template rs<1>(acc_o, pa[kk], wg_desc_at(d_v, kk * 16 * 128), 1);
    wg_commit();
}

// O *= corr. Once the row maxima settle (most key tiles of a long row) every factor is exactly 1: a warp whose
// factors all are skips the multiplication (x * 1.0f is x, so the result is the same bit for bit).
template <int NTO>
__device__ __forceinline__ void fa_sm90_rescale(float (&acc_o)[NTO][4], const float (&corr)[2]) {
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int dt = 0; dt < NTO; ++dt) {
            acc_o[dt][0] *= corr[0], acc_o[dt][1] *= corr[0];
            acc_o[dt][2] *= corr[1], acc_o[dt][3] *= corr[1];
        }
    }
}

// OV = 1: FA3's intra-warpgroup overlap -- a consumer warpgroup issues S of a key tile and P V of the
// previous one back to back and runs the tile's softmax while P V is on the tensor cores:
//   S_0 = Q K_0^T; mask, softmax(S_0) -> P_0 (fp32, in place) and corr (O's rescale factor); pack P_0
//   for it = 1 ..: issue S_it; O *= corr; issue O += P_{it-1} V_{it-1}; wait for S_it;
//                  mask, softmax(S_it) -> P_it and corr (O and the packed P untouched: P V is in flight);
//                  wait for P V; pack P_it
//   O *= corr; O += P_last V_last
// K and V stages are released apart (empty_k after the S that reads K, empty after the P V that reads V), so the
// producer refills a K stage while its V is still read. A tile that reads a mask element by element (kinds 1, 2;
// FA_MASK_KEYPAD's mixed tiles) waits for P V before its mask: those reads do not fit in the registers left. The
// same arithmetic in the same order as the plain schedule (bit-equal outputs). First built in 1b5d93b on the cp.async
// producer, which bounded the forward then (timed 1.6-5.4% slower, removed in 2eac2ce); here on the TMA producer.
// PP = 1 adds FA3's ping-pong around each turn's issues (the turn's S and the previous tile's P V; the first S and the
// last P V alone): a warpgroup issues them only after the other warpgroup issued its previous turn's, so one
// warpgroup's softmax runs while the other's products hold the tensor cores (barriers PP_BAR + wg, as the plain loop).
template <typename T, int D, int BN, int NWG, int STAGES, int MASK, int TMA, int PP, typename FK, typename FV,
          typename EV, typename EK>
__device__ __forceinline__ void fa_fwd_sm90_overlap_loop(
    float (&acc_o)[D / 8][4], float (&s_acc)[BN / 8][4], float (&row_m)[2], float (&row_l)[2], int n_blocks, int Lq,
    int Lk, int causal, const void* mask, fa_i64 moff, fa_i64 m_sq, fa_i64 m_sk, float scale_log2, float sl2,
    int wrow, int g, int t4, int lane, int wg, unsigned sQ, unsigned sK, unsigned sV, const unsigned char* kpad,
    FK full_k, FV full_v, EV empty, EK empty_k) {
    constexpr int BM = NWG * 64;
    constexpr int NTS = BN / 8, NTO = D / 8;
    constexpr unsigned KV_BYTES = BN * D * 2;
    constexpr int PP_BAR = FA_FWD_PP_BAR;
    auto pp_wait = [&]() { if constexpr (PP) named_bar_sync(PP_BAR + wg, 256); };          // my turn to issue
    auto pp_pass = [&]() { if constexpr (PP) named_bar_arrive(PP_BAR + (wg ^ 1), 256); };  // the other's turn
    auto tile_kind = [&](int n0) { return fa_sm90_tile_kind<MASK, BN>(n0, Lk, kpad); };
    // the mask through an opaque copy of its pointer: plain (coherent) loads, which ptxas keeps below the acquire fence
    // further down (ld.global.nc, which __restrict__ gives, it hoists above fences and wgmma issues)
    const void* mask_c;
    asm("mov.b64 %0, %1;" : "=l"(mask_c) : "l"(mask));
    auto mask_scores = [&](int n0, int tile) {
        fa_sm90_mask_scores<MASK, BN, NTS>(s_acc, n0, tile, wrow, g, t4, Lq, Lk, causal, mask_c, moff, m_sq, m_sk,
                                           scale_log2);
    };
    fa_u32 pa[BN / 16][4];
    auto pack_p = [&]() { fa_sm90_pack<T, NTS>(pa, s_acc); };
    auto issue_s = [&](int s) {  // S = Q K^T on stage s (one commit group)
        wg_fence();
        wg_pin(s_acc);
        wg_gemm_kmajor<T, BN, D>(s_acc, sQ + wg * 64 * 128, BM, sK + s * KV_BYTES, BN);
        wg_commit();
    };
    auto issue_pv = [&](int s) { fa_sm90_issue_pv<T, D, BN>(acc_o, pa, sV + s * KV_BYTES); };
    // the online softmax leaves O alone (a P V may be in flight); O is rescaled before the next P V is issued
    float corr[2];
    auto softmax = [&]() { fa_sm90_softmax<NTS>(s_acc, row_m, row_l, corr, sl2); };
    auto rescale_o = [&]() { fa_sm90_rescale<NTO>(acc_o, corr); };
    // K of key tile it has landed (each turn waits for the next turn's K before its own P V: the spin loop also keeps
    // ptxas from scheduling that P V's wait above the softmax); TMA-written stages need no proxy fence (see the plain
    // loop), cp.async-written ones do
    auto wait_k = [&](int it) { mbar_wait(full_k(it % STAGES), (it / STAGES) & 1); };
    if (n_blocks > 0) {  // key tile 0: S, softmax
        wait_k(0);
        if constexpr (!TMA) fence_proxy_async();
        pp_wait();
        issue_s(0);
        pp_pass();
        wg_wait<0>();
        wg_pin(s_acc);
        if (lane == 0) mbar_arrive(empty_k(0));
        const int n0 = (n_blocks - 1) * BN;
        mask_scores(n0, tile_kind(n0));
        softmax();
        pack_p();
        if (n_blocks > 1) wait_k(1);
    }
    for (int it = 1; it < n_blocks; ++it) {
        const int s = it % STAGES, sp = (it - 1) % STAGES;
        if constexpr (!TMA) fence_proxy_async();  // (K of this tile: waited for at the end of the previous turn)
        pp_wait();
        issue_s(s);
        rescale_o();                  // to the previous tile's row maximum, while S is on the tensor cores
        mbar_wait(full_v(sp), ((it - 1) / STAGES) & 1);
        if constexpr (!TMA) fence_proxy_async();
        issue_pv(sp);                 // O += P_{it-1} V_{it-1}, on the tensor cores during this tile's softmax
        pp_pass();
        const int n0 = (n_blocks - 1 - it) * BN, tile = tile_kind(n0);
        wg_wait<1>();                 // S of this tile is done
        wg_pin(s_acc);
        if (lane == 0) mbar_arrive(empty_k(s));
        if (MASK != FA_MASK_NONE && tile == FA_KEYPAD_MIXED) {
            // a tile that reads the mask element by element waits for P V first: its reads (which ptxas hoists as far
            // as the acquire fence lets it) and 64 mask values do not fit beside O, P and S in flight
            wg_wait<0>();
            asm volatile("fence.acq_rel.cta;\n" ::: "memory");
        }
        mask_scores(n0, tile);
        softmax();
        if (it + 1 < n_blocks) wait_k(it + 1);
        wg_wait<0>();                 // P V is done: O and the P registers are free
        wg_pin(acc_o);
        if (lane == 0) mbar_arrive(empty(sp));
        pack_p();
    }
    if (n_blocks > 0) {  // O += P V of the last tile
        const int sp = (n_blocks - 1) % STAGES;
        rescale_o();
        mbar_wait(full_v(sp), ((n_blocks - 1) / STAGES) & 1);
        if constexpr (!TMA) fence_proxy_async();
        pp_wait();
        issue_pv(sp);
        pp_pass();
        wg_wait<0>();
        wg_pin(acc_o);
        if (lane == 0) mbar_arrive(empty(sp));
    }
}

// TMA = 1: the producer's K / V tiles come by the tensor memory accelerator (one thread issues a 64-column box of BN
// rows per slab, zero-filled past the keys and the head dim; `tm` holds the maps of K and V as 4-D (d, Lk, H, B)
// tensors); TMA = 0: its warps 0 and 1 copy them with cp.async.
template <typename T, int D, int BN, int NWG, int STAGES, int MASK, int PP, int TMA, int OV>
__device__ __forceinline__ void fa_fwd_sm90_body(FA_FWD_SM90_PARAMS, const FaTmaps* tm) {
    constexpr int BM = NWG * 64;
    constexpr int SLABS = D / 64;
    constexpr int NTS = BN / 8;   // n8 tiles of S
    constexpr int NTO = D / 8;    // n8 tiles of O
    constexpr bool PRESCALED = MASK == FA_MASK_FLOAT;
    constexpr bool KEYPAD = MASK == FA_MASK_KEYPAD;
    static_assert(D % 64 == 0 && BN % 64 == 0 && BN <= 256 && D <= 256, "tile shape");
    static_assert(!PP || NWG == 2, "ping-pong takes two consumer warpgroups");
    constexpr int PP_BAR = FA_FWD_PP_BAR;
    constexpr unsigned Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;

    extern __shared__ unsigned char fa_smem[];
    // full_k[S], full_v[S], empty[S] (OV: the V stages' release), OV: empty_k[S]
    __shared__ __align__(8) unsigned long long bars[(OV ? 4 : 3) * STAGES];
    __shared__ unsigned char kpad[KEYPAD ? FA_KEYPAD_GRANULES : 1];  // FA_MASK_KEYPAD: each granule's kind
    const unsigned base = (fa_smem_addr(fa_smem) + 1023u) & ~1023u;
    const unsigned sQ = base, sK = sQ + Q_BYTES, sV = sK + STAGES * KV_BYTES;
    const unsigned bar0 = fa_smem_addr(bars);
    auto full_k = [&](int s) { return bar0 + 8u * s; };
    auto full_v = [&](int s) { return bar0 + 8u * (STAGES + s); };
    auto empty = [&](int s) { return bar0 + 8u * (2 * STAGES + s); };
    auto empty_k = [&](int s) { return bar0 + 8u * (3 * STAGES + s); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m_block = gridDim.x - 1 - blockIdx.x;  // under a causal mask the longest blocks start first
    const int h = blockIdx.y, b = blockIdx.z;
    const int m0 = m_block * BM;
    const T* kg = k + b * k_sb + h * k_sh;
    const T* vg = v + b * v_sb + h * v_sh;

    int n_blocks = (Lk + BN - 1) / BN;
    if (causal) n_blocks = max(0, min(n_blocks, (min(m0 + BM, Lq) - 1) / BN + 1));

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_k(s), TMA ? 1 : 32);
            mbar_init(full_v(s), TMA ? 1 : 32);
            mbar_init(empty(s), NWG * 4);
            if constexpr (OV) mbar_init(empty_k(s), NWG * 4);
        }
        if (TMA) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (KEYPAD) {  // Lk <= 64 * FA_KEYPAD_GRANULES (the caller's rule)
        const unsigned char* mrow = static_cast<const unsigned char*>(mask) + b * m_sb + h * m_sh;
        for (int gi = tid; gi < (Lk + 63) / 64; gi += blockDim.x) {
            const int hi = min(Lk, gi * 64 + 64);
            bool any = false, all = true;
            for (int c = gi * 64; c < hi; ++c) {
                const bool kept = mrow[(fa_i64)c * m_sk] != 0;
                any |= kept;
                all &= kept;
            }
            kpad[gi] = all ? FA_KEYPAD_KEPT : (any ? FA_KEYPAD_MIXED : FA_KEYPAD_MASKED);
        }
    }
    __syncthreads();

    // registers: the producer warpgroup keeps 32, the consumers share the rest (65536 per SM, one CTA)
    constexpr int REG_P = 40, REG_C = ((65536 / 128 - REG_P) / NWG) / 8 * 8 > 240 ? 240 : ((65536 / 128 - REG_P) / NWG) / 8 * 8;
    if (warp >= NWG * 4) {  // ------------------------------------------------ producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_P));
        const int pw = warp - NWG * 4;
        if (TMA) {
            if (pw == 0 && lane == 0) {
                for (int it = 0; it < n_blocks; ++it) {
                    const int n0 = (n_blocks - 1 - it) * BN, s = it % STAGES;
                    // (OV: K and V stages are released apart -- a K stage refills while its V is still read)
                    if (it >= STAGES) mbar_wait(OV ? empty_k(s) : empty(s), ((it / STAGES) - 1) & 1);
                    mbar_arrive_expect_tx(full_k(s), KV_BYTES);
#pragma unroll
                    for (int sl = 0; sl < SLABS; ++sl)
                        tma_load_4d(sK + s * KV_BYTES + sl * BN * 128, &tm->k, sl * 64, n0, h, b, full_k(s));
                    if (OV && it >= STAGES) mbar_wait(empty(s), ((it / STAGES) - 1) & 1);
                    mbar_arrive_expect_tx(full_v(s), KV_BYTES);
#pragma unroll
                    for (int sl = 0; sl < SLABS; ++sl)
                        tma_load_4d(sV + s * KV_BYTES + sl * BN * 128, &tm->v, sl * 64, n0, h, b, full_v(s));
                }
            }
        } else if (pw < 2) {
            const T* src = pw == 0 ? kg : vg;
            const fa_i64 ld = pw == 0 ? k_sl : v_sl;
            const unsigned dst = pw == 0 ? sK : sV;
            for (int it = 0; it < n_blocks; ++it) {
                const int n0 = (n_blocks - 1 - it) * BN, s = it % STAGES;
                if (it >= STAGES) mbar_wait(OV && pw == 0 ? empty_k(s) : empty(s), ((it / STAGES) - 1) & 1);
                fa_load_slabs<BN, SLABS>(dst + s * KV_BYTES, src + (fa_i64)n0 * ld, ld, Lk - n0, d, lane);
                mbar_cp_async_arrive(pw == 0 ? full_k(s) : full_v(s));
            }
            fa_cp_async_wait_all();
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_C));

    // ------------------------------------------------------------------------ consumer warpgroups
    // the warpgroup index through a shuffle: the compiler then knows it is warp-uniform and keeps what derives from
    // it (the wgmma descriptors, shared-memory offsets) in uniform registers -- without it every descriptor went
    // through R2UR moves (the D 128 overlap kernel: 2312 -> 2264 SASS instructions, R2UR 100 -> 68)
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wl = warp & 3, wtid = tid & 127;
    const int g = lane >> 2, t4 = lane & 3;
    const int wrow = m0 + wg * 64 + wl * 16;  // first query row of this warp
    {
        const T* qg = q + b * q_sb + h * q_sh + (fa_i64)(m0 + wg * 64) * q_sl;
#pragma unroll
        for (int sl = 0; sl < SLABS; ++sl)
            fa_load_tile<64, 64, 128>(sQ + sl * BM * 128 + wg * 64 * 128, qg + sl * 64, q_sl, Lq - m0 - wg * 64,
                                      d - sl * 64, wtid);
        fa_cp_async_commit();
        fa_cp_async_wait_all();
        fence_proxy_async();
        named_bar_sync(1 + wg, 128);
    }
    const fa_i64 moff = b * m_sb + h * m_sh;
    const float sl2 = PRESCALED ? 1.f : scale_log2;

    float acc_o[NTO][4];
    float s_acc[NTS][4];
#pragma unroll
    for (int j = 0; j < NTO; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[j][e] = 0.f;
    float row_m[2] = {FA_NEG_INF, FA_NEG_INF}, row_l[2] = {0.f, 0.f};
    if constexpr (PP)
        if (wg == 1) named_bar_arrive(PP_BAR, 256);  // warpgroup 0 issues first
    if constexpr (OV) {
        fa_fwd_sm90_overlap_loop<T, D, BN, NWG, STAGES, MASK, TMA, PP>(
            acc_o, s_acc, row_m, row_l, n_blocks, Lq, Lk, causal, mask, moff, m_sq, m_sk, scale_log2, sl2, wrow, g,
            t4, lane, wg, sQ, sK, sV, kpad, full_k, full_v, empty, empty_k);
    } else {
    for (int it = 0; it < n_blocks; ++it) {
        const int n0 = (n_blocks - 1 - it) * BN, s = it % STAGES;
        const unsigned phase = (it / STAGES) & 1;

        // S = Q K^T
        mbar_wait(full_k(s), phase);
        // tiles a TMA wrote (the async proxy, as the wgmma that reads them) are visible once the barrier's
        // phase completes; cp.async writes through the generic proxy and needs the proxy fence (a
        // MEMBAR.ALL.CTA that drains this thread's outstanding memory operations)
        if constexpr (!TMA) fence_proxy_async();
        if constexpr (PP) named_bar_sync(PP_BAR + wg, 256);
        wg_fence();
        wg_pin(s_acc);
        wg_gemm_kmajor<T, BN, D>(s_acc, sQ + wg * 64 * 128, BM, sK + s * KV_BYTES, BN);
        wg_commit();
        if constexpr (PP) named_bar_arrive(PP_BAR + (wg ^ 1), 256);
        wg_wait<0>();
        wg_pin(s_acc);

        // mask: key padding, causal, user mask (uniform per warp); under FA_MASK_KEYPAD a tile of kept keys reads no
        // mask, a tile of masked keys is -inf
        fa_sm90_mask_scores<MASK, BN, NTS>(s_acc, n0, fa_sm90_tile_kind<MASK, BN>(n0, Lk, kpad), wrow, g, t4, Lq, Lk,
                                           causal, mask, moff, m_sq, m_sk, scale_log2);

        // online softmax, the running output rescaled, P packed
        float corr[2];
        fa_sm90_softmax<NTS>(s_acc, row_m, row_l, corr, sl2);
        fa_sm90_rescale<NTO>(acc_o, corr);
        fa_u32 pa[BN / 16][4];
        fa_sm90_pack<T, NTS>(pa, s_acc);

        // O += P V
        mbar_wait(full_v(s), phase);
        // (TMA: no proxy fence, as above)
        if constexpr (!TMA) fence_proxy_async();
        if constexpr (PP) named_bar_sync(PP_BAR + wg, 256);
        fa_sm90_issue_pv<T, D, BN>(acc_o, pa, sV + s * KV_BYTES);
        if constexpr (PP) named_bar_arrive(PP_BAR + (wg ^ 1), 256);
        wg_wait<0>();
        wg_pin(acc_o);
        if (lane == 0) mbar_arrive(empty(s));
    }

    }
    if constexpr (PP)
        if (wg == 0) named_bar_sync(PP_BAR, 256);  // warpgroup 1's last arrival (every arrival is matched)

    // O /= rowsum; logsumexp
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float l = row_l[hh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = wrow + g + hh * 8;
        if (row < Lq) {
            T* orow = o + b * o_sb + h * o_sh + (fa_i64)row * o_sl;
#pragma unroll
            for (int dt = 0; dt < NTO; ++dt) {
                const int col = dt * 8 + t4 * 2;
                if (col < d)
                    *reinterpret_cast<fa_u32*>(orow + col) =
                        FaType<T>::pack(acc_o[dt][2 * hh] * inv, acc_o[dt][2 * hh + 1] * inv);
            }
            if (t4 == 0)
                lse[((fa_i64)b * H + h) * Lq + row] = l > 0.f ? (row_m[hh] * sl2 + log2f(l)) * FA_LN2 : FA_POS_INF;
        }
    }
}

template <typename T, int D, int BN, int NWG, int STAGES, int MASK, int PP = 0, int OV = 0>
__global__ void __launch_bounds__(NWG * 128 + 128, 1) flash_attn_fwd_sm90(FA_FWD_SM90_PARAMS) {
    fa_fwd_sm90_body<T, D, BN, NWG, STAGES, MASK, PP, 0, OV>(FA_FWD_SM90_ARGS, nullptr);
}

template <typename T, int D, int BN, int NWG, int STAGES, int MASK, int PP = 0, int OV = 0>
__global__ void __launch_bounds__(NWG * 128 + 128, 1)
flash_attn_fwd_sm90_tma(FA_FWD_SM90_PARAMS, const __grid_constant__ FaTmaps tm) {
    fa_fwd_sm90_body<T, D, BN, NWG, STAGES, MASK, PP, 1, OV>(FA_FWD_SM90_ARGS, &tm);
}
