// What the multi-tensor optimizer kernels (adamw.cu, adamw8bit.cu, optim_multi.cu) share: a gradient element read as
// float32 from a buffer of the kind the host passes (flame_core.kernels.tensor_table.GRAD_KIND: 0 fp32, 1 fp16,
// 2 bf16).
#ifndef FLAME_OPTIM_GRADS_CUH
#define FLAME_OPTIM_GRADS_CUH
#include "common.cuh"

__device__ __forceinline__ float load_grad(const void* g, i64 i, int kind) {
    if (kind == 0) return static_cast<const float*>(g)[i];
    if (kind == 1) return __half2float(static_cast<const __half*>(g)[i]);
    return __bfloat162float(static_cast<const __nv_bfloat16*>(g)[i]);
}

// Stochastic rounding of a float32 update to bfloat16 (bfloat16 weights trained without float32 copies): 16 random
// bits added below bfloat16's last place, then truncated -- rounded up with probability equal to the dropped
// fraction, so updates far below the weight's spacing still move it on average. The bits are a hash of (seed: the
// step, salt: the tensor's ordinal, i: the element), the same in flame_nn.optim's NumPy path (sr_bits).
__device__ __forceinline__ unsigned int sr_mix(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

__device__ __forceinline__ unsigned int sr_bits(unsigned int seed, unsigned int salt, i64 i) {
    const unsigned long long u = (unsigned long long)i;
    return sr_mix(sr_mix(seed ^ sr_mix(salt + 0x9e3779b9u)) ^ (unsigned int)u ^ sr_mix((unsigned int)(u >> 32)));
}

__device__ __forceinline__ __nv_bfloat16 sr_bf16(float w, unsigned int r) {
    unsigned int u = __float_as_uint(w);
    if ((u & 0x7f800000u) != 0x7f800000u) u += r & 0xffffu;  // inf / NaN as they are
    __nv_bfloat16_raw raw;
    raw.x = (unsigned short)(u >> 16);
    return __nv_bfloat16(raw);
}
#endif
