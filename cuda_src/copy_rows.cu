// Row-block copies: dst[r, 0:cols] = src[r, 0:cols] for r < rows, each side with its own row stride (in bytes), the
// columns contiguous. What a concatenation or a stack writes per piece (cat along dim d of C-contiguous pieces: rows =
// the dims before d, a row = the rest; stack: the same along a new dim), and what CuPy's generic elementwise copy does
// with an index division per element and one element per thread. Here: 16-byte vectors where every address and
// length allows (else 4-byte words, else bytes), a 2-D grid (x: columns, y: groups of 4 rows, striding) so no division per element, each thread's
// 4 loads in flight before its stores.
#include "common.cuh"

template <typename V>
__device__ __forceinline__ void copy_rows_body(const char* __restrict__ src, char* __restrict__ dst, long long rows,
                                               long long cols, long long sstride, long long dstride) {
    // cols counts V units; strides count bytes
    // a thread copies column c of 4 rows per step, its 4 loads issued before its stores
    long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const long long step = 4LL * gridDim.y;
    for (long long r0 = 4LL * blockIdx.y; r0 < rows; r0 += step) {
        V v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (r0 + k < rows) v[k] = reinterpret_cast<const V*>(src + (r0 + k) * sstride)[c];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (r0 + k < rows) reinterpret_cast<V*>(dst + (r0 + k) * dstride)[c] = v[k];
    }
}

extern "C" __global__ void copy_rows_v16(const char* src, char* dst, long long rows, long long cols,
                                         long long sstride, long long dstride) {
    copy_rows_body<int4>(src, dst, rows, cols, sstride, dstride);
}

extern "C" __global__ void copy_rows_v4(const char* src, char* dst, long long rows, long long cols,
                                        long long sstride, long long dstride) {
    copy_rows_body<int>(src, dst, rows, cols, sstride, dstride);
}

extern "C" __global__ void copy_rows_v1(const char* src, char* dst, long long rows, long long cols,
                                        long long sstride, long long dstride) {
    copy_rows_body<char>(src, dst, rows, cols, sstride, dstride);
}
