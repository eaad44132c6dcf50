// arch: sm_90a
// dtypes: float16, bfloat16
// FlashAttention forward for Hopper (sm_90a): the same algorithm and interface as flash_attn_fwd
// (flash_attention_fwd.cu) on warpgroup MMAs (wgmma.mma_async) with a producer warp.
//
// One CTA per (NWG * 64 query rows, head, batch): NWG consumer warpgroups of 128 threads each own 64 query rows; a
// producer warpgroup (warp 0: K, warp 1: V; it gives its registers to the consumers with setmaxnreg) streams K and V
// tiles of BN keys through STAGES shared-memory buffers with cp.async and signals each tile on an mbarrier (full_k /
// full_v); the consumers release a stage (empty) when both products that read it are done. The warpgroups are not in lock-step with each other, so one's softmax overlaps the other's tensor-core work.
// Per key tile, a consumer warpgroup:
//   S = Q K^T        wgmma, A = Q and B = K from shared memory (both K-major, 128-byte swizzle), fp32 in registers
//   mask, online softmax in log2 units (scale folded in), P = exp2(S - rowmax) packed to bf16/fp16 registers
//   O += P V         wgmma, A = P from registers, B = V from shared memory (N-major: V rows are keys)
// Shared tiles are stored as 64-column slabs [D / 64][rows][64] with the 16-byte chunk c of row r at c ^ (r % 8),
// which is the layout the 128-byte-swizzle descriptors describe (every slab 1024-byte aligned).
// Output O / rowsum and the row logsumexp (natural log; +inf for a row that attends nothing), as flash_attn_fwd.
// PIPE = 1 overlaps a warpgroup's softmax with its own tensor-core work (FA3's intra-warpgroup pipelining): the
// product S_{j+1} = Q K_{j+1}^T and O += P_j V_j are issued together, the softmax of S_{j+1} runs while O += P_j V_j
// is still on the tensor cores, and O is rescaled once that product is done. A stage's K is released as soon as its
// S is computed and its V after its P V (empty_k / empty_v), so the producer refills K a whole iteration early.
#include "flash_attention.cuh"
#include "wgmma.cuh"

