// arch: sm_90a
// dtypes: float16, bfloat16
// Implicit-GEMM conv2d forward for Hopper (sm_90a) on warpgroup MMAs: the same inputs and output as conv_fwd_igemm
// (cuda_src/conv_igemm.cu) without its split reduction - x copied to NHWC with channels padded to Cp (a multiple of
// 8), weights packed to Wp (O, K), K = KH*KW*Cp, k = (kh*KW + kw)*Cp + c - so flame_core/kernels/conv.py feeds both.
//
//   D(O, P) = Wp(O, K) @ X(P, K)^T,   X[p, k] = x_nhwc[n, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw, c]  (0 outside)
//
// One CTA per (128 output channels, BN pixels); blockIdx.x = pixel_tile * o_tiles + o_tile (the o-tiles of a pixel
// tile run together and share its input reads in L2). Warpgroups:
//   0, 1  consumers: each owns 64 output channels x BN pixels in fp32 registers; per 64-deep k-tile it issues
//         4 x (BN / 128) wgmma m64n128k16 with A (weights) and B (pixels) both K-major in shared memory
//   2, 3  the PW producers (1 or 2; setmaxnreg gives their registers to the consumers): gather the k-tiles into
//         STAGES shared-memory stages with cp.async - every 16-byte chunk is 8 channels of one input pixel at one
//         tap, zero-filled (src-size 0) outside the image, past the last pixel / channel row, or past K - and signal
//         each stage on an mbarrier (full, cp.async.mbarrier.arrive.noinc by their 128 PW threads); the consumers
//         free a stage (empty, one arrival per consumer warp) once the wgmma's that read it have completed. Two
//         producer warpgroups halve each thread's rows: the gather's issue rate had bounded the ring with one.
// A stage holds the weight tile [128][64] then the pixel tile [BN][64]: rows of 128 bytes with the 16-byte chunk c of
// row r at chunk c ^ (r % 8), every tile 1024-byte aligned - the layout of wgmma.cuh's 128-byte-swizzle descriptors.
// The pixel rows are described once per CTA in the producer's registers - each row's byte offset in x at tap (0, 0)
// and a bit mask of the taps that fall inside the image (KH*KW <= 32) - so that a gathered chunk costs the producer a
// bit test and one address add (the image coordinates and 64-bit products per chunk had made the
// producer, not the tensor cores, the limit), within the few registers setmaxnreg leaves it.
// With TMA (the TMA instantiations, Cp a multiple of 64) one producer thread replaces the gather: per stage a tiled
// tensor-map load of the weight tile and an im2col tensor-map load of the pixel tile (the map walks the output
// pixels' tap-(0, 0) positions with the conv's stride; the k-tile's tap is the load's filter offset; the padding is
// the TMA's zero fill), both landing in the same swizzled layout and completing the stage's barrier by byte count.
// Tiles: CTA x of a launch is tile tile0 + x, channel-tile fastest. A "tail split" (conv.py) runs the tiles of the
// last partial wave as a second launch split over K, so that they fill the SMs: its ws holds pixels pw0 on.
// Epilogue: y (N, O, OH*OW) = D + bias, straight from the accumulators (as conv_fwd_igemm's); or, split over K
// (blockIdx.y = the slice of kt_split k-tiles: more CTAs where the output alone leaves SMs idle), fp32 partials
// ws[slice] (O, P) that conv_igemm.cu's conv_splitk_reduce sums (+ bias) into y.
#include "flash_attention.cuh"
#include "wgmma.cuh"

// Both kernels' shared memory: the stages in the dynamic part from `base` (aligned to 1024 bytes: the swizzled tiles'
// alignment), the stage ring's barriers (static) from bar0 (cw_ring_init below).
extern __shared__ unsigned char cw_smem[];
template <int STAGES>
struct CwRing {
    unsigned base, bar0;
    __device__ __forceinline__ unsigned full(int s) const { return bar0 + 8u * s; }
    __device__ __forceinline__ unsigned empty(int s) const { return bar0 + 8u * (STAGES + s); }
};
template <int STAGES>
__device__ __forceinline__ CwRing<STAGES> cw_ring() {
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full[S], empty[S]
    return {(fa_smem_addr(cw_smem) + 1023u) & ~1023u, fa_smem_addr(bars)};
}

// Registers per thread of PW producer warpgroups and the two consumer warpgroups after setmaxnreg: 72 / 216 within
// the 168 of __launch_bounds__(384, 1), 56 / 200 within the 128 of (512, 1) (conv.py checks the compiled count). The
// sum must fit the launch allocation exactly, or the consumers' setmaxnreg.inc waits forever.
template <int PW>
struct CwRegs {
    static constexpr int PRODUCER = PW == 1 ? 72 : 56, CONSUMER = PW == 1 ? 216 : 200, LAUNCH = PW == 1 ? 168 : 128;
    static_assert(128 * PW * PRODUCER + 256 * CONSUMER <= LAUNCH * (256 + 128 * PW), "register budget");
};

