// Counter-based random numbers (Philox-4x32-10). State is just (seed, offset): exact save/restore and replay
// (gradient checkpointing, resume) without touching device-side generator state.
#include "common.cuh"
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

struct u4 { unsigned int x, y, z, w; };

__device__ __forceinline__ u4 philox(unsigned long long seed, unsigned long long counter) {
    unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
    u4 c = {(unsigned int)counter, (unsigned int)(counter >> 32), 0u, 0u};
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        unsigned int hi0 = __umulhi(PHILOX_M0, c.x), lo0 = PHILOX_M0 * c.x;
        unsigned int hi1 = __umulhi(PHILOX_M1, c.z), lo1 = PHILOX_M1 * c.z;
        u4 n = {hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
        c = n;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    return c;
}

__device__ __forceinline__ float to_unit(unsigned int v) {  // [0, 1)
    return (v >> 8) * (1.0f / 16777216.0f);
}

// out[i] for i in [0, n): uniform [0,1) (mode 0) or standard normal (mode 1), float or double.
template <typename T>
__device__ __forceinline__ void fill4(T* out, long long n, long long base, u4 r, int mode) {
    float v[4];
    if (mode == 0) {
        v[0] = to_unit(r.x); v[1] = to_unit(r.y); v[2] = to_unit(r.z); v[3] = to_unit(r.w);
    } else {
        float u1 = to_unit(r.x) + 5.9604645e-08f, u2 = to_unit(r.y);  // u1 in (0, 1]
        float u3 = to_unit(r.z) + 5.9604645e-08f, u4_ = to_unit(r.w);
        float s1 = sqrtf(-2.0f * logf(u1)), s2 = sqrtf(-2.0f * logf(u3));
        float a, b, c, d;
        sincospif(2.0f * u2, &b, &a);
        sincospif(2.0f * u4_, &d, &c);
        v[0] = s1 * a; v[1] = s1 * b; v[2] = s2 * c; v[3] = s2 * d;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (base + j < n) out[base + j] = (T)v[j];
}

extern "C" __global__ void philox_fill_f32(float* out, long long n, unsigned long long seed,
                                           unsigned long long offset, int mode) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long base = i * 4;
    if (base >= n) return;
    fill4<float>(out, n, base, philox(seed, offset / 4 + i), mode);
}

extern "C" __global__ void philox_fill_f64(double* out, long long n, unsigned long long seed,
                                           unsigned long long offset, int mode) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long base = i * 4;
    if (base >= n) return;
    fill4<double>(out, n, base, philox(seed, offset / 4 + i), mode);
}

// integers in [low, low + range): multiply-shift (range < 2^32)
extern "C" __global__ void philox_integers(long long* out, long long n, unsigned long long seed,
                                           unsigned long long offset, long long low, unsigned long long range) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long base = i * 4;
    if (base >= n) return;
    u4 r = philox(seed, offset / 4 + i);
    unsigned int v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (base + j < n) out[base + j] = low + (long long)(((unsigned long long)v[j] * range) >> 32);
}

// dropout with its draw fused in (flame_core/kernels/dropout.py): the uniforms of philox_fill_f32 at the same
// (seed, offset) -- thread i's counter covers elements 4i .. 4i+3 --, an element kept where u >= p (p in float32, as
// the comparison of a float32 draw with a Python float), mask = T(scale) or 0 and y = T(x * mask) in fp32: the values
// of `rand(...) >= p`, `.to(T) * scale` and `x * mask` done one by one, in one pass. The mask is the backward's factor.
template <typename T>
__global__ void philox_dropout(const T* __restrict__ x, T* __restrict__ y, T* __restrict__ mask,
                               unsigned long long seed, unsigned long long offset, long long n, float p, float scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long base = i * 4;
    if (base >= n) return;
    u4 r = philox(seed, offset / 4 + i);
    unsigned int v[4] = {r.x, r.y, r.z, r.w};
    const T keep = from_f32<T>(scale), drop = from_f32<T>(0.0f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (base + j < n) {
            T m = to_unit(v[j]) >= p ? keep : drop;
            mask[base + j] = m;
            y[base + j] = from_f32<T>(to_f32(x[base + j]) * to_f32(m));
        }
    }
}
