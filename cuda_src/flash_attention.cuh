// Shared pieces of the FlashAttention-2 kernels (flash_attention_fwd.cu, flash_attention_bwd.cu): tensor-core
// fragments (mma.sync m16n8k16, ldmatrix), cp.async tile copies into XOR-swizzled shared memory, and the mask rule.
// NVRTC-compatible: CUDA headers only.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int fa_u32;
typedef long long fa_i64;

#define FA_NEG_INF __int_as_float(0xff800000)
#define FA_POS_INF __int_as_float(0x7f800000)
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

// Mask kinds (template argument): none, boolean (uint8, nonzero = attend), additive float32.
#define FA_MASK_NONE 0
#define FA_MASK_BOOL 1
#define FA_MASK_FLOAT 2

__device__ __forceinline__ float fa_exp2(float x) {  // ex2.approx(-inf) = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ------------------------------------------------------------------------------------------ element types
template <typename T> struct FaType;

template <> struct FaType<__nv_bfloat16> {
    static __device__ __forceinline__ fa_u32 pack(float lo, float hi) {
        union { __nv_bfloat162 h; fa_u32 u; } c;
        c.h = __floats2bfloat162_rn(lo, hi);
        return c.u;
    }
    // c += a (16x16, row) * b (16x8, col), fp32 accumulators
    static __device__ __forceinline__ void mma(float (&c)[4], const fa_u32 (&a)[4], fa_u32 b0, fa_u32 b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <> struct FaType<__half> {
    static __device__ __forceinline__ fa_u32 pack(float lo, float hi) {
        union { __half2 h; fa_u32 u; } c;
        c.h = __floats2half2_rn(lo, hi);
        return c.u;
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const fa_u32 (&a)[4], fa_u32 b0, fa_u32 b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

// fp32 accumulator fragments of NTS n8 tiles (an mma / wgmma result: P, P^T, dS^T) as the register A fragments of
// the next product's NTS / 2 k16 steps (O += P V in the forward; dV, dK in the Hopper backward).
template <typename T, int NTS>
__device__ __forceinline__ void fa_sm90_pack(fa_u32 (&pa)[NTS / 2][4], const float (&s_acc)[NTS][4]) {
#pragma unroll
    for (int kk = 0; kk < NTS / 2; ++kk) {
        pa[kk][0] = FaType<T>::pack(s_acc[2 * kk][0], s_acc[2 * kk][1]);
        pa[kk][1] = FaType<T>::pack(s_acc[2 * kk][2], s_acc[2 * kk][3]);
        pa[kk][2] = FaType<T>::pack(s_acc[2 * kk + 1][0], s_acc[2 * kk + 1][1]);
        pa[kk][3] = FaType<T>::pack(s_acc[2 * kk + 1][2], s_acc[2 * kk + 1][3]);
    }
}

// ------------------------------------------------------------------------------------------ shared memory
// A tile row of COLS 2-byte elements (COLS a multiple of 64) is 16-byte chunks; chunk c of row r is stored at chunk
// c ^ (r & 7). ldmatrix reads one chunk from each of 8 consecutive rows: all 8 land in different banks.
template <int COLS>
__device__ __forceinline__ int fa_swz(int r, int c) {
    static_assert(COLS % 64 == 0, "swizzled tiles need rows of a multiple of 64 elements");
    return r * COLS + ((((c >> 3) ^ r) & 7) | ((c >> 3) & ~7)) * 8 + (c & 7);
}

__device__ __forceinline__ fa_u32 fa_smem_addr(const void* p) {  // generic -> shared window address
    return static_cast<fa_u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void fa_ldsm_x4(fa_u32 (&r)[4], fa_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void fa_ldsm_x4_t(fa_u32 (&r)[4], fa_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void fa_cp_async16(fa_u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void fa_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void fa_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Asynchronously copies a ROWS x COLS tile of a row-major global matrix (row stride `ld` elements, 16-byte aligned
// rows) into swizzled shared memory at `s`. Rows >= n_rows and columns >= n_cols (a multiple of 8) read as zero.
// Each thread copies one 16-byte column chunk of every RPI-th row, walking one pointer (few live registers).
template <int ROWS, int COLS, int NTHREADS, typename T>
__device__ __forceinline__ void fa_load_tile(fa_u32 s, const T* __restrict__ g, fa_i64 ld, int n_rows, int n_cols,
                                             int tid) {
    constexpr int CPR = COLS / 8;  // chunks per row
    static_assert(NTHREADS % CPR == 0, "threads must cover whole rows");
    constexpr int RPI = NTHREADS / CPR;  // rows per step
    static_assert(ROWS % RPI == 0, "tile rows must be a multiple of the rows per step");
    const int r0 = tid / CPR, c = (tid % CPR) * 8;
    const bool col_ok = c < n_cols;
    const T* p = g + r0 * ld + c;
    const fa_i64 step = RPI * ld;
#pragma unroll
    for (int it = 0; it < ROWS / RPI; ++it) {
        const int r = r0 + it * RPI;
        const bool ok = col_ok && r < n_rows;
        fa_cp_async16(s + 2 * fa_swz<COLS>(r, c), ok ? (const void*)p : (const void*)g, ok ? 16 : 0);
        p += step;
    }
}

// ------------------------------------------------------------------------------------------ fragments
// Per-lane addressing of mma operand fragments (ldmatrix x4) in a swizzled tile of COLS columns. A fragment covers
// 16 tile rows x 2 chunks. Lane pattern 1 (rows lane & 15, chunk + lane / 16) reads A from a row-major tile and B
// from a row-major (k x n) tile with .trans; pattern 2 (rows lane & 7 + 8 * (lane / 16), chunk + lane / 8 % 2) reads
// B from a tile holding B^T (n x k, as K for Q K^T) and A from a tile holding A^T with .trans.
// `row0` (a multiple of 8) and `wc` (even, in chunks) are the warp's offsets; the four swizzled chunk offsets are
// computed once, so every fragment address is this lane's base plus compile-time constants.
template <int COLS>
struct FaFrag {
    fa_u32 base;
    fa_u32 off[4];
    __device__ __forceinline__ FaFrag(fa_u32 s, int row0, int wc, int lane, bool pattern2) {
        const int rl = pattern2 ? (lane & 7) + ((lane >> 4) << 3) : (lane & 15);
        const int cl = pattern2 ? ((lane >> 3) & 1) : (lane >> 4);
        base = s + (row0 + rl) * (COLS * 2);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = wc + 2 * j + cl;
            off[j] = ((c & ~7) | ((c ^ lane) & 7)) * 16;
        }
    }
    // fragment whose first tile row is row0 + r (r a multiple of 8) and first chunk wc + cc (cc even)
    __device__ __forceinline__ fa_u32 at(int r, int cc) const {
        return base + r * (COLS * 2) + off[(cc & 7) >> 1] + (cc & ~7) * 16;
    }
};

template <int COLS, bool TRANS>
__device__ __forceinline__ void fa_ldsm(fa_u32 (&r)[4], const FaFrag<COLS>& f, int row, int chunk) {
    if (TRANS) fa_ldsm_x4_t(r, f.at(row, chunk));
    else fa_ldsm_x4(r, f.at(row, chunk));
}

// acc[MT][NT] += A (MT*16 x KSTEPS*16) * B (KSTEPS*16 x NT*8), both operands from swizzled shared memory.
// A_T: fa addresses a tile holding A^T (pattern 2), else A row-major (pattern 1).
// B_T: fb addresses a tile holding B row-major (k x n, pattern 1), else B^T (n x k, pattern 2).
// PIPE: software-pipelined: the next B fragment (and at the end of a k-step the next A fragments) is read from
// shared memory before the current mma's are issued, so ldmatrix latency hides behind tensor-core work.
template <typename T, int MT, int NT, int KSTEPS, bool A_T, bool B_T, int ACOLS, int BCOLS, bool PIPE>
__device__ __forceinline__ void fa_warp_gemm(float (&acc)[MT][NT][4], const FaFrag<ACOLS>& fa,
                                             const FaFrag<BCOLS>& fb) {
    static_assert(NT % 2 == 0, "n-tiles come in pairs");
    constexpr int NP = NT / 2;
    if (!PIPE) {
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            fa_u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                fa_ldsm<ACOLS, A_T>(a[mt], fa, A_T ? kk * 16 : mt * 16, A_T ? mt * 2 : kk * 2);
#pragma unroll
            for (int np = 0; np < NP; ++np) {
                fa_u32 b[4];
                fa_ldsm<BCOLS, B_T>(b, fb, B_T ? kk * 16 : np * 16, B_T ? np * 2 : kk * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    FaType<T>::mma(acc[mt][2 * np], a[mt], b[0], b[1]);
                    FaType<T>::mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
    } else {
        fa_u32 a[2][MT][4], b[2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) fa_ldsm<ACOLS, A_T>(a[0][mt], fa, A_T ? 0 : mt * 16, A_T ? mt * 2 : 0);
        fa_ldsm<BCOLS, B_T>(b[0], fb, 0, 0);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
            for (int np = 0; np < NP; ++np) {
                const int step = kk * NP + np;
                if (np + 1 < NP) {
                    fa_ldsm<BCOLS, B_T>(b[(step + 1) & 1], fb, B_T ? kk * 16 : (np + 1) * 16,
                                        B_T ? (np + 1) * 2 : kk * 2);
                } else if (kk + 1 < KSTEPS) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        fa_ldsm<ACOLS, A_T>(a[(kk + 1) & 1][mt], fa, A_T ? (kk + 1) * 16 : mt * 16,
                                            A_T ? mt * 2 : (kk + 1) * 2);
                    fa_ldsm<BCOLS, B_T>(b[(step + 1) & 1], fb, B_T ? (kk + 1) * 16 : 0, B_T ? 0 : (kk + 1) * 2);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    FaType<T>::mma(acc[mt][2 * np], a[kk & 1][mt], b[step & 1][0], b[step & 1][1]);
                    FaType<T>::mma(acc[mt][2 * np + 1], a[kk & 1][mt], b[step & 1][2], b[step & 1][3]);
                }
            }
    }
}

template <int MT, int NT>
__device__ __forceinline__ void fa_zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

// ------------------------------------------------------------------------------------------ masking
// Whether query `row` attends key `col`, and the additive term (log2 units) of a float mask. Out-of-range keys and,
// when causal, keys after the query (top-left aligned, as torch's is_causal) are dropped. Rows >= Lq read no mask.
template <int MASK>
__device__ __forceinline__ bool fa_keep(int row, int col, int Lq, int Lk, int causal, const void* __restrict__ mask,
                                        fa_i64 moff, fa_i64 m_sq, fa_i64 m_sk, float& add_log2) {
    bool keep = col < Lk && !(causal && col > row);
    add_log2 = 0.f;
    if (MASK != FA_MASK_NONE && keep && row < Lq) {
        const fa_i64 i = moff + (fa_i64)row * m_sq + (fa_i64)col * m_sk;
        if (MASK == FA_MASK_BOOL) keep = static_cast<const unsigned char*>(mask)[i] != 0;
        else add_log2 = static_cast<const float*>(mask)[i] * FA_LOG2E;
    }
    return keep;
}

// The backward's work of one CTA: key block nb (of n_blocks, BN keys each) and the query blocks [m_lo, m_hi) of its
// slice (blockIdx.x = split * n_blocks + nb, m_per_split query blocks of BM rows per slice). Under a causal mask the
// query rows before the key block attend none of its keys.
struct FaBwdWork {
    int nb, n0, m_lo, m_hi, h, b;
    bool piece;  // the tail schedule's piece of a key block (its dK / dV go through the fp32 accumulators)
};
__device__ __forceinline__ FaBwdWork fa_bwd_work(int n_blocks, int m_per_split, int BN, int BM, int Lq, int causal) {
    FaBwdWork w;
    w.nb = blockIdx.x % n_blocks;
    w.n0 = w.nb * BN;
    w.m_lo = (blockIdx.x / n_blocks) * m_per_split;
    w.m_hi = min((Lq + BM - 1) / BM, w.m_lo + m_per_split);
    if (causal) w.m_lo = max(w.m_lo, w.n0 / BM);
    w.h = blockIdx.y, w.b = blockIdx.z, w.piece = false;
    return w;
}

// The tail schedule (a 1-D grid, no causal mask): the key blocks of all heads and batches are units u = (b * H + h) *
// n_blocks + nb; CTAs 0 .. u_whole-1 take units 0 .. u_whole-1 whole (all query blocks), and every later unit is cut
// into pieces of m_per_split query blocks, one CTA each, dispatched last -- so the pieces fill the last, partial wave
// of whole units instead of leaving most SMs idle while a few run one more whole unit.
__device__ __forceinline__ FaBwdWork fa_bwd_work_tail(int n_blocks, int m_per_split, int BN, int BM, int Lq, int H,
                                                      int u_whole) {
    const int m_blocks = (Lq + BM - 1) / BM;
    FaBwdWork w;
    int u = blockIdx.x;
    w.m_lo = 0, w.m_hi = m_blocks, w.piece = u >= u_whole;
    if (w.piece) {
        const int pieces = (m_blocks + m_per_split - 1) / m_per_split, p = u - u_whole;
        u = u_whole + p / pieces;
        w.m_lo = (p % pieces) * m_per_split;
        w.m_hi = min(m_blocks, w.m_lo + m_per_split);
    }
    w.nb = u % n_blocks;
    w.n0 = w.nb * BN;
    const int bh = u / n_blocks;
    w.h = bh % H, w.b = bh / H;
    return w;
}

// fp32 atomic adds of 2 / 4 adjacent floats (8- / 16-byte aligned): one vector red on sm_90, scalar atomics before
__device__ __forceinline__ void fa_red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}
__device__ __forceinline__ void fa_red_add4(float* p, float a, float b, float c, float e) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(e)
                 : "memory");
#else
    fa_red_add2(p, a, b);
    fa_red_add2(p + 2, c, e);
#endif
}
// cp.async of 4 bytes (src_bytes 0: zero-fill)
__device__ __forceinline__ void fa_cp_async4(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// One warp copies a ROWS x (SLABS * 64) tile (rows >= n_rows and columns >= n_cols read as zero) into SLABS swizzled
// 64-column slabs [SLABS][ROWS][64] (the sm_90a kernels' layout); a rolled loop keeps a producer warp within its few
// registers.
template <int ROWS, int SLABS, typename T>
__device__ __forceinline__ void fa_load_slabs(unsigned s, const T* __restrict__ g, fa_i64 ld, int n_rows, int n_cols,
                                              int lane) {
    const int c = (lane & 7) * 8;
#pragma unroll
    for (int sl = 0; sl < SLABS; ++sl) {
        const bool col_ok = c + sl * 64 < n_cols;
        const T* p = g + (lane >> 3) * ld + sl * 64 + c;
#pragma unroll 4
        for (int r = lane >> 3; r < ROWS; r += 4) {
            const bool ok = col_ok && r < n_rows;
            fa_cp_async16(s + sl * ROWS * 128 + 2 * fa_swz<64>(r, c), ok ? (const void*)p : (const void*)g, ok ? 16 : 0);
            p += 4 * ld;
        }
    }
}
