// Implicit-GEMM conv2d on tensor cores (flame_core/ops/conv/implicit_gemm.py): bf16/fp16 operands, fp32 accumulation, no column
// matrix. The input is first copied to NHWC with its channels zero-padded to Cp (a multiple of 8), so that every
// 16-byte chunk of the implicit column matrix is 8 channels of one input pixel at one kernel tap: one cp.async each.
//
//   forward / dx   D(O, P) = Wp(O, K) @ X(P, K)^T           K = KH*KW*Cp, k = (kh*KW + kw)*Cp + c
//                  X[p, k] = x_nhwc[n, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw, c]  (zero outside the image)
//                  dx is the stride-1 conv of dy (NHWC, Op channels) with the flipped, transposed weights.
//   dw             D(O, K) = dY(P, O)^T @ X(P, K)  reduced over the P = N*OH*OW output pixels, split into slices.
//
// Tiles stream through shared memory in STAGES cp.async stages (XOR-swizzled rows of 64 elements), and the warp
// products use the mma.sync m16n8k16 / ldmatrix machinery of flash_attention.cuh (fragment schedule: cv_warp_gemm). A forward tile writes y (NCHW,
// + bias) straight from its accumulators, or fp32 partials for a split reduction (conv_splitk_reduce).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common.cuh"  // to_f32 / from_f32
#include "flash_attention.cuh"

extern __shared__ __align__(128) unsigned char conv_smem[];

__device__ __forceinline__ void cv_store2(float* p, float a, float b) {  // p 8-byte aligned
    float2 v;
    v.x = a, v.y = b;
    *reinterpret_cast<float2*>(p) = v;
}

template <int N>
__device__ __forceinline__ void cv_cp_async_wait() {  // at most N of this thread's cp.async groups still pending
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ------------------------------------------------------------------------------------------ layout copies
// out[b][l'][r] = r < R ? in[b][r][l] : 0 for r < Rp, where l' = l, or with G > 0 the tap-flipped
// (l / G) * G + G - 1 - l % G. NCHW -> NHWC (channel-padded) is (B, R, L) = (N, C, H*W), Rp = Cp; the flipped
// weights of dx are (1, O, C*KH*KW) with G = KH*KW, Rp = Op. grid (ceil(L/64), ceil(Rp/64), B), 256 threads,
// dynamic shared memory 64 * (64 + 2) * sizeof(T).
template <typename T>
__global__ void __launch_bounds__(256) conv_transpose_pad(const T* __restrict__ in, T* __restrict__ out,
                                                          int R, int L, int Rp, int G) {
    constexpr int LD = 64 + (sizeof(T) == 2 ? 2 : 1);  // 2-byte rows of 33 words: conflict-free column reads
    T* tile = reinterpret_cast<T*>(conv_smem);
    const int l0 = blockIdx.x * 64, r0 = blockIdx.y * 64;
    const fa_i64 b = blockIdx.z;
    const T* src = in + b * R * L;
    const T zero = from_f32<T>(0.f);
#pragma unroll
    for (int j = 0; j < 16; ++j) {  // all 16 loads in flight at once
        const int i = threadIdx.x + j * 256, rr = i >> 6, ll = i & 63, r = r0 + rr, l = l0 + ll;
        tile[rr * LD + ll] = (r < R && l < L) ? src[(fa_i64)r * L + l] : zero;
    }
    __syncthreads();
    T* dst = out + b * L * Rp;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int i = threadIdx.x + j * 256, ll = i >> 6, rr = i & 63, r = r0 + rr, l = l0 + ll;
        if (r < Rp && l < L) {
            const int lo = G > 0 ? (l / G) * G + (G - 1 - l % G) : l;
            dst[(fa_i64)lo * Rp + r] = tile[rr * LD + ll];
        }
    }
}

