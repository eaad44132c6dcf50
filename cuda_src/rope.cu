// Rotary position embedding in the Flux layout: x (B, H, L, D) and per-position 2x2 rotations
// freqs (Bf, L, D/2, 2, 2) fp32 (Bf = 1 or B; the head axis broadcasts), pairs of ADJACENT elements:
//   out[2j]   = f[j,0,0] x[2j] + f[j,0,1] x[2j+1]
//   out[2j+1] = f[j,1,0] x[2j] + f[j,1,1] x[2j+1]
// in fp32, cast back. The backward applies the transposed matrices (transpose = 1).
#include "rope_pairs.cuh"

template <typename T, int N>
__device__ __forceinline__ void rope_body(const T* __restrict__ x, const float* __restrict__ f, T* __restrict__ out,
                                          i64 total, int hl, int l, int d, int f_batch, int transpose) {
    const i64 nv = total / N;  // N is even and divides d: a vector never straddles a row
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < nv; k += (i64)gridDim.x * blockDim.x) {
        const i64 e = k * N;
        const i64 rowid = e / d;            // (b, h, l) flattened
        const int col = (int)(e - rowid * d);
        const int pos = (int)(rowid % l);
        const i64 b = rowid / hl;
        const float* fr = f + (((f_batch ? b : 0) * l + pos) * (i64)(d / 2) + col / 2) * 4;
        float v[N], o[N];
        load_f32<T, N>(x + e, v);
        rope_pairs<N>(fr, v, o, transpose);
        store_f32<T, N>(out + e, o);
    }
}

// hl = H * L, f_batch = 1 when freqs has a batch axis of size B.
template <typename T>
__global__ void rope_apply(const T* __restrict__ x, const float* __restrict__ f, T* __restrict__ out, i64 total,
                           int hl, int l, int d, int f_batch, int transpose) {
    constexpr int N = VecT<T>::N;
    if (d % N == 0 && aligned16(x) && aligned16(out))  // f: the host passes it 16-byte aligned
        rope_body<T, N>(x, f, out, total, hl, l, d, f_batch, transpose);
    else
        rope_body<T, 2>(x, f, out, total, hl, l, d, f_batch, transpose);
}