struct CwTmap4 {  // the im2col maps of the phased dx's phases (in its `phases` order), or one map in m[0]
    TmaMap m[4];
};
// The tensor-memory-accelerator loads of the TMA producer: a box of a 2-D tiled map at (c0 innermost, c1), and the
// im2col box of a 4-D (c, w, h, n) map at filter offsets (ow, oh); each signals `bar` with its bytes (complete_tx).
__device__ __forceinline__ void cw_tma_2d(unsigned dst, const TmaMap* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];\n" ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void cw_tma_im2col(unsigned dst, const TmaMap* map, int c, int w, int h, int n,
                                              unsigned short ow, unsigned short oh, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4, %5}], [%6], {%7, %8};\n"
                 ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c), "r"(w), "r"(h), "r"(n),
                 "r"(bar), "h"(ow), "h"(oh) : "memory");
}

// The stage ring's barriers at bar0: full[s] (s < STAGES) completes once the PRODUCERS threads' copies into
// stage s have landed, empty[s] (bar0 + 8 * (STAGES + s)) once the 8 consumer warps are done reading it.
// With TMA loads (PRODUCERS 1: the one thread's expect_tx) the initialisation is fenced for the async proxy.
template <int STAGES, int PRODUCERS = 128>
__device__ __forceinline__ void cw_ring_init(unsigned bar0, int tid) {
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar0 + 8u * s, PRODUCERS);
            mbar_init(bar0 + 8u * (STAGES + s), 8);
        }
        if (PRODUCERS == 1) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}

// The consumer warpgroups' main loop of both kernels: acc (this warpgroup's 64 rows x NB*128 columns, fp32) = the sum
// over nkt k-tiles of the ring's stages (full barriers at bar0, empty ones STAGES on; stage s at base + s*stage_bytes)
// of A (64 rows at a_off in the stage) times B (NB*128 columns at b_off, 128x128-element blocks 16384 bytes apart),
// 64 deep per stage: four k16 steps KK_STEP bytes apart, both operands K-major (TRANS 0) or MN-major (TRANS 1) with
// leading byte offset LBO. A stage is freed (one arrival per warp) once the wgmma's that read it have completed.
template <typename T, int NB, int STAGES, int TRANS, unsigned KK_STEP, unsigned LBO>
__device__ __forceinline__ void cw_consume(float (&acc)[NB][16][4], int nkt, unsigned base, unsigned stage_bytes,
                                           unsigned a_off, unsigned b_off, unsigned bar0, int lane) {
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[b][j][e] = 0.f;
    for (int kt = 0; kt < nkt; ++kt) {
        const int s = kt % STAGES;
        mbar_wait(bar0 + 8u * s, (kt / STAGES) & 1);
        fence_proxy_async();
        const unsigned sa = base + s * stage_bytes + a_off, sb = base + s * stage_bytes + b_off;
        wg_fence();
#pragma unroll
        for (int b = 0; b < NB; ++b) wg_pin(acc[b]);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int b = 0; b < NB; ++b)
                Wg<T, 128>::template ss<TRANS, TRANS>(acc[b], wg_desc(sa + kk * KK_STEP, LBO),
                                                      wg_desc(sb + b * 16384 + kk * KK_STEP, LBO), 1);
        wg_commit();
        // the previous k-tile's products are done once at most this one is pending: free its stage
        wg_wait<1>();
#pragma unroll
        for (int b = 0; b < NB; ++b) wg_pin(acc[b]);
        if (kt > 0 && lane == 0) mbar_arrive(bar0 + 8u * (STAGES + (kt - 1) % STAGES));
    }
    wg_wait<0>();
#pragma unroll
    for (int b = 0; b < NB; ++b) wg_pin(acc[b]);
}

// EPI: the epilogue of the instantiation - 0 plain (+ bias), 1 with the per-image bias emb and the residual res
// (EPI_ADDS), 2 the phases of a strided conv's input gradient in one launch (EPI_PHASED, below).
constexpr int EPI_PLAIN = 0, EPI_ADDS = 1, EPI_PHASED = 2;

