// Fused multi-tensor AdamW (decoupled weight decay, PyTorch's update rule) in one launch over many tensors whose
// gradients (and Adam moments, and optional fp32 master weights) live in flat buffers at known offsets.
// A host-built chunk table maps each block to (tensor, start): chunk_tensor[c], chunk_start[c]; per tensor: the
// parameter's address ptrs[t] (storage type P), its numel sizes[t] and its offset offsets[t] in the flat buffers.
//   w   = master ? master[o] : param[i]         (fp32 math)
//   w  *= 1 - lr * wd
//   m   = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2          (g = grad * grad_scale)
//   w  -= (lr / bc1) * m / (sqrt(v) / sqrt_bc2 + eps)
//   master[o] = w (if any); param[i] = P(w)
// grad_kind: 0 fp32, 1 fp16, 2 bf16 gradients.
#include "optim_grads.cuh"

#define ADAMW_ILP 4

template <typename P>
__global__ void __launch_bounds__(256) adamw_multi(
        const i64* __restrict__ ptrs, const i64* __restrict__ sizes, const i64* __restrict__ offsets,
        const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start, int chunk_elems,
        const void* __restrict__ grad, int grad_kind, float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
        float* __restrict__ master, float lr, float beta1, float beta2, float eps, float weight_decay, float bc1,
        float sqrt_bc2, float grad_scale) {
    const int t = chunk_tensor[blockIdx.x];
    const i64 start = chunk_start[blockIdx.x];
    const i64 size = sizes[t];
    const i64 n = size - start < chunk_elems ? size - start : chunk_elems;
    P* __restrict__ p = reinterpret_cast<P*>(ptrs[t]) + start;
    const i64 o = offsets[t] + start;
    const float decay = 1.f - lr * weight_decay, step = lr / bc1;
    for (i64 base = 0; base < n; base += (i64)blockDim.x * ADAMW_ILP) {
        float g[ADAMW_ILP], m[ADAMW_ILP], v[ADAMW_ILP], w[ADAMW_ILP];
#pragma unroll
        for (int u = 0; u < ADAMW_ILP; ++u) {  // issue every load before any math
            const i64 i = base + u * blockDim.x + threadIdx.x;
            if (i < n) {
                g[u] = load_grad(grad, o + i, grad_kind);
                m[u] = exp_avg[o + i];
                v[u] = exp_avg_sq[o + i];
                w[u] = master ? master[o + i] : to_f32(p[i]);
            }
        }
#pragma unroll
        for (int u = 0; u < ADAMW_ILP; ++u) {
            const i64 i = base + u * blockDim.x + threadIdx.x;
            if (i < n) {
                const float gs = g[u] * grad_scale;
                const float mn = beta1 * m[u] + (1.f - beta1) * gs;
                const float vn = beta2 * v[u] + (1.f - beta2) * gs * gs;
                float wn = w[u] * decay;
                wn -= step * mn / (sqrtf(vn) / sqrt_bc2 + eps);
                exp_avg[o + i] = mn;
                exp_avg_sq[o + i] = vn;
                if (master) master[o + i] = wn;
                p[i] = from_f32<P>(wn);
            }
        }
    }
}
