// Fused multi-tensor AdamW8bit step (flame_nn.optim.AdamW8bit's update, in one launch over many tensors): each block
// of 256 threads owns one 256-element quantisation block of one tensor. Per element: the moments are read (8-bit
// codes times their block's absmax through the 256-entry code books, or fp32 for tensors kept unquantised), updated
// as AdamW, the weight updated; then the block's new absmax is reduced and every moment is written back as the index
// of its nearest code (NumPy's searchsorted-left, then the nearer of the two neighbours, ties to the lower one).
// Every product, sum, quotient and root is rounded on its own (__f*_rn: no FMA contraction), so the result equals
// the per-operation NumPy path of AdamW8bit bit for bit on normal floats.
//
// tensors: int64 [T, 8] rows (flame_core.kernels.tensor_table): param (float*, or bf16*), grad, exp_avg, exp_avg_sq
//          (uint8 codes, or float* when unquantised), exp_avg_absmax, exp_avg_sq_absmax (float*, one per 256
//          elements; 0 when unquantised), numel, and packed kinds: bits 0-3 the gradient's dtype (0 fp32 / 1 fp16 /
//          2 bf16), bits 4-7 the parameter's (0 fp32 / 2 bf16: the new weight stochastically rounded with
//          sr_bits(seed, salt, i)), bits 8+ the tensor's salt
// chunk_tensor / chunk_start: the tensor and the first element (a multiple of 256) of each CUDA block
#include "optim_grads.cuh"

#define Q8_BLOCK 256

// NumPy's nearest code: hi = first index with book[hi] >= u (clipped to 255), lo = hi - 1 (clipped to 0); lo when
// |u - book[lo]| <= |book[hi] - u|, else hi
__device__ __forceinline__ unsigned char q8_nearest(const float* book, float u) {
    int lo = 0, hi = Q8_BLOCK;  // lower_bound over [0, 256)
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (book[mid] < u) lo = mid + 1; else hi = mid;
    }
    hi = min(lo, Q8_BLOCK - 1);
    lo = max(hi - 1, 0);
    return (unsigned char)(fabsf(__fsub_rn(u, book[lo])) <= fabsf(__fsub_rn(book[hi], u)) ? lo : hi);
}

__device__ __forceinline__ float q8_block_max(float x, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // `red` may still be read by the previous reduction
    if ((threadIdx.x & 31) == 0) red[warp] = x;
    __syncthreads();
    float r = red[0];
#pragma unroll
    for (int w = 1; w < Q8_BLOCK / 32; ++w) r = fmaxf(r, red[w]);
    return r;
}

extern "C" __global__ void __launch_bounds__(Q8_BLOCK) adamw8bit_multi(
        const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start,
        const float* __restrict__ signed_book, const float* __restrict__ unsigned_book, float lr_bc1, float beta1,
        float one_minus_beta1, float beta2, float one_minus_beta2, float eps, float sqrt_bc2, float decay,
        int apply_decay, unsigned int seed) {
    __shared__ float sbook[Q8_BLOCK], ubook[Q8_BLOCK], red[Q8_BLOCK / 32];
    const int tid = threadIdx.x;
    sbook[tid] = signed_book[tid];
    ubook[tid] = unsigned_book[tid];
    const i64* row = tensors + 8 * (i64)chunk_tensor[blockIdx.x];
    float* __restrict__ w = reinterpret_cast<float*>(row[0]);
    __nv_bfloat16* __restrict__ wb = reinterpret_cast<__nv_bfloat16*>(row[0]);
    const void* g = reinterpret_cast<const void*>(row[1]);
    const i64 n = row[6];
    const int kind = (int)(row[7] & 15), pkind = (int)((row[7] >> 4) & 15);
    const unsigned int salt = (unsigned int)(row[7] >> 8);
    const bool quantised = row[4] != 0;
    const i64 blk = chunk_start[blockIdx.x] / Q8_BLOCK;
    const i64 i = blk * Q8_BLOCK + tid;
    const bool in = i < n;
    __syncthreads();
    float m = 0.f, v = 0.f;
    if (in) {
        if (quantised) {
            const float ma = reinterpret_cast<const float*>(row[4])[blk];
            const float va = reinterpret_cast<const float*>(row[5])[blk];
            m = __fmul_rn(sbook[reinterpret_cast<const unsigned char*>(row[2])[i]], ma);
            v = __fmul_rn(ubook[reinterpret_cast<const unsigned char*>(row[3])[i]], va);
        } else {
            m = reinterpret_cast<const float*>(row[2])[i];
            v = reinterpret_cast<const float*>(row[3])[i];
        }
        const float gf = load_grad(g, i, kind);
        m = __fadd_rn(__fmul_rn(m, beta1), __fmul_rn(one_minus_beta1, gf));
        v = __fadd_rn(__fmul_rn(v, beta2), __fmul_rn(one_minus_beta2, __fmul_rn(gf, gf)));
        float wi = pkind == 2 ? __bfloat162float(wb[i]) : w[i];
        if (apply_decay) wi = __fmul_rn(wi, decay);
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), sqrt_bc2), eps);
        const float wn = __fsub_rn(wi, __fdiv_rn(__fmul_rn(lr_bc1, m), denom));
        if (pkind == 2) wb[i] = sr_bf16(wn, sr_bits(seed, salt, i));
        else w[i] = wn;
    }
    if (!quantised) {
        if (in) {
            reinterpret_cast<float*>(row[2])[i] = m;
            reinterpret_cast<float*>(row[3])[i] = v;
        }
        return;  // uniform across the block: every thread of it takes this branch
    }
    const float ma = q8_block_max(fabsf(m), red), va = q8_block_max(fabsf(v), red);
    if (tid == 0) {
        reinterpret_cast<float*>(row[4])[blk] = ma;
        reinterpret_cast<float*>(row[5])[blk] = va;
    }
    if (in) {
        reinterpret_cast<unsigned char*>(row[2])[i] = q8_nearest(sbook, __fdiv_rn(m, ma > 0.f ? ma : 1.f));
        reinterpret_cast<unsigned char*>(row[3])[i] = q8_nearest(ubook, __fdiv_rn(v, va > 0.f ? va : 1.f));
    }
}