// Forward weights (O, C, T) -> (O, T, Cp), channels >= C zero. One block per (o, CT channels): the block's
// CT * T input elements are contiguous. grid (ceil(Cp / CT), O), 256 threads, dynamic shared memory CT*T*sizeof(T).
template <typename T>
__global__ void __launch_bounds__(256) conv_pack_weight(const T* __restrict__ w, T* __restrict__ out, int C,
                                                        int Cp, int T_, int CT) {
    T* s = reinterpret_cast<T*>(conv_smem);
    const int c0 = blockIdx.x * CT, o = blockIdx.y;
    const int nc = max(0, min(CT, C - c0));
    const T* src = w + ((fa_i64)o * C + c0) * T_;
#pragma unroll 8
    for (int i = threadIdx.x; i < nc * T_; i += 256) s[i] = src[i];
    __syncthreads();
    const int cw = min(CT, Cp - c0);  // channels this block writes
    T* dst = out + (fa_i64)o * T_ * Cp + c0;
    const T zero = from_f32<T>(0.f);
#pragma unroll 4
    for (int i = threadIdx.x; i < cw * T_; i += 256) {
        const int t = i / cw, cc = i - t * cw;
        dst[(fa_i64)t * Cp + cc] = cc < nc ? s[cc * T_ + t] : zero;
    }
}

// dx (planes, H, W) of a strided conv (stride sh, sw <= 2) from its phases' outputs: phase (a, b) (rows a::sh,
// columns b::sw) is p[a * 2 + b] (planes, ceil((H - a) / sh), ceil((W - b) / sw)), or null where the phase has no
// tap (zeros). One pass writing every element of dx once, in 16-byte pieces of 8 when W is a multiple of 8 - the
// phases' strided scatters had each rewritten dx's sectors in part. grid (ceil(planes * H * ceil(W/8) / 256)), 256.
template <typename T>
__global__ void __launch_bounds__(256) conv_dx_interleave(const T* __restrict__ p00, const T* __restrict__ p01,
                                                          const T* __restrict__ p10, const T* __restrict__ p11,
                                                          T* __restrict__ dx, fa_i64 planes, int H, int W, int sh,
                                                          int sw) {
    const int W8 = (W + 7) / 8;
    const fa_i64 idx = (fa_i64)blockIdx.x * 256 + threadIdx.x;
    if (idx >= planes * H * W8) return;
    const int w0 = (int)(idx % W8) * 8;
    const fa_i64 row = idx / W8;  // plane * H + h
    const int h = (int)(row % H);
    const fa_i64 plane = row / H;
    const int a = h % sh, i = h / sh, Ra = (H - a + sh - 1) / sh;
    const T* pb0 = a ? p10 : p00;
    const T* pb1 = a ? p11 : p01;
    const T zero = from_f32<T>(0.f);
    T v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int w = w0 + e, b = w % sw, j = w / sw, Cb = (W - b + sw - 1) / sw;
        const T* src = b ? pb1 : pb0;
        v[e] = (w < W && src != nullptr) ? src[(plane * Ra + i) * Cb + j] : zero;
    }
    T* dst = dx + row * W + w0;
    if ((W & 7) == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
    } else {
        for (int e = 0; e < 8 && w0 + e < W; ++e) dst[e] = v[e];
    }
}

// ------------------------------------------------------------------------------------------ split reductions
// y[n, o, q] = sum_s ws[s, o, n*OHW + q - p_first] (+ bias[o]) (+ emb[n, o]) (+ res[n, o, q]) for the pixels
// n*OHW + q >= p_first (a tail launch's: ws (S, O, P) holds pixels p_first .. p_first + P - 1, P the pitch).
// grid (ceil(OHW/256), O, images from n_first = p_first / OHW on), 256 threads.
template <typename T>
__global__ void __launch_bounds__(256) conv_splitk_reduce(const float* __restrict__ ws, const T* __restrict__ bias,
                                                          T* __restrict__ y, int S, int O, int OHW, fa_i64 P,
                                                          fa_i64 p_first, const T* __restrict__ emb,
                                                          const T* __restrict__ res) {
    const int q = blockIdx.x * 256 + threadIdx.x;
    if (q >= OHW) return;
    const int o = blockIdx.y;
    const fa_i64 n = p_first / OHW + blockIdx.z;
    if (n * OHW + q < p_first) return;
    const float* src = ws + (fa_i64)o * P + n * OHW + q - p_first;
    const fa_i64 slice = (fa_i64)O * P;
    float s = 0.f;
    for (int z = 0; z < S; ++z) s += src[z * slice];
    if (bias != nullptr) s += to_f32(bias[o]);
    if (emb != nullptr) s += to_f32(emb[n * O + o]);
    if (res != nullptr) s += to_f32(res[(n * O + o) * OHW + q]);
    y[(n * O + o) * OHW + q] = from_f32<T>(s);
}

