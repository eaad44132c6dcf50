// Per-tensor fp8 (e4m3, max 448) quantisation for the fp8 GEMM, with "current" scaling (the amax of this call), in
// ONE launch, and the weight's byte transpose:
//   fp8_quantize_tensor  pass 1: amax(|x|) over the whole tensor (a block reduction, then atomicMax on the float bits,
//                        which orders non-negative floats); a grid-wide barrier; pass 2: q = e4m3(x * 448 / amax),
//                        round-to-nearest-even, saturating to +-448 (as fp8_quantize_rows). Block 0 writes
//                        scale[0] = amax / 448 (1 when amax is 0 or not finite) -- the dequantisation factor cuBLASLt
//                        reads through its A/B scale pointer -- and scale[1] = 448 / amax, the factor the cast used.
//                        Why one launch: the two-kernel version (amax, then cast) also needed its counters zeroed per
//                        call (a memset): three launches and two full reads of x per GEMM operand. Pass 2 walks x
//                        backwards, so it starts on the lines pass 1 left in L2 last (an activation up to ~40 MB is
//                        read from HBM once). No host synchronisation: a CUDA graph captures it.
//   fp8_quantize_parts   the same over the column concatenation of up to 4 (rows, c_p) parts, without forming it.
//   fp8_quantize_delayed delayed scaling: the cast with the factor of the site's earlier calls, one pass, no
//                        barrier; this call's amax goes into the site's history for the next call.
//   fp8_quantize_parts_delayed   the same over up to 4 column parts, without forming their concatenation.
//   fp8_transpose        (rows, cols) bytes -> (cols, rows): the weight's K-major copy for the input gradient
//                        (Hopper's fp8 tensor cores take both operands K-major only). fp8_transpose_64: the same
//                        for rows and cols multiples of 64 (every weight of the families), 16-byte loads and stores.
//
// The barrier's counters live in module memory (g_fp8_state: zero at load, every launch leaves them zero again), so
// nothing is allocated or zeroed per call. Its conditions: all blocks resident at once (the host caps the grid at 4
// blocks of 256 threads per SM, __launch_bounds__ keeps the registers under that occupancy's share) and one launch at a
// time per device (FLAME quantises on the compute stream only).
#include "fp8_delayed.cuh"

// {amax bits, blocks arrived, barrier generation, blocks done}
__device__ unsigned int g_fp8_state[4];

// The grid-wide barrier of one quantisation: every block's amax in (thread 0's counts), the cast factor 448 / amax of
// the whole grid out (to every thread of the block). The last block to arrive publishes scale[] and opens the next
// generation.
__device__ __forceinline__ float fp8_grid_inv(float amax, float* __restrict__ scale, float* s_inv) {
    unsigned int* state = g_fp8_state;
    if (threadIdx.x == 0) {
        volatile unsigned int* gen = state + 2;
        const unsigned int g = *gen;
        atomicMax(state, __float_as_uint(amax));
        __threadfence();  // the max is visible before this block counts as arrived
        if (atomicAdd(state + 1, 1u) == gridDim.x - 1) {
            atomicExch(state + 1, 0u);
            const float a = __uint_as_float(atomicAdd(state, 0u));  // an atomic read: past the other blocks' fences
            scale[0] = finite_positive(a) ? a / FP8_MAX : 1.f;
            scale[1] = finite_positive(a) ? FP8_MAX / a : 1.f;
            __threadfence();
            atomicAdd(state + 2, 1u);
        } else {
            while (*gen == g) __nanosleep(64);
            __threadfence();
        }
        const float a = __uint_as_float(atomicAdd(state, 0u));
        *s_inv = finite_positive(a) ? FP8_MAX / a : 1.f;  // the same fp32 division as scale[1]: the same bits
    }
    __syncthreads();
    return *s_inv;
}