// EPI_PHASED: y = dx (nimg, O, OH, OW) of a conv of stride (sh, sw) <= 2, padding (ph, pw), taps KH x KW (dilation 1)
// from x = its output gradient dY channel-last (nimg, H, W, Cp) and w = the flipped packed weights of dx
// (O, KH*KW*Cp) (kernels/conv.py pack_weight_dx: column ((KH-1-kh)*KW + KW-1-kw)*Cp + c holds tap (kh, kw)).
// Phase (a, b) of dx - rows a::sh, columns b::sw - is a stride-1 conv of dY by the taps kh = a + ph (mod sh), largest
// first (ops/conv/phases.py dx_phases); every CTA computes one tile of one phase. `phases` lists them: its low 4 bits the
// count, then 4 bits a*4 + b each, the most taps first. CTA u (past its channel tile) is phase q, pixel tile t of
// groups of ptg pixel tiles: group by group, the group's tiles of each phase in that order - the long ones first,
// and each group's pieces of dx's sectors (a phase writes every sw-th element of a row) written close in time.
template <int EPI>
__device__ __forceinline__ bool cw_phase(int& ti, int o_tiles, int BN, int phases, int ptg, int nimg, int& pq,
                                         int& pa, int& pb, int& KH, int& KW, int& sh, int& sw, int& ph, int& pw, int& dh,
                                         int& dw, int& OH, int& OW, int& P, int& K, int& wt0, int& wt_h, int& wt_w,
                                         int Cp) {
    if constexpr (EPI != EPI_PHASED) {
        wt0 = 0, wt_h = KW * Cp, wt_w = Cp;
        return true;
    } else {
        const int nph = phases & 15;
        const int tpmax = (nimg * ((OH + sh - 1) / sh) * ((OW + sw - 1) / sw) + BN - 1) / BN;  // phase (0, 0)'s
        const int u = ti / o_tiles, grp = u / (nph * ptg), rem = u - grp * nph * ptg;
        const int tg = min(ptg, tpmax - grp * ptg);  // the last group may be short
        const int q = rem / tg, t = grp * ptg + (rem - q * tg);
        const int code = (phases >> (4 + 4 * q)) & 15;
        pq = q;
        pa = code >> 2, pb = code & 3;
        int t0h = -1, nh = 0, t0w = -1, nw = 0;
        for (int k = KH - 1; k >= 0; --k)
            if (((pa + ph - k) % sh + sh) % sh == 0) t0h = t0h < 0 ? k : t0h, ++nh;
        for (int k = KW - 1; k >= 0; --k)
            if (((pb + pw - k) % sw + sw) % sw == 0) t0w = t0w < 0 ? k : t0w, ++nw;
        // phase tap (i, j) is tap (t0h - i*sh, t0w - j*sw): flipped column ((KH-1-t0h + i*sh)*KW + KW-1-t0w + j*sw)*Cp
        wt0 = ((KH - 1 - t0h) * KW + KW - 1 - t0w) * Cp, wt_h = sh * KW * Cp, wt_w = sw * Cp;
        const int rows = (OH - pa + sh - 1) / sh, cols = (OW - pb + sw - 1) / sw;
        ph = -((pa + ph - t0h) / sh), pw = -((pb + pw - t0w) / sw);  // exact divisions
        KH = nh, KW = nw, sh = sw = dh = dw = 1, OH = rows, OW = cols;
        P = nimg * rows * cols, K = nh * nw * Cp;
        if (t * BN >= P) return false;
        ti = t * o_tiles + ti % o_tiles;
        return true;
    }
}