// dw[o, c, t] = sum_s ws[s, o, t*Cp + c] for c < C (+ acc32[o, c, t] when accumulate); the fp32 sum goes to acc32
// and/or dw (either may be null). grid (ceil(K/256), O), 256 threads; reads coalesced, writes scattered by T.
template <typename T>
__global__ void __launch_bounds__(256) conv_dw_reduce(const float* __restrict__ ws, float* __restrict__ acc32,
                                                      T* __restrict__ dw, int S, int O, int C, int Cp, int T_,
                                                      int accumulate) {
    const int K = T_ * Cp;
    const int kc = blockIdx.x * 256 + threadIdx.x;
    if (kc >= K) return;
    const int t = kc / Cp, c = kc - t * Cp;
    if (c >= C) return;
    const int o = blockIdx.y;
    const float* src = ws + (fa_i64)o * K + kc;
    const fa_i64 slice = (fa_i64)O * K;
    float s = 0.f;
    for (int z = 0; z < S; ++z) s += src[z * slice];
    const fa_i64 d = ((fa_i64)o * C + c) * T_ + t;
    if (accumulate) s += acc32[d];
    if (acc32 != nullptr) acc32[d] = s;
    if (dw != nullptr) dw[d] = from_f32<T>(s);
}

// ------------------------------------------------------------------------------------------ warp products
// acc[MT][NT] += A (MT*16 x KSTEPS*16) * B (KSTEPS*16 x NT*8) from swizzled shared memory, as fa_warp_gemm, in one of
// three fragment schedules (the PIPE template argument of the GEMM kernels):
//   0  fa_warp_gemm unpipelined: every fragment read just before its mma's
//   1  fa_warp_gemm pipelined: A and B fragments double-buffered (MT*8 + 8 registers of fragments)
//   2  A fragments single-buffered, B double-buffered (MT*4 + 8 registers): during the last B pair of a k-step each
//      A fragment is re-read for the next k-step right after its last mma's, so its latency hides behind the mma's
//      of the other m-tiles. For warp tiles with many m-tiles (MT = 5: 160 accumulators), where mode 1 spills.
template <typename T, int MT, int NT, int KSTEPS, bool A_T, bool B_T, int ACOLS, int BCOLS, int PIPE>
__device__ __forceinline__ void cv_warp_gemm(float (&acc)[MT][NT][4], const FaFrag<ACOLS>& fa,
                                             const FaFrag<BCOLS>& fb) {
    if constexpr (PIPE != 2) {
        fa_warp_gemm<T, MT, NT, KSTEPS, A_T, B_T, ACOLS, BCOLS, PIPE == 1>(acc, fa, fb);
    } else {
        static_assert(NT % 2 == 0, "n-tiles come in pairs");
        constexpr int NP = NT / 2;
        fa_u32 a[MT][4], b[2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) fa_ldsm<ACOLS, A_T>(a[mt], fa, A_T ? 0 : mt * 16, A_T ? mt * 2 : 0);
        fa_ldsm<BCOLS, B_T>(b[0], fb, 0, 0);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
            for (int np = 0; np < NP; ++np) {
                const int step = kk * NP + np;
                if (np + 1 < NP)
                    fa_ldsm<BCOLS, B_T>(b[(step + 1) & 1], fb, B_T ? kk * 16 : (np + 1) * 16,
                                        B_T ? (np + 1) * 2 : kk * 2);
                else if (kk + 1 < KSTEPS)
                    fa_ldsm<BCOLS, B_T>(b[(step + 1) & 1], fb, B_T ? (kk + 1) * 16 : 0, B_T ? 0 : (kk + 1) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    FaType<T>::mma(acc[mt][2 * np], a[mt], b[step & 1][0], b[step & 1][1]);
                    FaType<T>::mma(acc[mt][2 * np + 1], a[mt], b[step & 1][2], b[step & 1][3]);
                    if (np + 1 == NP && kk + 1 < KSTEPS)
                        fa_ldsm<ACOLS, A_T>(a[mt], fa, A_T ? (kk + 1) * 16 : mt * 16, A_T ? mt * 2 : (kk + 1) * 2);
                }
            }
    }
}