// Every block has read the amax once all have counted here: the last one leaves the state zero for the next call.
__device__ __forceinline__ void fp8_grid_done() {
    unsigned int* state = g_fp8_state;
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(state + 3, 1u) == gridDim.x - 1) {
            atomicExch(state, 0u);
            atomicExch(state + 3, 0u);
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(256, 4)
fp8_quantize_tensor(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scale, i64 n) {
    __shared__ float smem[32];
    __shared__ float s_inv;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const bool vec = aligned16(x) && aligned16(q);
    constexpr int N = 8;   // 8 elements: 16 bytes of bf16 / fp16 in, 8 bytes of e4m3 out (fp32: two 16-byte loads)
    const i64 nv = vec ? n / N : 0;
    float amax = 0.f;
    for (i64 k = tid; k < nv; k += stride) {
        float v[N];
        load_f32<T, N>(x + k * N, v);
#pragma unroll
        for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
    for (i64 i = nv * N + tid; i < n; i += stride) amax = fmaxf(amax, fabsf(to_f32(x[i])));
    amax = block_max(amax, smem);
    const float inv = fp8_grid_inv(amax, scale, &s_inv);
    for (i64 k = nv - 1 - tid; k >= 0; k -= stride) {   // backwards: L2 still holds the end of pass 1
        float v[N];
        load_f32<T, N>(x + k * N, v);
        union { uint2 u; unsigned char b[N]; } o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.b[j] = e4m3_sat(v[j] * inv);
        *reinterpret_cast<uint2*>(q + k * N) = o.u;
    }
    for (i64 i = nv * N + tid; i < n; i += stride) q[i] = e4m3_sat(to_f32(x[i]) * inv);
    fp8_grid_done();
}

// 8 elements (a 16-byte load of bf16 / fp16, two of fp32) cast with `inv` into 8 bytes at dst; their amax folded in.
template <typename T>
__device__ __forceinline__ float fp8_cast8_amax(const T* __restrict__ src, unsigned char* __restrict__ dst, float inv,
                                                float amax) {
    constexpr int N = 8;
    float v[N];
    load_f32<T, N>(src, v);
    union { uint2 u; unsigned char b[N]; } o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        amax = fmaxf(amax, fabsf(v[j]));
        o.b[j] = e4m3_sat(v[j] * inv);
    }
    *reinterpret_cast<uint2*>(dst) = o.u;
    return amax;
}

template <typename T>
__device__ __forceinline__ float fp8_cast1_amax(T x, unsigned char* __restrict__ dst, float inv, float amax) {
    const float v = to_f32(x);
    *dst = e4m3_sat(v * inv);
    return fmaxf(amax, fabsf(v));
}

// fp8_quantize_delayed: "delayed" scaling -- q = e4m3(x * state[1]) with the factor earlier calls of the same site
// left in `state`, in ONE pass and without a grid barrier (current scaling needs the amax before the cast). The
// call's amax is folded into the site's history and sets the factor of the NEXT call. state: float[3 + H] =
// {dequantisation scale, cast factor, this call's amax bits (0 between calls), history of amaxes, newest first}.
// scale_out = {state[0], state[1]} as this call used them (what the GEMM reads: the state changes under it). The
// last block to finish (g_fp8_delayed counts them) shifts the history, records the amax (NaN values are passed over
// by fmaxf; an inf records 0: a broken step leaves no range behind), and sets state[0] = m / 448, state[1] = 448 / m from the history's max m
// (1, 1 when m is 0). Values beyond the history's range saturate to +-448. Block 0 writes scale_out before counting
// itself in, and every block reads the factor before it counts: the last block's update comes after both.
// update = 0: state is just {scale, factor} (a recompute's fixed pair): cast, scale_out = that pair, nothing else.
template <typename T>
__global__ void __launch_bounds__(256)
fp8_quantize_delayed(const T* __restrict__ x, unsigned char* __restrict__ q, float* state,
                     float* __restrict__ scale_out, i64 n, int hist, int update) {
    __shared__ float smem[32];
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const bool vec = aligned16(x) && aligned16(q);
    constexpr int N = 8;
    const i64 nv = vec ? n / N : 0;
    const float inv = state[1];
    float amax = 0.f;
    for (i64 k = tid; k < nv; k += stride) amax = fp8_cast8_amax<T>(x + k * N, q + k * N, inv, amax);
    for (i64 i = nv * N + tid; i < n; i += stride) amax = fp8_cast1_amax<T>(x[i], q + i, inv, amax);
    fp8_delayed_end(state, scale_out, hist, amax, inv, update, smem);
}

// fp8_quantize_parts: fp8_quantize_tensor of the column concatenation of up to 4 parts x_p (rows, c_p), each
// C-contiguous, written into q (rows, W = c_0 + ... + c_3) at column offsets 0, c_0, c_0 + c_1, ... (c_p = 0: no
// part; its pointer is not read) without forming the concatenation: one amax over all the parts, one launch. For
// a fused projection's output gradient, whose parts (q | k | v | mlp) come back as separate tensors. The same fp32
// numbers as fp8_quantize_tensor of the concatenation: the same bits.
template <typename T>
__device__ __forceinline__ float fp8_part_amax(const T* __restrict__ x, i64 n, i64 tid, i64 stride, float amax) {
    constexpr int N = 8;
    const i64 nv = aligned16(x) ? n / N : 0;
    for (i64 k = tid; k < nv; k += stride) {
        float v[N];
        load_f32<T, N>(x + k * N, v);
#pragma unroll
        for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
    for (i64 i = nv * N + tid; i < n; i += stride) amax = fmaxf(amax, fabsf(to_f32(x[i])));
    return amax;
}

template <typename T>
__device__ __forceinline__ void fp8_part_cast(const T* __restrict__ x, i64 rows, i64 c, i64 off, i64 W,
                                              unsigned char* __restrict__ q, float inv, i64 tid, i64 stride) {
    constexpr int N = 8;   // a chunk of 8 never straddles a row when c % 8 == 0; its 8 bytes land 8-aligned
    const i64 n = rows * c;
    const bool vec = aligned16(x) && c % N == 0 && off % N == 0 && W % N == 0 &&
                     (reinterpret_cast<unsigned long long>(q) & 7ull) == 0;
    const i64 nv = vec ? n / N : 0;
    for (i64 k = nv - 1 - tid; k >= 0; k -= stride) {   // backwards: L2 still holds the end of pass 1
        const i64 e = k * N, r = e / c, col = e - r * c;
        float v[N];
        load_f32<T, N>(x + e, v);
        union { uint2 u; unsigned char b[N]; } o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.b[j] = e4m3_sat(v[j] * inv);
        *reinterpret_cast<uint2*>(q + r * W + off + col) = o.u;
    }
    for (i64 i = nv * N + tid; i < n; i += stride) {
        const i64 r = i / c, col = i - r * c;
        q[r * W + off + col] = e4m3_sat(to_f32(x[i]) * inv);
    }
}

template <typename T>
__global__ void __launch_bounds__(256, 4)
fp8_quantize_parts(const T* __restrict__ x0, const T* __restrict__ x1, const T* __restrict__ x2,
                   const T* __restrict__ x3, i64 c0, i64 c1, i64 c2, i64 c3, i64 rows,
                   unsigned char* __restrict__ q, float* __restrict__ scale) {
    __shared__ float smem[32];
    __shared__ float s_inv;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const T* xs[4] = {x0, x1, x2, x3};
    const i64 cs[4] = {c0, c1, c2, c3};
    const i64 W = c0 + c1 + c2 + c3;
    float amax = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p)
        if (cs[p] > 0) amax = fp8_part_amax<T>(xs[p], rows * cs[p], tid, stride, amax);
    amax = block_max(amax, smem);
    const float inv = fp8_grid_inv(amax, scale, &s_inv);
    i64 off = W;
#pragma unroll
    for (int p = 3; p >= 0; --p) {   // the parts in reverse: the last one read in pass 1 first
        off -= cs[p];
        if (cs[p] > 0) fp8_part_cast<T>(xs[p], rows, cs[p], off, W, q, inv, tid, stride);
    }
    fp8_grid_done();
}

// fp8_quantize_parts_delayed: fp8_quantize_delayed of the column concatenation of up to 4 parts (as
// fp8_quantize_parts lays them out): one pass over the parts, the cast with the site's factor, their amax into its
// history (update = 0: a fixed pair, as fp8_quantize_delayed's). The same numbers as fp8_quantize_delayed of the
// concatenation.
template <typename T>
__device__ __forceinline__ float fp8_part_cast_amax(const T* __restrict__ x, i64 rows, i64 c, i64 off, i64 W,
                                                    unsigned char* __restrict__ q, float inv, i64 tid, i64 stride,
                                                    float amax) {
    constexpr int N = 8;
    const i64 n = rows * c;
    const bool vec = aligned16(x) && c % N == 0 && off % N == 0 && W % N == 0 &&
                     (reinterpret_cast<unsigned long long>(q) & 7ull) == 0;
    const i64 nv = vec ? n / N : 0;
    for (i64 k = tid; k < nv; k += stride) {
        const i64 e = k * N, r = e / c;
        amax = fp8_cast8_amax<T>(x + e, q + r * W + off + (e - r * c), inv, amax);
    }
    for (i64 i = nv * N + tid; i < n; i += stride) {
        const i64 r = i / c;
        amax = fp8_cast1_amax<T>(x[i], q + r * W + off + (i - r * c), inv, amax);
    }
    return amax;
}

template <typename T>
__global__ void __launch_bounds__(256)
fp8_quantize_parts_delayed(const T* __restrict__ x0, const T* __restrict__ x1, const T* __restrict__ x2,
                           const T* __restrict__ x3, i64 c0, i64 c1, i64 c2, i64 c3, i64 rows,
                           unsigned char* __restrict__ q, float* state, float* __restrict__ scale_out, int hist,
                           int update) {
    __shared__ float smem[32];
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const T* xs[4] = {x0, x1, x2, x3};
    const i64 cs[4] = {c0, c1, c2, c3};
    const i64 W = c0 + c1 + c2 + c3;
    const float inv = state[1];
    float amax = 0.f;
    i64 off = 0;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        if (cs[p] > 0) amax = fp8_part_cast_amax<T>(xs[p], rows, cs[p], off, W, q, inv, tid, stride, amax);
        off += cs[p];
    }
    fp8_delayed_end(state, scale_out, hist, amax, inv, update, smem);
}