// TMA (PW 1): the producer warpgroup's first thread loads each stage with two tensor-memory-accelerator copies -
// the weight tile by tm_w (tiled, w (O, K): the columns of the k-tile's tap) and the pixel tile by tm_x.m[0] (im2col
// of x (N, H, W, Cp); EPI_PHASED: m[q], the CTA's phase's own) - instead of the cp.async gather: Cp a multiple of
// 64, so that a k-tile is 64 channels of one tap (conv.py checks).
template <typename T, int BN, int STAGES, int EPI, int PW, bool TMA = false>
__global__ void __launch_bounds__(256 + 128 * PW, 1)
conv_fwd_wgmma(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ y,
               float* __restrict__ ws, int H, int W, int Cp, int O, int KH, int KW, int sh, int sw, int ph, int pw,
               int dh, int dw, int OH, int OW, int P, int K, int kt_split, int tile0, int pw0,
               const T* __restrict__ emb, const T* __restrict__ res, int phases, int ptg, int nimg,
               const __grid_constant__ TmaMap tm_w, const __grid_constant__ CwTmap4 tm_x) {
    static_assert(!TMA || PW == 1, "TMA: one producer warpgroup");
    constexpr bool ADDS = EPI == EPI_ADDS, PHASED = EPI == EPI_PHASED;
    constexpr int BM = 128, BK = 64;
    constexpr int NB = BN / 128;  // wgmma m64n128 per k16 step and consumer warpgroup
    constexpr unsigned A_BYTES = BM * BK * 2, STAGE_BYTES = (BM + BN) * BK * 2;
    static_assert(BN % 128 == 0 && BN <= 256 && STAGES >= 2, "tile shape");

    const CwRing<STAGES> ring = cw_ring<STAGES>();
    const unsigned base = ring.base, bar0 = ring.bar0;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int o_tiles = (O + BM - 1) / BM;
    int ti = tile0 + (int)blockIdx.x;  // a tail launch starts past the tiles a first launch wrote
    // the weight row stride and the column of tap (kh, kw), channel c: wt0 + kh*wt_h + kw*wt_w + c (phased: of dx's
    // full flipped weights); a phased CTA's phase (pa, pb) of y's YH x YW pixels, its geometry a stride-1 conv
    const int wld = K, YH = OH, YW = OW, ysh = sh, ysw = sw;
    int pq = 0, pa = 0, pb = 0, wt0, wt_h, wt_w;
    if (!cw_phase<EPI>(ti, o_tiles, BN, phases, ptg, nimg, pq, pa, pb, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW, P, K,
                       wt0, wt_h, wt_w, Cp))
        return;  // a pixel tile past this phase's pixels (phases of fewer rows / columns): the whole CTA
    const int o0 = (ti % o_tiles) * BM;
    const int p0 = (ti / o_tiles) * BN;
    const int OHW = OH * OW;
    const int kt0 = blockIdx.y * kt_split;                         // this CTA's k-tiles: kt0 .. kt0 + nkt - 1
    const int nkt = min((K + BK - 1) / BK - kt0, kt_split);

    cw_ring_init<STAGES, TMA ? 1 : 128 * PW>(bar0, tid);

    // registers (CwRegs): the producer keeps REG_P (its rows' offsets and tap masks live in registers), the two
    // consumer warpgroups take what it gives up
    constexpr int REG_P = CwRegs<PW>::PRODUCER, REG_C = CwRegs<PW>::CONSUMER;
    constexpr int RS = 16 * PW;  // a producer thread's rows are r0 + RS i
    if (warp >= 8) {  // ------------------------------------------------------- producer warpgroup(s)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_P));
        if constexpr (TMA) {
            if (tid != 256) return;
            // the tile's first pixel: its tap-(0, 0) input position is where the im2col walk starts
            const int n = p0 / OHW, q = p0 - n * OHW, oh = q / OW, ow = q - oh * OW;
            const int bw = ow * sw - pw, bh = oh * sh - ph;
            const int tap0 = kt0 * BK / Cp;
            int kc = kt0 * BK - tap0 * Cp, kh = tap0 / KW, kw = tap0 - kh * KW;
            const TmaMap* xmap = &tm_x.m[pq];
            for (int kt = 0; kt < nkt; ++kt) {
                const int s = kt % STAGES;
                if (kt >= STAGES) mbar_wait(ring.empty(s), ((kt / STAGES) - 1) & 1);
                const unsigned sa = base + s * STAGE_BYTES;
                mbar_arrive_expect_tx(ring.full(s), STAGE_BYTES);
                cw_tma_2d(sa, &tm_w, wt0 + kh * wt_h + kw * wt_w + kc, o0, ring.full(s));
                cw_tma_im2col(sa + A_BYTES, xmap, kc, bw, bh, n, (unsigned short)(kw * dw),
                              (unsigned short)(kh * dh), ring.full(s));
                if ((kc += BK) == Cp) {
                    kc = 0;
                    if (++kw == KW) kw = 0, ++kh;
                }
            }
            return;
        }
        const int ptid = tid - 256;
        const int cl = (ptid & 7) * 8, r0 = ptid >> 3;  // this thread's chunk column; rows r0 + RS i
        const unsigned sw_off = 2 * fa_swz<64>(r0, cl);  // rows r0 + RS i share r0's swizzle (RS % 8 == 0)
        constexpr int NR = BN / RS;                      // pixel rows per thread
        // each pixel row's byte offset in x at tap (0, 0) (may lie outside x: only read where the tap is inside)
        // and the bits kh*KW + kw of its in-image taps (0 past the last pixel: every chunk zero-filled)
        int roff[NR];
        unsigned rmask[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            const int p = p0 + r0 + RS * i;
            roff[i] = 0, rmask[i] = 0;
            if (p < P) {
                const int n = p / OHW, q = p - n * OHW, oh = q / OW, ow = q - oh * OW;
                const int ih0 = oh * sh - ph, iw0 = ow * sw - pw;
                roff[i] = ((n * H + ih0) * W + iw0) * Cp * (int)sizeof(T);  // x is under 2 GiB (conv.py checks)
                for (int kh = 0; kh < KH; ++kh)
                    for (int kw = 0; kw < KW; ++kw) {
                        const int ih = ih0 + kh * dh, iw = iw0 + kw * dw;
                        if ((unsigned)ih < (unsigned)H && (unsigned)iw < (unsigned)W) rmask[i] |= 1u << (kh * KW + kw);
                    }
            }
        }
        const T* wrow = w + (fa_i64)(o0 + r0) * wld + cl;  // this thread's first weight row, at k = cl
        const int wstep = RS * wld;                          // to row r0 + RS (i + 1) (w is under 2^31 elements)
        const int orows = O - o0 - r0;                     // rows r0 + RS i < O  <=>  RS i < orows
        int kc, kh, kw;  // k = (kt0 + kt) * BK + cl as (kh, kw, c); kh == KH past the end
        {
            const int k = kt0 * BK + cl, tap = k / Cp;
            kc = k - tap * Cp, kh = tap / KW, kw = tap - kh * KW;
        }
        for (int kt = 0; kt < nkt; ++kt) {  // kt counts this slice's k-tiles: the ring's stage and phase
            const int s = kt % STAGES;
            if (kt >= STAGES) mbar_wait(ring.empty(s), ((kt / STAGES) - 1) & 1);
            const unsigned sa = base + s * STAGE_BYTES + sw_off;
            const int kg = kt0 + kt;            // the k-tile in K
            const bool kok = kg * BK + cl < K;  // K is a multiple of 8: a chunk is wholly in or out
            // k = kg*BK + cl is tap (kh, kw), channel kc: its weight column (the plain packing's is k itself)
            const T* wsrc = PHASED ? wrow - cl + wt0 + kh * wt_h + kw * wt_w + kc : wrow + kg * BK;
#pragma unroll
            for (int i = 0; i < BM / RS; ++i) {  // a zero-filled chunk (src-size 0) points at w itself
                const bool ok = kok && RS * i < orows;
                fa_cp_async16(sa + i * RS * 128, ok ? wsrc + i * wstep : w, ok ? 16 : 0);
            }
            const unsigned sb = sa + A_BYTES;
            // this k-tile's tap for this thread: its bit in the rows' masks, and its x address at row offset 0
            const unsigned bit = kh < KH ? 1u << (kh * KW + kw) : 0u;
            const char* xt = reinterpret_cast<const char*>(x + ((fa_i64)(kh * dh) * W + kw * dw) * Cp + kc);
#pragma unroll
            for (int i = 0; i < NR; ++i) {
                const bool ok = (rmask[i] & bit) != 0;
                fa_cp_async16(sb + i * RS * 128, ok ? (const void*)(xt + roff[i]) : (const void*)x, ok ? 16 : 0);
            }
            mbar_cp_async_arrive(ring.full(s));
            kc += BK;
            while (kc >= Cp) {
                kc -= Cp;
                if (++kw == KW) kw = 0, ++kh;
            }
        }
        fa_cp_async_wait_all();
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_C));

    // ---------------------------------------------------------------------------- consumer warpgroups
    const int wg = warp >> 2, wl = warp & 3;
    float acc[NB][16][4];
    // K-major tiles: a k16 step is 32 bytes along the rows
    cw_consume<T, NB, STAGES, 0, 32, 16>(acc, nkt, base, STAGE_BYTES, wg * 64 * 128, A_BYTES, bar0, lane);

    // epilogue: acc[b][j][e] is channel row o0 + wg*64 + wl*16 + g + 8*(e/2), pixel p0 + b*128 + 8j + 2*t4 + e%2
    const int g = lane >> 2, t4 = lane & 3;
    if (ws != nullptr) {  // split over K: this slice's fp32 partial sums, ws[slice] (O, P - pw0) from pixel pw0
        const int PWs = P - pw0;
        float* part = ws + (fa_i64)blockIdx.y * O * PWs;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int o = o0 + wg * 64 + wl * 16 + g + hh * 8;
            if (o >= O) continue;
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const int p = p0 + b * 128 + j * 8 + 2 * t4;
                    float* dst = part + (fa_i64)o * PWs + (p - pw0);
                    if (p + 1 < P && (PWs & 1) == 0) {  // 8-byte aligned pair (pw0 is a multiple of BN)
                        float2 v;
                        v.x = acc[b][j][2 * hh], v.y = acc[b][j][2 * hh + 1];
                        *reinterpret_cast<float2*>(dst) = v;
                    } else {
                        if (p < P) dst[0] = acc[b][j][2 * hh];
                        if (p + 1 < P) dst[1] = acc[b][j][2 * hh + 1];
                    }
                }
        }
        return;
    }
    // the output tile goes through shared memory (the stages are free once both consumer warpgroups are done
    // reading them): rows of BN outputs (+ bias) at a stride of BN + 8 elements (conflict-free pair stores), then
    // each row of y's (N, O, OH*OW) out in coalesced 16-byte pieces of 8 pixels
    constexpr int LDT = BN + 8;
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    T* tile = reinterpret_cast<T*>(cw_smem + (base - fa_smem_addr(cw_smem)));
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = wg * 64 + wl * 16 + g + hh * 8;
        const float bv = bias != nullptr && o0 + r < O ? FaType<T>::to_float(bias[o0 + r]) : 0.f;
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *reinterpret_cast<fa_u32*>(tile + r * LDT + b * 128 + j * 8 + 2 * t4) =
                    FaType<T>::pack(acc[b][j][2 * hh] + bv, acc[b][j][2 * hh + 1] + bv);
    }
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    if constexpr (PHASED) {  // thread -> one pixel (n, i, j) of the tile, i.e. y[n, :, pa + ysh*i, pb + ysw*j]
        const int c = tid % BN, p = p0 + c;
        if (p < P) {
            const int n = p / OHW, q = p - n * OHW, i = q / OW, j = q - i * OW;
            const fa_i64 plane = (fa_i64)YH * YW;
            T* dst = y + ((fa_i64)n * O * YH + pa + ysh * i) * YW + pb + ysw * j;
            for (int r = tid / BN; r < BM && o0 + r < O; r += 256 / BN) dst[(o0 + r) * plane] = tile[r * LDT + c];
        }
        return;
    }
    // out to y (N, O, OH*OW) in 16-byte pieces; ADDS (a separate instantiation: the extra epilogue code cost the
    // plain convolution 0.5-2.5 %) adds emb[n, o] (a per-image bias: the time embedding) and res (the residual, y's
    // layout), either may be null, in fp32
    constexpr int VPR = BN / 8;  // 16-byte pieces per row
    const bool vec = (OHW & 7) == 0;  // then 8 pixels from a multiple of 8 lie in one image, 16-byte aligned
    for (int v = tid; v < BM * VPR; v += 256) {
        const int r = v / VPR, c = (v - r * VPR) * 8, o = o0 + r, p = p0 + c;
        if (o >= O || p >= P) continue;
        const T* src = tile + r * LDT + c;
        int n = p / OHW, q = p - n * OHW;
        if (vec && p + 8 <= P) {
            const fa_i64 at = ((fa_i64)n * O + o) * OHW + q;
            uint4 pk = *reinterpret_cast<const uint4*>(src);
            if constexpr (ADDS) {
                const float e = emb != nullptr ? FaType<T>::to_float(emb[(fa_i64)n * O + o]) : 0.f;
                const uint4 rk = res != nullptr ? *reinterpret_cast<const uint4*>(res + at) : make_uint4(0, 0, 0, 0);
                const T* a = reinterpret_cast<const T*>(&pk);
                const T* b = reinterpret_cast<const T*>(&rk);
                uint4 sum;
                fa_u32* sw32 = reinterpret_cast<fa_u32*>(&sum);
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    sw32[i] = FaType<T>::pack(FaType<T>::to_float(a[2 * i]) + e + FaType<T>::to_float(b[2 * i]),
                                              FaType<T>::to_float(a[2 * i + 1]) + e + FaType<T>::to_float(b[2 * i + 1]));
                pk = sum;
            }
            *reinterpret_cast<uint4*>(y + at) = pk;
        } else {
            for (int e = 0; e < 8 && p + e < P; ++e) {
                const fa_i64 at = ((fa_i64)n * O + o) * OHW + q;
                if constexpr (!ADDS) {
                    y[at] = src[e];
                } else {
                    float val = FaType<T>::to_float(src[e]);
                    if (emb != nullptr) val += FaType<T>::to_float(emb[(fa_i64)n * O + o]);
                    if (res != nullptr) val += FaType<T>::to_float(res[at]);
                    y[at] = FaType<T>::from_float(val);
                }
                if (++q == OHW) q = 0, ++n;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------- weight gradient
// Weight gradient of the forward above on warpgroup MMAs: the same inputs and fp32 partial sums as conv_dw_igemm
// (cuda_src/conv_igemm.cu), so that conv_dw_reduce sums them into dw (O, C, KH, KW):
//
//   ws[slice](O, K) = sum over this slice's pixels p of  dY[p, o] * X[p, k],   X[p, k] as in the forward (0 outside)
//
// with dY channel-last (P, Op) (Op = O rounded up to 8, channels >= O zero) and x NHWC (N, H, W, Cp). The reduction
// runs over pixels, so both operands are MN-major in shared memory: a stage holds, per 64 pixels, the dY tile as two
// 64-channel slabs [64 pixels][64 o] (one per consumer warpgroup) and the X tile as BN / 64 slabs [64 pixels][64 k],
// rows of 128 bytes swizzled as the forward's (wgmma.cuh's MN-major descriptors, slab stride LBO = 64 * 128 bytes).
// One CTA per (128 output channels, BN columns of K) and slice of kt_split 64-pixel k-tiles (blockIdx.y).
// Producer (PW warpgroups, 1 or 2): thread (c8, r0) gathers 16-byte chunk c8 of every slab's rows r0 + 16 PW i
// (i < 4 / PW) of each stage - eight threads read a row's 128 contiguous bytes; its columns' taps (offset in x,
// kh*dh, kw*dw: one column per slab) are fixed for the CTA and kept in registers, its rows' pixels walk on by 64 per
// stage. Two producer warpgroups halve each thread's rows: the gather's address arithmetic, not the tensor cores,
// bounds this kernel with one. TMA (PW 1, Cp a multiple of 64): the producer's first thread loads each stage with
// tensor-memory-accelerator copies instead - the dY slabs by tm_a (tiled, dY (P, Op)), each X slab by tm_x (the
// forward's im2col map of x, 64 pixels: slab q is 64 channels of one tap, its filter offsets fixed for the CTA).
template <typename T, int BN, int STAGES, int PW, bool TMA = false>
__global__ void __launch_bounds__(256 + 128 * PW, 1)
conv_dw_wgmma(const T* __restrict__ gt, const T* __restrict__ x, float* __restrict__ ws, int H, int W, int Cp, int O,
              int Op, int KH, int KW, int sh, int sw, int ph, int pw, int dh, int dw, int OH, int OW, int P, int K,
              int kt_split, const __grid_constant__ TmaMap tm_a, const __grid_constant__ TmaMap tm_x) {
    static_assert(!TMA || PW == 1, "TMA: one producer warpgroup");
    constexpr int BM = 128, BK = 64;
    constexpr int NB = BN / 128;  // wgmma m64n128 per k16 step and consumer warpgroup
    constexpr unsigned SLAB = BK * 128;  // one [64 pixels][64 channels] slab
    constexpr unsigned A_BYTES = 2 * SLAB, STAGE_BYTES = A_BYTES + (BN / 64) * SLAB;
    constexpr int NQ = BN / 64;  // X slabs of a stage
    static_assert(BN % 128 == 0 && BN <= 256 && STAGES >= 2, "tile shape");

    const CwRing<STAGES> ring = cw_ring<STAGES>();
    const unsigned base = ring.base, bar0 = ring.bar0;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int o_tiles = (O + BM - 1) / BM;
    const int o0 = (int)(blockIdx.x % o_tiles) * BM;
    const int k0 = (int)(blockIdx.x / o_tiles) * BN;
    const int kt0 = blockIdx.y * kt_split;  // this CTA's pixel k-tiles: kt0 .. kt0 + nkt - 1
    const int nkt = min((P + BK - 1) / BK - kt0, kt_split);

    cw_ring_init<STAGES, TMA ? 1 : 128 * PW>(bar0, tid);

    // PW producer warpgroups: 1 as the forward (72 / 216 registers within 168 x 384), 2 (56 / 200 within 128 x 512:
    // no spills at either tile; 48 / 208 spilled at 128x256)
    constexpr int REG_P = CwRegs<PW>::PRODUCER, REG_C = CwRegs<PW>::CONSUMER;
    constexpr int RSTEP = 16 * PW, NI = 4 / PW;  // a producer thread's rows: r0 + RSTEP i, i < NI
    if (warp >= 8) {  // ------------------------------------------------------- producer warpgroup(s)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_P));
        if constexpr (TMA) {
            if (tid != 256) return;
            // slab q's channel block and filter offsets; slabs wholly past K are not loaded
            const int nq = min(NQ, (K - k0 + 63) / 64);
            int qc[NQ], qw[NQ], qh[NQ];
#pragma unroll
            for (int q = 0; q < NQ; ++q) {
                const int k = k0 + 64 * q, t = k / Cp, kh = t / KW;
                qc[q] = k - t * Cp, qw[q] = (t - kh * KW) * dw, qh[q] = kh * dh;
            }
            const int OHW = OH * OW;
            int p = kt0 * BK, n = p / OHW, oh = (p - n * OHW) / OW, ow = p - n * OHW - oh * OW;
            for (int kt = 0; kt < nkt; ++kt) {
                const int s = kt % STAGES;
                if (kt >= STAGES) mbar_wait(ring.empty(s), ((kt / STAGES) - 1) & 1);
                const unsigned sa = base + s * STAGE_BYTES;
                mbar_arrive_expect_tx(ring.full(s), A_BYTES + nq * SLAB);
                cw_tma_2d(sa, &tm_a, o0, p, ring.full(s));
                cw_tma_2d(sa + SLAB, &tm_a, o0 + 64, p, ring.full(s));
#pragma unroll
                for (int q = 0; q < NQ; ++q)
                    if (q < nq)
                        cw_tma_im2col(sa + A_BYTES + q * SLAB, &tm_x, qc[q], ow * sw - pw, oh * sh - ph, n,
                                      (unsigned short)qw[q], (unsigned short)qh[q], ring.full(s));
                p += BK, ow += BK;
                while (ow >= OW) {
                    ow -= OW;
                    if (++oh == OH) oh = 0, ++n;
                }
            }
            return;
        }
        const int ptid = tid - 256;
        // thread (c8, r0) copies chunk c8 of every slab's 128-byte rows r0 + RSTEP i: eight threads cover a row's
        // 128 bytes (whole sectors), and the thread's X columns are one per slab
        const int c8 = ptid & 7, r0 = ptid >> 3;
        const unsigned swz = (unsigned)((c8 ^ (r0 & 7)) << 4);  // rows r0 + RSTEP i share the swizzle
        // X columns k0 + 64 q + 8 c8: the offset of (tap, channel) in x, and the tap's (kh*dh, kw*dw); a column past
        // K is never read (offset -1)
        int coff[NQ], ckh[NQ], ckw[NQ];
#pragma unroll
        for (int q = 0; q < NQ; ++q) {
            const int k = k0 + 64 * q + 8 * c8;
            const int t = k / Cp, c = k - t * Cp, kh = t / KW, kw = t - kh * KW;
            coff[q] = k < K ? ((kh * dh) * W + kw * dw) * Cp + c : -1;
            ckh[q] = kh * dh, ckw[q] = kw * dw;
        }
        const bool aok0 = o0 + 8 * c8 < Op, aok1 = o0 + 64 + 8 * c8 < Op;  // dY channel chunks inside dY's rows
        // the rows' pixels at k-tile kt0: p = (kt0 + kt) * 64 + r0 + RSTEP i, kept as (oh, ow) and the element offset
        // in x of the pixel's window corner (ih0, iw0), which walks on by additions alone (32-bit: conv.py keeps x
        // and dY under 2^31 elements); row i's dY offset is ao + RSTEP i Op. The address arithmetic per k-tile is what
        // bounds this producer: a 64-bit multiply chain per row had made it, not the tensor cores, the limit.
        int poh[NI], pow_[NI], xo[NI];
        const int OHW = OH * OW;
#pragma unroll
        for (int i = 0; i < NI; ++i) {
            const int p = kt0 * BK + r0 + RSTEP * i, n = p / OHW, q = p - n * OHW;
            poh[i] = q / OW, pow_[i] = q - poh[i] * OW;
            xo[i] = ((n * H + poh[i] * sh - ph) * W + pow_[i] * sw - pw) * Cp;
        }
        int ao = (kt0 * BK + r0) * Op + o0 + 8 * c8;
        int pb = kt0 * BK + r0;  // row i's pixel is pb + RSTEP i
        const int row_step = BK * sw * Cp, wrap_step = (sh * W - OW * sw) * Cp, img_step = (H - OH * sh) * W * Cp;
        for (int kt = 0; kt < nkt; ++kt) {
            const int s = kt % STAGES;
            if (kt >= STAGES) mbar_wait(ring.empty(s), ((kt / STAGES) - 1) & 1);
            const unsigned st = base + s * STAGE_BYTES + r0 * 128 + swz;
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                const bool pok = pb + RSTEP * i < P;
                const unsigned row = st + i * RSTEP * 128;
                const T* asrc = gt + (ao + RSTEP * i * Op);
                fa_cp_async16(row, pok && aok0 ? (const void*)asrc : (const void*)gt, pok && aok0 ? 16 : 0);
                fa_cp_async16(row + SLAB, pok && aok1 ? (const void*)(asrc + 64) : (const void*)gt,
                              pok && aok1 ? 16 : 0);
                const int ih0 = poh[i] * sh - ph, iw0 = pow_[i] * sw - pw;
                const T* xrow = x + xo[i];
#pragma unroll
                for (int q = 0; q < NQ; ++q) {
                    const bool ok = pok && coff[q] >= 0 && (unsigned)(ih0 + ckh[q]) < (unsigned)H &&
                                    (unsigned)(iw0 + ckw[q]) < (unsigned)W;
                    fa_cp_async16(row + A_BYTES + q * SLAB, ok ? (const void*)(xrow + coff[q]) : (const void*)x,
                                  ok ? 16 : 0);
                }
            }
            mbar_cp_async_arrive(ring.full(s));
            pb += BK;
            ao += BK * Op;
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                pow_[i] += BK;
                xo[i] += row_step;
                while (pow_[i] >= OW) {
                    pow_[i] -= OW;
                    xo[i] += wrap_step;
                    if (++poh[i] == OH) poh[i] = 0, xo[i] += img_step;
                }
            }
        }
        fa_cp_async_wait_all();
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_C));

    // ---------------------------------------------------------------------------- consumer warpgroups
    const int wg = warp >> 2, wl = warp & 3;
    float acc[NB][16][4];
    // MN-major slabs: a k16 step is 16 rows of 128 bytes, the next 64 columns a slab on
    cw_consume<T, NB, STAGES, 1, 16 * 128, SLAB>(acc, nkt, base, STAGE_BYTES, wg * SLAB, A_BYTES, bar0, lane);

    // epilogue: acc[b][j][e] is output channel o0 + wg*64 + wl*16 + g + 8*(e/2), column k0 + b*128 + 8j + 2*t4 + e%2;
    // K is a multiple of 8, so an even column inside K has its pair inside too
    const int g = lane >> 2, t4 = lane & 3;
    float* part = ws + (fa_i64)blockIdx.y * O * K;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int o = o0 + wg * 64 + wl * 16 + g + hh * 8;
        if (o >= O) continue;
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int k = k0 + b * 128 + j * 8 + 2 * t4;
                if (k < K) {
                    float2 v;
                    v.x = acc[b][j][2 * hh], v.y = acc[b][j][2 * hh + 1];
                    *reinterpret_cast<float2*>(part + (fa_i64)o * K + k) = v;
                }
            }
    }
}