// ------------------------------------------------------------------------------------------ forward / dx
// D(O, P) = Wp(O, K) @ X(P, K)^T for the pixels P = N*OH*OW of an NHWC input x (N, H, W, Cp). One CTA per
// (BM output channels, BN pixels, split slice); blockIdx.x = pixel_tile * o_tiles + o_tile (the o-tiles of a pixel
// tile run together and share its input reads in L2), blockIdx.y = the slice of kt_split k-tiles.
// ws == null: y (N, O, OH*OW) = D + bias; else ws[slice] (O, P) = D in fp32.
template <typename T, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int MINB, int PIPE>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32, MINB)
conv_fwd_igemm(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ y,
               float* __restrict__ ws, int H, int W, int Cp, int O, int KH, int KW, int sh, int sw, int ph, int pw,
               int dh, int dw, int OH, int OW, int P, int K, int kt_split) {
    constexpr int NTHREADS = WARPS_M * WARPS_N * 32;
    constexpr int BK = 64;                       // k per stage: 8 chunks of 16 bytes per tile row
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MT = WM / 16, NT = WN / 8;
    constexpr int RPI = NTHREADS / 8;            // pixel rows per loader step
    constexpr int BR = BN / RPI;                 // pixel rows each thread gathers
    constexpr int A_BYTES = BM * BK * 2, STAGE_BYTES = (BM + BN) * BK * 2;
    static_assert(WM % 16 == 0 && WN % 16 == 0 && BN % RPI == 0 && BM % RPI == 0 && RPI % 8 == 0, "tile shape");

    const fa_u32 s0 = fa_smem_addr(conv_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    const int o_tiles = (O + BM - 1) / BM;
    const int o0 = (int)(blockIdx.x % o_tiles) * BM;
    const int p0 = (int)(blockIdx.x / o_tiles) * BN;
    const int KT = (K + BK - 1) / BK;
    const int kt0 = blockIdx.y * kt_split;
    const int nkt = min(KT - kt0, kt_split);
    const int OHW = OH * OW;

    // gather state: this thread copies channel chunk cl of pixel rows r0 + i*RPI
    const int cl = (tid & 7) * 8, r0 = tid >> 3;
    int rn[BR], rh[BR], rw[BR];  // n*H, oh*sh - ph, ow*sw - pw of each row (rh far negative past the last pixel)
#pragma unroll
    for (int i = 0; i < BR; ++i) {
        const int p = p0 + r0 + i * RPI;
        if (p < P) {
            const int n = p / OHW, q = p - n * OHW, oh = q / OW, ow = q - oh * OW;
            rn[i] = n * H, rh[i] = oh * sh - ph, rw[i] = ow * sw - pw;
        } else {
            rn[i] = 0, rh[i] = -(1 << 30), rw[i] = 0;
        }
    }
    int kc, kh, kw;  // k = kt * BK + cl as (kh, kw, c); kh == KH past the end
    {
        const int k = kt0 * BK + cl, tap = k / Cp;
        kc = k - tap * Cp, kh = tap / KW, kw = tap - kh * KW;
    }
    fa_u32 b_off[BR];
#pragma unroll
    for (int i = 0; i < BR; ++i) b_off[i] = A_BYTES + 2 * fa_swz<BK>(r0 + i * RPI, cl);
    const T* wo = w + (fa_i64)o0 * K;

    auto load_stage = [&](int stage, int kt) {  // k-tiles are loaded in order: the (kh, kw, c) state steps by BK
        const fa_u32 sa = s0 + stage * STAGE_BYTES;
        fa_load_tile<BM, BK, NTHREADS>(sa, wo + kt * BK, K, O - o0, K - kt * BK, tid);
        const bool kok = kh < KH;
        const int oh_ = kh * dh, ow_ = kw * dw;
#pragma unroll
        for (int i = 0; i < BR; ++i) {
            const int ih = rh[i] + oh_, iw = rw[i] + ow_;
            const bool ok = kok && (unsigned)ih < (unsigned)H && (unsigned)iw < (unsigned)W;
            const T* src = ok ? x + ((fa_i64)(rn[i] + ih) * W + iw) * Cp + kc : x;
            fa_cp_async16(sa + b_off[i], src, ok ? 16 : 0);
        }
        kc += BK;
        while (kc >= Cp) {
            kc -= Cp;
            if (++kw == KW) kw = 0, ++kh;
        }
    };

    float acc[MT][NT][4];
    fa_zero(acc);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nkt) load_stage(s, kt0 + s);
        fa_cp_async_commit();
    }
    const FaFrag<BK> fa0(s0, wm * WM, 0, lane, false);
    const FaFrag<BK> fb0(s0 + A_BYTES, wn * WN, 0, lane, true);
    int stage = 0;
    for (int i = 0; i < nkt; ++i) {
        cv_cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile i visible to all; every warp is done with the stage refilled next
        const int nx = i + STAGES - 1;
        if (nx < nkt) load_stage(stage == 0 ? STAGES - 1 : stage - 1, kt0 + nx);
        fa_cp_async_commit();
        FaFrag<BK> fa = fa0, fb = fb0;
        fa.base += stage * STAGE_BYTES;
        fb.base += stage * STAGE_BYTES;
        cv_warp_gemm<T, MT, NT, BK / 16, false, false, BK, BK, PIPE>(acc, fa, fb);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
    fa_cp_async_wait_all();

    // epilogue: accumulator (mt, nt, e) is channel row mt*16 + g + 8*(e/2), pixel column nt*8 + 2*t4 + e%2
    const int g = lane >> 2, t4 = lane & 3;
    const bool pair = (OHW & 1) == 0;  // then a pixel pair (2*j, 2*j+1) lies in one image, 4/8-byte aligned
    int pn[NT], pq[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int p = p0 + wn * WN + nt * 8 + 2 * t4;
        pn[nt] = p / OHW, pq[nt] = p - pn[nt] * OHW;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int o = o0 + wm * WM + mt * 16 + g + hh * 8;
            if (o >= O) continue;
            if (ws != nullptr) {
                float* wrow = ws + ((fa_i64)blockIdx.y * O + o) * P;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int p = p0 + wn * WN + nt * 8 + 2 * t4;
                    if (p >= P) continue;
                    const float v0 = acc[mt][nt][2 * hh], v1 = acc[mt][nt][2 * hh + 1];
                    if (pair) {
                        cv_store2(wrow + p, v0, v1);
                    } else {
                        wrow[p] = v0;
                        if (p + 1 < P) wrow[p + 1] = v1;
                    }
                }
            } else {
                const float bv = bias != nullptr ? to_f32(bias[o]) : 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int p = p0 + wn * WN + nt * 8 + 2 * t4;
                    if (p >= P) continue;
                    const float v0 = acc[mt][nt][2 * hh] + bv, v1 = acc[mt][nt][2 * hh + 1] + bv;
                    T* dst = y + ((fa_i64)pn[nt] * O + o) * OHW + pq[nt];
                    if (pair) {
                        *reinterpret_cast<fa_u32*>(dst) = FaType<T>::pack(v0, v1);
                    } else {
                        *dst = FaType<T>::from_float(v0);
                        if (p + 1 < P) {
                            T* d1 = pq[nt] + 1 < OHW ? dst + 1 : y + ((fa_i64)(pn[nt] + 1) * O + o) * OHW;
                            *d1 = FaType<T>::from_float(v1);
                        }
                    }
                }
            }
        }
}

