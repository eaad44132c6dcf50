// GELU (tanh form) of a column block of a wider row-major matrix, written contiguous: Flux's single-stream block
// applies it to the MLP half of linear1's output (rows x (3H + M), the block starts at column 3H), so the half is
// read in place instead of copied out first.
//   forward:  y[r, c]  = gelu(x[r * ldx + c])                   y (rows, cols) contiguous
//   backward: dx[r, c] = dy[r, c] * gelu'(x[r * ldx + c])        dx (rows, cols) contiguous
// One block walks whole rows (no index division); 16-byte vectors when cols, ldx and the pointers allow.
#include "activations.cuh"

template <typename T, int N, bool BWD>
__device__ __forceinline__ void gelu_rows_body(const T* __restrict__ x, i64 ldx, const T* __restrict__ dy,
                                               T* __restrict__ out, i64 rows, int cols) {
    const int nv = cols / N;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * ldx;
        T* orow = out + r * cols;
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float v[N], o[N];
            load_f32<T, N>(xr + (i64)k * N, v);
            if (BWD) {
                float g[N];
                load_f32<T, N>(dy + r * cols + (i64)k * N, g);
#pragma unroll
                for (int j = 0; j < N; ++j) o[j] = g[j] * gelu_tanh_grad(v[j]);
            } else {
#pragma unroll
                for (int j = 0; j < N; ++j) o[j] = gelu_tanh(v[j]);
            }
            store_f32<T, N>(orow + (i64)k * N, o);
        }
    }
}

template <typename T, bool BWD>
__device__ __forceinline__ void gelu_rows(const T* __restrict__ x, i64 ldx, const T* __restrict__ dy,
                                          T* __restrict__ out, i64 rows, int cols) {
    constexpr int N = VecT<T>::N;
    const bool vec = cols % N == 0 && ldx % N == 0 && aligned16(x) && aligned16(out) && (!BWD || aligned16(dy));
    if (vec)
        gelu_rows_body<T, N, BWD>(x, ldx, dy, out, rows, cols);
    else
        gelu_rows_body<T, 1, BWD>(x, ldx, dy, out, rows, cols);
}

template <typename T>
__global__ void __launch_bounds__(256) gelu_rows_fwd(const T* __restrict__ x, i64 ldx, T* __restrict__ y, i64 rows,
                                                     int cols) {
    gelu_rows<T, false>(x, ldx, nullptr, y, rows, cols);
}

template <typename T>
__global__ void __launch_bounds__(256) gelu_rows_bwd(const T* __restrict__ x, i64 ldx, const T* __restrict__ dy,
                                                     T* __restrict__ dx, i64 rows, int cols) {
    gelu_rows<T, true>(x, ldx, dy, dx, rows, cols);
}
