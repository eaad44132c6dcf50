// im2col / col2im for conv2d as GEMM (flame_core/ops/conv/columns.py), NCHW, templated on float/__half/__nv_bfloat16/double.
//
// A chunk of the convolution covers `nimg` whole images starting at image n0 (x points at it), or one band of
// `nrows` output rows starting at row oh0 of one image. Its column matrix is cols[r, p] with
//   r = (c * KH + kh) * KW + kw                  (C*KH*KW rows)
//   p = (n_local * nrows + oh_local) * OW + ow   (P = nimg * nrows * OW columns)
// so that  out(O, P) = W(O, C*KH*KW) @ cols  is the chunk's output and  dcols = W^T @ dY  its input gradient.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }

#define IM2COL_ROWS 8  // column-matrix rows per block: the (n, oh, ow) of a thread is decoded once for all of them

// grid: (ceil(P / blockDim.x), ceil(CK / IM2COL_ROWS)); one thread per column p, IM2COL_ROWS rows each.
template <typename T>
__global__ void im2col_kernel(const T* __restrict__ x, T* __restrict__ cols,
                              int C, int H, int W, int KH, int KW,
                              int sh, int sw, int ph, int pw, int dh, int dw,
                              int OW, int nrows, int oh0, long long P, long long img_stride)
{
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P) return;
    const int ow = (int)(p % OW);
    const long long q = p / OW;
    const int oh = oh0 + (int)(q % nrows);
    const int nl = (int)(q / nrows);
    const int h_base = oh * sh - ph;
    const int w_base = ow * sw - pw;
    const T* xn = x + nl * img_stride;
    const int CK = C * KH * KW;
    int r = blockIdx.y * IM2COL_ROWS;
    const int r_end = min(r + IM2COL_ROWS, CK);
    int kw = r % KW;
    int kh = (r / KW) % KH;
    int c = r / (KW * KH);
    const T zero = from_acc<T>(0);
    for (; r < r_end; ++r) {
        const int h = h_base + kh * dh;
        const int w = w_base + kw * dw;
        T v = zero;
        if (h >= 0 && h < H && w >= 0 && w < W)
            v = xn[((long long)c * H + h) * W + w];
        cols[(long long)r * P + p] = v;
        if (++kw == KW) {
            kw = 0;
            if (++kh == KH) { kh = 0; ++c; }
        }
    }
}

// Gather form of col2im (no atomics, deterministic): one thread per input element of the chunk's input rows
// [h_lo, h_lo + nh) sums every column entry that read it. accumulate != 0 adds to dx (bands share halo rows).
template <typename T>
__global__ void col2im_kernel(const T* __restrict__ cols, T* __restrict__ dx,
                              int C, int H, int W, int KH, int KW,
                              int sh, int sw, int ph, int pw, int dh, int dw,
                              int OW, int nrows, int oh0, long long P, long long img_stride,
                              int h_lo, int nh, long long total, int accumulate)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int w = (int)(i % W);
    long long q = i / W;
    const int h = h_lo + (int)(q % nh);
    q /= nh;
    const int c = (int)(q % C);
    const int nl = (int)(q / C);
    typename Acc<T>::type acc = 0;
    for (int kh = 0; kh < KH; ++kh) {
        const int hn = h + ph - kh * dh;
        if (hn < 0) break;
        if (hn % sh) continue;
        const int ohl = hn / sh - oh0;
        if (ohl < 0 || ohl >= nrows) continue;
        const long long row_base = ((long long)nl * nrows + ohl) * OW;
        for (int kw = 0; kw < KW; ++kw) {
            const int wn = w + pw - kw * dw;
            if (wn < 0) break;
            if (wn % sw) continue;
            const int ow = wn / sw;
            if (ow >= OW) continue;
            const long long r = ((long long)c * KH + kh) * KW + kw;
            acc += to_acc(cols[r * P + row_base + ow]);
        }
    }
    T* dst = dx + nl * img_stride + ((long long)c * H + h) * W + w;
    if (accumulate) acc += to_acc(*dst);
    *dst = from_acc<T>(acc);
}