// ------------------------------------------------------------------------------------------ dw
// ws[slice] (O, K) = dY(P, O)^T @ X(P, K) over this slice's pixels, dY = dy in NHWC (P, Op) (channels >= O zero),
// x NHWC (N, H, W, Cp). One CTA per (BM output channels, BN columns k, slice of kt_split 64-pixel k-tiles);
// blockIdx.x = k_tile * o_tiles + o_tile. Both tiles are pixel-major in shared memory: [64 p][BM o] (A^T) and
// [64 p][BN k] (B), read with ldmatrix.trans.
template <typename T, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int MINB, int PIPE>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32, MINB)
conv_dw_igemm(const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ ws, int H, int W, int Cp,
              int O, int Op, int KH, int KW, int sh, int sw, int ph, int pw, int dh, int dw, int OH, int OW, int P,
              int K, int kt_split) {
    constexpr int NTHREADS = WARPS_M * WARPS_N * 32;
    constexpr int BK = 64;                       // pixels per stage
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MT = WM / 16, NT = WN / 8;
    constexpr int CPR = BN / 8;                  // 16-byte chunks per B row
    constexpr int RPI = NTHREADS / CPR;          // B rows per loader step
    constexpr int BR = BK / RPI;                 // B rows each thread gathers
    constexpr int A_BYTES = BK * BM * 2, STAGE_BYTES = BK * (BM + BN) * 2;
    static_assert(WM % 16 == 0 && WN % 16 == 0 && BM % 64 == 0 && BN % 64 == 0 && NTHREADS % CPR == 0 &&
                  BK % RPI == 0 && RPI % 8 == 0, "tile shape");

    const fa_u32 s0 = fa_smem_addr(conv_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    const int o_tiles = (O + BM - 1) / BM;
    const int o0 = (int)(blockIdx.x % o_tiles) * BM;
    const int k0 = (int)(blockIdx.x / o_tiles) * BN;
    const int KT = (P + BK - 1) / BK;
    const int kt0 = blockIdx.y * kt_split;
    const int nkt = min(KT - kt0, kt_split);

    // gather state: this thread copies column chunk cc of pixel rows r0 + i*RPI
    const int cc = (tid % CPR) * 8, r0 = tid / CPR;
    const int kcol = k0 + cc;
    const bool kok = kcol < K;
    int offh, offw, c;
    {
        const int tap = kcol / Cp, kh = tap / KW, kw = tap - kh * KW;
        c = kcol - tap * Cp, offh = kh * dh - ph, offw = kw * dw - pw;
    }
    int rn[BR], roh[BR], row_[BR];  // n*H, oh, ow of each row's pixel kt*BK + r0 + i*RPI
#pragma unroll
    for (int i = 0; i < BR; ++i) {
        const int p = kt0 * BK + r0 + i * RPI;
        const int n = p / (OH * OW), q = p - n * (OH * OW), oh = q / OW;
        rn[i] = n * H, roh[i] = oh, row_[i] = q - oh * OW;
    }
    fa_u32 b_off[BR];
#pragma unroll
    for (int i = 0; i < BR; ++i) b_off[i] = A_BYTES + 2 * fa_swz<BN>(r0 + i * RPI, cc);

    auto load_stage = [&](int stage, int kt) {  // k-tiles are loaded in order: each row steps by BK pixels
        const fa_u32 sa = s0 + stage * STAGE_BYTES;
        const int rows_left = P - kt * BK - r0;  // row i holds a pixel when i * RPI < rows_left
        fa_load_tile<BK, BM, NTHREADS>(sa, dy + (fa_i64)kt * BK * Op + o0, Op, P - kt * BK, Op - o0, tid);
#pragma unroll
        for (int i = 0; i < BR; ++i) {
            const int ih = roh[i] * sh + offh, iw = row_[i] * sw + offw;
            const bool ok = kok && i * RPI < rows_left && (unsigned)ih < (unsigned)H && (unsigned)iw < (unsigned)W;
            const T* src = ok ? x + ((fa_i64)(rn[i] + ih) * W + iw) * Cp + c : x;
            fa_cp_async16(sa + b_off[i], src, ok ? 16 : 0);
            row_[i] += BK;
            while (row_[i] >= OW) {
                row_[i] -= OW;
                if (++roh[i] == OH) roh[i] = 0, rn[i] += H;
            }
        }
    };

    float acc[MT][NT][4];
    fa_zero(acc);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nkt) load_stage(s, kt0 + s);
        fa_cp_async_commit();
    }
    const FaFrag<BM> fa0(s0, 0, wm * WM / 8, lane, true);
    const FaFrag<BN> fb0(s0 + A_BYTES, 0, wn * WN / 8, lane, false);
    int stage = 0;
    for (int i = 0; i < nkt; ++i) {
        cv_cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int nx = i + STAGES - 1;
        if (nx < nkt) load_stage(stage == 0 ? STAGES - 1 : stage - 1, kt0 + nx);
        fa_cp_async_commit();
        FaFrag<BM> fa = fa0;
        FaFrag<BN> fb = fb0;
        fa.base += stage * STAGE_BYTES;
        fb.base += stage * STAGE_BYTES;
        cv_warp_gemm<T, MT, NT, BK / 16, true, true, BM, BN, PIPE>(acc, fa, fb);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
    fa_cp_async_wait_all();

    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int o = o0 + wm * WM + mt * 16 + g + hh * 8;
            if (o >= O) continue;
            float* wrow = ws + ((fa_i64)blockIdx.y * O + o) * K;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int k = k0 + wn * WN + nt * 8 + 2 * t4;  // K is a multiple of 8: k < K => k + 1 < K
                if (k < K) cv_store2(wrow + k, acc[mt][nt][2 * hh], acc[mt][nt][2 * hh + 1]);
            }
        }
}