// 32x32 byte tiles through shared memory (a padded row avoids bank conflicts on the transposed read); block (32, 8).
extern "C" __global__ void fp8_transpose(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                         i64 rows, i64 cols) {
    __shared__ unsigned char tile[32][33];
    const i64 c0 = (i64)blockIdx.x * 32, r0 = (i64)blockIdx.y * 32;
    for (int k = threadIdx.y; k < 32; k += 8) {
        const i64 r = r0 + k, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[k][threadIdx.x] = src[r * cols + c];
    }
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += 8) {
        const i64 c = c0 + k, r = r0 + threadIdx.x;  // dst row c, column r
        if (c < cols && r < rows) dst[c * rows + r] = tile[threadIdx.x][k];
    }
}

// 64x64 byte tiles, block 256: each thread loads 16 bytes of a source row into shared memory (as 16 words per row,
// one pad word), then gathers 16 source rows' bytes of one column -- 16 words, 4 bytes picked by __byte_perm per 4
// rows -- and stores them as 16 bytes of a destination row. rows and cols multiples of 64, both pointers 16-byte
// aligned (the host checks).
extern "C" __global__ void __launch_bounds__(256) fp8_transpose_64(const unsigned char* __restrict__ src,
                                                                   unsigned char* __restrict__ dst, i64 rows, i64 cols) {
    __shared__ unsigned int tile[64][17];
    const i64 c0 = (i64)blockIdx.x * 64, r0 = (i64)blockIdx.y * 64;
    const int t = threadIdx.x;
    {
        const int r = t >> 2, ch = t & 3;
        const uint4 v = *reinterpret_cast<const uint4*>(src + (r0 + r) * cols + c0 + ch * 16);
        tile[r][ch * 4 + 0] = v.x;
        tile[r][ch * 4 + 1] = v.y;
        tile[r][ch * 4 + 2] = v.z;
        tile[r][ch * 4 + 3] = v.w;
    }
    __syncthreads();
    const int c = t >> 2, rq = (t & 3) * 16;  // destination row c (source column), its bytes rq .. rq + 15
    const int w = c >> 2;
    const unsigned sel = (unsigned)(c & 3) | ((unsigned)(4 + (c & 3)) << 4);  // byte c%4 of a, then of b
    unsigned out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int rr = rq + 4 * k;
        const unsigned lo = __byte_perm(tile[rr][w], tile[rr + 1][w], sel);
        const unsigned hi = __byte_perm(tile[rr + 2][w], tile[rr + 3][w], sel);
        out[k] = __byte_perm(lo, hi, 0x5410);
    }
    *reinterpret_cast<uint4*>(dst + (c0 + c) * rows + r0 + rq) = make_uint4(out[0], out[1], out[2], out[3]);
}
