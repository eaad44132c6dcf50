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

template <typename T>
__global__ void __launch_bounds__(256)
fp8_gelu_quantize(const T* __restrict__ h, unsigned char* __restrict__ q, float* state, float* __restrict__ scale_out,
                  i64 n, int hist, int update, int approx) {
    __shared__ float smem[32];
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    constexpr int N = 8;   // 16 bytes of bf16 / fp16 in, 8 bytes of e4m3 out
    const i64 nv = aligned16(h) && aligned16(q) ? n / N : 0;
    const float inv = state[1];
    float amax = 0.f;
    for (i64 k = tid; k < nv; k += stride) {
        float v[N];
        load_f32<T, N>(h + k * N, v);
        union { uint2 u; unsigned char b[N]; } o;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float g = gelu_of<T>(v[j], approx);
            amax = fmaxf(amax, fabsf(g));
            o.b[j] = e4m3_sat(g * inv);
        }
        *reinterpret_cast<uint2*>(q + k * N) = o.u;
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
    __shared__ float smem[32];
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    constexpr int N = 8;
    const i64 nv = aligned16(dg) && aligned16(h) && aligned16(q) ? n / N : 0;
    const float inv = state[1];
    float amax = 0.f;
    for (i64 k = tid; k < nv; k += stride) {
        float g[N], v[N];
        load_f32<T, N>(dg + k * N, g);
        load_f32<T, N>(h + k * N, v);
        union { uint2 u; unsigned char b[N]; } o;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float d = gelu_grad_of<T>(g[j], v[j], approx);
            amax = fmaxf(amax, fabsf(d));
            o.b[j] = e4m3_sat(d * inv);
        }
        *reinterpret_cast<uint2*>(q + k * N) = o.u;
    }
    for (i64 i = nv * N + tid; i < n; i += stride) {
        const float d = gelu_grad_of<T>(to_f32(dg[i]), to_f32(h[i]), approx);
        amax = fmaxf(amax, fabsf(d));
        q[i] = e4m3_sat(d * inv);
    }
    fp8_delayed_end(state, scale_out, hist, amax, inv, update, smem);
}

// fp8_cat_gelu_quantize: the e4m3 operand of a Linear over cat(a, gelu(h)) (Flux's single-block linear2 over attention
// | MLP) -- a (rows, ca) contiguous, h (rows, ch) rows ldh apart (a column block of linear1's output, read in place) --
// written into q (rows, ca + ch) with one amax over both parts, without gelu(h) or the concatenation in T: the numbers
// of fp8_quantize_parts_delayed over [a, gelu(h)] (gelu rounded to T first). Chunks of 8 never straddle a row when
// the widths, ldh and the offsets are multiples of 8 (Flux's are); otherwise element by element.
template <typename T, bool GELU>
__device__ __forceinline__ float fp8_rows_cast_amax(const T* __restrict__ x, i64 ldx, i64 rows, i64 c, i64 off, i64 W,
                                                    unsigned char* __restrict__ q, float inv, i64 tid, i64 stride,
                                                    float amax, int approx) {
    constexpr int N = 8;
    const i64 n = rows * c;
    const bool vec = aligned16(x) && c % N == 0 && ldx % N == 0 && off % N == 0 && W % N == 0 &&
                     (reinterpret_cast<unsigned long long>(q) & 7ull) == 0;
    const i64 nv = vec ? n / N : 0;
    for (i64 k = tid; k < nv; k += stride) {
        const i64 e = k * N, r = e / c, col = e - r * c;
        float v[N];
        load_f32<T, N>(x + r * ldx + col, v);
        union { uint2 u2; unsigned char b[N]; } o;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float g = GELU ? gelu_of<T>(v[j], approx) : v[j];
            amax = fmaxf(amax, fabsf(g));
            o.b[j] = e4m3_sat(g * inv);
        }
        *reinterpret_cast<uint2*>(q + r * W + off + col) = o.u2;
    }
    for (i64 i = nv * N + tid; i < n; i += stride) {
        const i64 r = i / c, col = i - r * c;
        const float v = to_f32(x[r * ldx + col]);
        const float g = GELU ? gelu_of<T>(v, approx) : v;
        amax = fmaxf(amax, fabsf(g));
        q[r * W + off + col] = e4m3_sat(g * inv);
    }
    return amax;
}

template <typename T>
__global__ void __launch_bounds__(256)
fp8_cat_gelu_quantize(const T* __restrict__ a, i64 ca, const T* __restrict__ h, i64 ldh, i64 ch, i64 rows,
                      unsigned char* __restrict__ q, float* state, float* __restrict__ scale_out, int hist, int update,
                      int approx) {
    __shared__ float smem[32];
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    const float inv = state[1];
    const i64 W = ca + ch;
    float amax = fp8_rows_cast_amax<T, false>(a, ca, rows, ca, 0, W, q, inv, tid, stride, 0.f, approx);
    amax = fp8_rows_cast_amax<T, true>(h, ldh, rows, ch, ca, W, q, inv, tid, stride, amax, approx);
    fp8_delayed_end(state, scale_out, hist, amax, inv, update, smem);
}
