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
#endif
