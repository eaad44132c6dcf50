// The GELU of an MLP fused into the fp8 (e4m3) casts around it, with delayed scaling (fp8_delayed.cuh): an fp8-compute
// MLP fc2(gelu(fc1(x))) (flame_nn/offload/fp8_compute.py, Float8ComputeGeluMlp) never writes gelu(h) or its gradient
// in the compute dtype -- each kernel reads what the composed ops read and writes the e4m3 operand of the next GEMM.
//   fp8_gelu_quantize       q = e4m3(gelu(h) * factor): fc2's input from fc1's output h
//   fp8_gelu_bwd_quantize   q = e4m3(dg * gelu'(h) * factor): fc1's output gradient from fc2's input gradient dg
// Each value is rounded to T before the cast, so the bits are those of the composed ops (activations.cu's GELU kernel
// writing T, then fp8_tensor.cu's fp8_quantize_delayed reading it): the same numbers, one pass instead of two, and the
// amax that goes into the site's history is that of the rounded values. approx: 1 tanh, 0 erf. update, state,
// scale_out, hist: as fp8_quantize_delayed's (update = 0: a recompute's fixed pair, nothing recorded).
#include "activations.cuh"
#include "fp8_delayed.cuh"

template <typename T>
__device__ __forceinline__ float rounded(float v) { return to_f32(from_f32<T>(v)); }

template <typename T>
__device__ __forceinline__ float gelu_of(float h, int approx) {
    return rounded<T>(approx ? gelu_tanh(h) : gelu_erf(h));
}

template <typename T>
__device__ __forceinline__ float gelu_grad_of(float g, float h, int approx) {
    return rounded<T>(g * (approx ? gelu_tanh_grad(h) : gelu_erf_grad(h)));
}

// U vectors of 8 per thread per pass of the grid-stride loop, their loads issued before any is used (a grid of a
// few blocks per SM keeps the amax fold's atomics few; the unrolling keeps enough loads in flight).
template <typename T>
__global__ void __launch_bounds__(256)
fp8_gelu_quantize(const T* __restrict__ h, unsigned char* __restrict__ q, float* state, float* __restrict__ scale_out,
                  i64 n, int hist, int update, int approx) {
    constexpr int U = 4, N = 8;   // 8 elements: 16 bytes of bf16 / fp16 in, 8 bytes of e4m3 out
    __shared__ float smem[32];
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const i64 nv = aligned16(h) && aligned16(q) ? n / N : 0;
    const float inv = state[1];
    float amax = 0.f;
    for (i64 k0 = tid; k0 < nv; k0 += U * stride) {
        float v[U][N];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (k0 + u * stride < nv) load_f32<T, N>(h + (k0 + u * stride) * N, v[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 k = k0 + u * stride;
            if (k >= nv) break;
            union { uint2 u2; unsigned char b[N]; } o;
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const float g = gelu_of<T>(v[u][j], approx);
                amax = fmaxf(amax, fabsf(g));
                o.b[j] = e4m3_sat(g * inv);
            }
            *reinterpret_cast<uint2*>(q + k * N) = o.u2;
        }
    }
    for (i64 i = nv * N + tid; i < n; i += stride) {
        const float g = gelu_of<T>(to_f32(h[i]), approx);
        amax = fmaxf(amax, fabsf(g));
        q[i] = e4m3_sat(g * inv);
    }
    fp8_delayed_end(state, scale_out, hist, amax, inv, update, smem);
}

template <typename T>
__global__ void __launch_bounds__(256)
fp8_gelu_bwd_quantize(const T* __restrict__ dg, const T* __restrict__ h, unsigned char* __restrict__ q, float* state,
                      float* __restrict__ scale_out, i64 n, int hist, int update, int approx) {
    constexpr int U = 2, N = 8;
    __shared__ float smem[32];
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const i64 nv = aligned16(dg) && aligned16(h) && aligned16(q) ? n / N : 0;
    const float inv = state[1];
    float amax = 0.f;
    for (i64 k0 = tid; k0 < nv; k0 += U * stride) {
        float g[U][N], v[U][N];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (k0 + u * stride < nv) {
                load_f32<T, N>(dg + (k0 + u * stride) * N, g[u]);
                load_f32<T, N>(h + (k0 + u * stride) * N, v[u]);
            }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 k = k0 + u * stride;
            if (k >= nv) break;
            union { uint2 u2; unsigned char b[N]; } o;
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const float d = gelu_grad_of<T>(g[u][j], v[u][j], approx);
                amax = fmaxf(amax, fabsf(d));
                o.b[j] = e4m3_sat(d * inv);
            }
            *reinterpret_cast<uint2*>(q + k * N) = o.u2;
        }
    }
    for (i64 i = nv * N + tid; i < n; i += stride) {
        const float d = gelu_grad_of<T>(to_f32(dg[i]), to_f32(h[i]), approx);
        amax = fmaxf(amax, fabsf(d));
        q[i] = e4m3_sat(d * inv);
    }
    fp8_delayed_end(state, scale_out, hist, amax, inv, update, smem);
}