template <typename T, int D, int BN, int NWG, int STAGES, int MASK, int PIPE>
__global__ void __launch_bounds__(NWG * 128 + 128, 1)
flash_attn_fwd_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                    float* __restrict__ lse, const void* __restrict__ mask, int H, int Lq, int Lk, int d,
                    fa_i64 q_sb, fa_i64 q_sh, fa_i64 q_sl, fa_i64 k_sb, fa_i64 k_sh, fa_i64 k_sl,
                    fa_i64 v_sb, fa_i64 v_sh, fa_i64 v_sl, fa_i64 o_sb, fa_i64 o_sh, fa_i64 o_sl,
                    fa_i64 m_sb, fa_i64 m_sh, fa_i64 m_sq, fa_i64 m_sk, float scale_log2, int causal) {
    constexpr int BM = NWG * 64;
    constexpr int SLABS = D / 64;
    constexpr int NTS = BN / 8;   // n8 tiles of S
    constexpr int NTO = D / 8;    // n8 tiles of O
    constexpr bool PRESCALED = MASK == FA_MASK_FLOAT;
    static_assert(D % 64 == 0 && BN % 64 == 0 && BN <= 256 && D <= 256, "tile shape");
    constexpr unsigned Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;

    extern __shared__ unsigned char fa_smem[];
    __shared__ __align__(8) unsigned long long bars[4 * STAGES];  // full_k[S], full_v[S], empty_k[S], empty_v[S]
    const unsigned base = (fa_smem_addr(fa_smem) + 1023u) & ~1023u;
    const unsigned sQ = base, sK = sQ + Q_BYTES, sV = sK + STAGES * KV_BYTES;
    const unsigned bar0 = fa_smem_addr(bars);
    auto full_k = [&](int s) { return bar0 + 8u * s; };
    auto full_v = [&](int s) { return bar0 + 8u * (STAGES + s); };
    auto empty_k = [&](int s) { return bar0 + 8u * (2 * STAGES + s); };
    auto empty_v = [&](int s) { return bar0 + 8u * (3 * STAGES + s); };

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
            mbar_init(full_k(s), 32);
            mbar_init(full_v(s), 32);
            mbar_init(empty_k(s), NWG * 4);
            mbar_init(empty_v(s), NWG * 4);
        }
    }
    __syncthreads();

    // registers: the producer warpgroup keeps 32, the consumers share the rest (65536 per SM, one CTA)
    constexpr int REG_P = 40, REG_C = ((65536 / 128 - REG_P) / NWG) / 8 * 8 > 240 ? 240 : ((65536 / 128 - REG_P) / NWG) / 8 * 8;
    if (warp >= NWG * 4) {  // ------------------------------------------------ producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_P));
        const int pw = warp - NWG * 4;
        if (pw < 2) {
            const T* src = pw == 0 ? kg : vg;
            const fa_i64 ld = pw == 0 ? k_sl : v_sl;
            const unsigned dst = pw == 0 ? sK : sV;
            for (int it = 0; it < n_blocks; ++it) {
                const int n0 = (n_blocks - 1 - it) * BN, s = it % STAGES;
                if (it >= STAGES) mbar_wait(pw == 0 ? empty_k(s) : empty_v(s), ((it / STAGES) - 1) & 1);
                fa_load_slabs<BN, SLABS>(dst + s * KV_BYTES, src + (fa_i64)n0 * ld, ld, Lk - n0, d, lane);
                mbar_cp_async_arrive(pw == 0 ? full_k(s) : full_v(s));
            }
            fa_cp_async_wait_all();
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_C));

    // ------------------------------------------------------------------------ consumer warpgroups
    const int wg = warp >> 2, wl = warp & 3, wtid = tid & 127;
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

    constexpr int KT = BN / 16;  // k16 steps of P V
    // Waits for key tile `it`'s K (V) in shared memory.
    auto wait_k = [&](int it) { mbar_wait(full_k(it % STAGES), (it / STAGES) & 1); };
    auto wait_v = [&](int it) { mbar_wait(full_v(it % STAGES), (it / STAGES) & 1); };
    // S = Q K^T / O += P V for key tile `it`, issued (one commit group each). Before the first issue the callers
    // wait for the tiles, fence, then pin the accumulators: a loop, or an asm that "defines" a wgmma's registers,
    // between the fence and the products (or while one is in flight) makes ptxas serialize the wgmmas.
    auto issue_qk = [&](int it) {
        wg_gemm_kmajor<T, BN, D>(s_acc, sQ + wg * 64 * 128, BM, sK + (it % STAGES) * KV_BYTES, BN);
        wg_commit();
    };
    auto issue_pv = [&](int it, fa_u32 (&pa)[KT][4]) {
        const int s = it % STAGES;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
            Wg<T, D>::template rs<1>(acc_o, pa[kk], wg_desc(sV + s * KV_BYTES + kk * 16 * 128, BN * 128), 1);
        wg_commit();
    };
    // the finished S of key tile `it`: mask, online softmax (running max and sum), P packed into `pa`; `corr` is
    // the factor the running O must be rescaled by. S is only read (masked values are recomputed where needed):
    // writing the accumulator registers while the P V product is in flight would serialize the wgmmas.
    auto softmax = [&](int it, fa_u32 (&pa)[KT][4], float (&corr)[2]) {
        const int n0 = (n_blocks - 1 - it) * BN;
        const bool need_mask = MASK != FA_MASK_NONE || n0 + BN > Lk || (causal && n0 + BN - 1 > wrow);
        auto sv = [&](int nt, int e) {
            float x = s_acc[nt][e];
            if (need_mask) {
                const int row = wrow + g + (e >> 1) * 8;
                const int col = n0 + nt * 8 + t4 * 2 + (e & 1);
                float add;
                const bool keep = fa_keep<MASK>(row, col, Lq, Lk, causal, mask, moff, m_sq, m_sk, add);
                if (PRESCALED) x = fmaf(x, scale_log2, add);
                x = keep ? x : FA_NEG_INF;
            }
            return x;
        };
        float ms[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float mx = FA_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NTS; ++nt) mx = fmaxf(mx, fmaxf(sv(nt, 2 * hh), sv(nt, 2 * hh + 1)));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(row_m[hh], mx);
            ms[hh] = m_new == FA_NEG_INF ? 0.f : m_new * sl2;
            corr[hh] = fa_exp2(row_m[hh] * sl2 - ms[hh]);
            row_m[hh] = m_new;
            row_l[hh] *= corr[hh];
        }
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            float p[2][4];
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    p[h2][e] = fa_exp2(fmaf(sv(2 * kk + h2, e), sl2, -ms[e >> 1]));
                    row_l[e >> 1] += p[h2][e];
                }
            pa[kk][0] = FaType<T>::pack(p[0][0], p[0][1]);
            pa[kk][1] = FaType<T>::pack(p[0][2], p[0][3]);
            pa[kk][2] = FaType<T>::pack(p[1][0], p[1][1]);
            pa[kk][3] = FaType<T>::pack(p[1][2], p[1][3]);
        }
    };
    auto rescale = [&](const float (&corr)[2]) {
#pragma unroll
        for (int dt = 0; dt < NTO; ++dt) {
            acc_o[dt][0] *= corr[0], acc_o[dt][1] *= corr[0];
            acc_o[dt][2] *= corr[1], acc_o[dt][3] *= corr[1];
        }
    };
    auto release = [&](unsigned bar) {
        if (lane == 0) mbar_arrive(bar);
    };

    fa_u32 pa[KT][4];
    float corr[2];
    if (!PIPE) {
        for (int it = 0; it < n_blocks; ++it) {
            wait_k(it);
            fence_proxy_async();
            wg_fence();
            wg_pin(s_acc);
            issue_qk(it);
            wg_wait<0>();
            wg_pin(s_acc);
            release(empty_k(it % STAGES));
            softmax(it, pa, corr);
            rescale(corr);
            wait_v(it);
            fence_proxy_async();
            wg_fence();
            wg_pin(acc_o);
            issue_pv(it, pa);
            wg_wait<0>();
            wg_pin(acc_o);
            wg_pin(pa);
            release(empty_v(it % STAGES));
        }
    } else if (n_blocks > 0) {
        wait_k(0);
        fence_proxy_async();
        wg_fence();
        wg_pin(s_acc);
        issue_qk(0);
        wg_wait<0>();
        wg_pin(s_acc);
        release(empty_k(0));
        softmax(0, pa, corr);  // O is still zero: nothing to rescale
        // one step: S of tile it and P V of tile it - 1 (P in `cur`) in flight together, the softmax of tile it
        // into `nxt` while P V runs. Unrolled by two so that P's registers alternate without a copy (a copy into
        // registers a later wgmma reads makes ptxas serialize the wgmmas).
        fa_u32 pn[KT][4];
        auto step = [&](int it, fa_u32 (&cur)[KT][4], fa_u32 (&nxt)[KT][4]) {
            wait_k(it);
            wait_v(it - 1);
            fence_proxy_async();
            wg_fence();
            wg_pin(s_acc);
            wg_pin(acc_o);
            issue_qk(it);
            issue_pv(it - 1, cur);
            wg_wait<1>();  // S of tile it is done; P V of tile it - 1 may still run
            wg_use(s_acc);
            release(empty_k(it % STAGES));
            softmax(it, nxt, corr);
            wg_wait<0>();
            wg_pin(acc_o);
            wg_pin(cur);
            release(empty_v((it - 1) % STAGES));
            rescale(corr);
        };
        auto last = [&](int it, fa_u32 (&cur)[KT][4]) {
            wait_v(it);
            fence_proxy_async();
            wg_fence();
            wg_pin(acc_o);
            issue_pv(it, cur);
            wg_wait<0>();
            wg_pin(acc_o);
            wg_pin(cur);
            release(empty_v(it % STAGES));
        };
        int it = 1;
        for (; it + 1 < n_blocks; it += 2) {
            step(it, pa, pn);
            step(it + 1, pn, pa);
        }
        if (it < n_blocks) {
            step(it, pa, pn);
            last(n_blocks - 1, pn);
        } else {
            last(n_blocks - 1, pa);
        }
    }

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
