// GEGLU: the gated GELU of a projection whose rows hold [a | gate] (diffusers' GEGLU, SDXL's feed-forward), in one pass
// each way so that neither GELU(gate) nor the two halves' separate gradients are ever stored:
//   forward:  y[r, c]          = a * gelu(g)                            x (rows, 2 cols), y (rows, cols)
//   backward: dx[r, c]         = dy * gelu(g)                           a = x[r, c], g = x[r, cols + c]
//             dx[r, cols + c]  = dy * a * gelu'(g)                      dx (rows, 2 cols); all contiguous
// approx: bit 0: 0 = erf ("none"), 1 = tanh; bit 1: gate first (rows hold [gate | a]: T5's gelu(wi_0 x) * wi_1 x over
// the stacked [wi_0 | wi_1] projection), the gradients then written in that order too. One block walks whole rows (no index division); 16-byte vectors when cols and
// the pointers allow. The backward may run in place (dx == x: the caller's x is a temporary that dies with this
// backward): each thread reads its pair of x elements before it writes the same two positions, so x and dx are not
// __restrict__ there.
#include "activations.cuh"

__device__ __forceinline__ float gelu_of(float v, int approx) { return approx ? gelu_tanh(v) : gelu_erf(v); }
__device__ __forceinline__ float gelu_grad_of(float v, int approx) {
    return approx ? gelu_tanh_grad(v) : gelu_erf_grad(v);
}

template <typename T, int N, bool BWD>
__device__ __forceinline__ void geglu_body(const T* x, const T* __restrict__ dy, T* out,
                                           i64 rows, int cols, int approx) {
    const int nv = cols / N;
    const int ga = (approx & 2) ? cols : 0, gg = cols - ga;   // the offsets of a and of the gate in a row
    approx &= 1;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xa = x + r * 2 * cols + ga;
        const T* xg = x + r * 2 * cols + gg;
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            const i64 c = (i64)k * N;
            float a[N], g[N], o[N];
            load_f32<T, N>(xa + c, a);
            load_f32<T, N>(xg + c, g);
            if (BWD) {
                float d[N], o2[N];
                load_f32<T, N>(dy + r * cols + c, d);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    o[j] = d[j] * gelu_of(g[j], approx);
                    o2[j] = d[j] * a[j] * gelu_grad_of(g[j], approx);
                }
                store_f32<T, N>(out + r * 2 * cols + ga + c, o);
                store_f32<T, N>(out + r * 2 * cols + gg + c, o2);
            } else {
#pragma unroll
                for (int j = 0; j < N; ++j) o[j] = a[j] * gelu_of(g[j], approx);
                store_f32<T, N>(out + r * cols + c, o);
            }
        }
    }
}

template <typename T, bool BWD>
__device__ __forceinline__ void geglu(const T* x, const T* __restrict__ dy, T* out,
                                      i64 rows, int cols, int approx) {
    constexpr int N = VecT<T>::N;
    const bool vec = cols % N == 0 && aligned16(x) && aligned16(out) && (!BWD || aligned16(dy));
    if (vec)
        geglu_body<T, N, BWD>(x, dy, out, rows, cols, approx);
    else
        geglu_body<T, 1, BWD>(x, dy, out, rows, cols, approx);
}

template <typename T>
__global__ void __launch_bounds__(256) geglu_fwd(const T* __restrict__ x, T* __restrict__ y, i64 rows, int cols,
                                                 int approx) {
    geglu<T, false>(x, nullptr, y, rows, cols, approx);
}

template <typename T>
__global__ void __launch_bounds__(256) geglu_bwd(const T* x, const T* __restrict__ dy, T* dx, i64 rows, int cols,
                                                 int approx) {
    geglu<T, true>(x, dy, dx, rows, cols, approx);
}
