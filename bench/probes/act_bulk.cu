// Probe (bench/act_probe.py bulk): elementwise through the bulk-copy engine (cp.async.bulk, TMA) instead of per-thread
// 16-byte loads and stores: a chunk of bytes comes into shared memory on an mbarrier, every thread maps its 16-byte
// vectors in place, and one thread writes the chunk back with a bulk store (cp.async.bulk.global.shared::cta). OP 0 is
// a copy (how fast the engine moves the bytes at all), OP 1 the SiLU forward. Sizes: multiples of 16 bytes (the probe's
// shape). Appended to activations.cu's source (common.cuh's mbar_* / bulk_* helpers, silu()). The library's
// form of act_bulk_one: map1_bulk (common.cuh), silu_fwd_bulk (activations.cu).
template <typename T, int OP>
__device__ __forceinline__ void map_chunk(uint4* buf, unsigned bytes) {
    if (OP == 0) return;
    constexpr int N = VecT<T>::N;
    for (unsigned v = threadIdx.x; v < bytes / 16; v += blockDim.x) {
        float a[N];
        unpack_f32<T>(buf[v], a);
#pragma unroll
        for (int j = 0; j < N; ++j) a[j] = silu(a[j]);
        buf[v] = pack_f32<T>(a);
    }
}

// One chunk per block (grid = chunks; the hardware's block scheduler balances the SMs).
template <typename T, int OP>
__global__ void act_bulk_one(const T* __restrict__ x, T* __restrict__ y, i64 nbytes, int chunk) {
    extern __shared__ __align__(128) uint4 buf[];
    __shared__ __align__(8) unsigned long long bar;
    const i64 off = (i64)blockIdx.x * chunk;
    const unsigned bytes = (unsigned)min((i64)chunk, nbytes - off);
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        mbar_init_fence();
        mbar_expect_tx(&bar, bytes);
        bulk_load(buf, reinterpret_cast<const char*>(x) + off, bytes, &bar);
    }
    __syncthreads();
    mbar_wait(&bar, 0);
    map_chunk<T, OP>(buf, bytes);
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == 0) {
        bulk_store(reinterpret_cast<char*>(y) + off, buf, bytes);
        bulk_commit();
        bulk_wait_read<0>();
    }
}

// Each warp on its own: W bytes per warp (chunk = W * warps per block), its own mbarrier, its lane 0 issuing the bulk
// load and store; no block-wide barrier.
template <typename T, int OP>
__global__ void act_bulk_warp(const T* __restrict__ x, T* __restrict__ y, i64 nbytes, int chunk) {
    extern __shared__ __align__(128) uint4 buf[];
    __shared__ __align__(8) unsigned long long bar[32];
    constexpr int N = VecT<T>::N;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, W = chunk / (blockDim.x / 32);
    const i64 off = (i64)blockIdx.x * chunk + (i64)warp * W;
    if (off >= nbytes) return;
    const unsigned bytes = (unsigned)min((i64)W, nbytes - off);
    uint4* wb = buf + warp * (W / 16);
    if (lane == 0) {
        mbar_init(&bar[warp], 1);
        mbar_init_fence();
        mbar_expect_tx(&bar[warp], bytes);
        bulk_load(wb, reinterpret_cast<const char*>(x) + off, bytes, &bar[warp]);
    }
    __syncwarp();
    mbar_wait(&bar[warp], 0);
    if (OP) {
        for (unsigned v = lane; v < bytes / 16; v += 32) {
            float a[N];
            unpack_f32<T>(wb[v], a);
#pragma unroll
            for (int j = 0; j < N; ++j) a[j] = silu(a[j]);
            wb[v] = pack_f32<T>(a);
        }
    }
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
        bulk_store(reinterpret_cast<char*>(y) + off, wb, bytes);
        bulk_commit();
        bulk_wait_read<0>();
    }
}

// Two chunks per block, both loaded at entry on their own mbarriers: the first is mapped and stored while the second
// arrives (shared memory 2 * chunk).
template <typename T, int OP>
__global__ void act_bulk_two(const T* __restrict__ x, T* __restrict__ y, i64 nbytes, int chunk) {
    extern __shared__ __align__(128) uint4 buf[];
    __shared__ __align__(8) unsigned long long bar[2];
    const i64 off0 = (i64)blockIdx.x * 2 * chunk;
    unsigned bytes[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) bytes[h] = (unsigned)max((i64)0, min((i64)chunk, nbytes - off0 - (i64)h * chunk));
    if (threadIdx.x == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) mbar_init(&bar[h], 1);
        mbar_init_fence();
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (bytes[h]) {
                mbar_expect_tx(&bar[h], bytes[h]);
                bulk_load(buf + h * (chunk / 16), reinterpret_cast<const char*>(x) + off0 + (i64)h * chunk, bytes[h],
                          &bar[h]);
            }
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!bytes[h]) break;
        mbar_wait(&bar[h], 0);
        map_chunk<T, OP>(buf + h * (chunk / 16), bytes[h]);
        fence_proxy_async();
        __syncthreads();
        if (threadIdx.x == 0) {
            bulk_store(reinterpret_cast<char*>(y) + off0 + (i64)h * chunk, buf + h * (chunk / 16), bytes[h]);
            bulk_commit();
        }
    }
    if (threadIdx.x == 0) bulk_wait_read<0>();
}

// The backwards (dy, x -> dx) with one chunk per block: both inputs' CHUNK bytes come in on one mbarrier, dx is mapped
// into x's buffer and stored from there. OP 0: SiLU, 1: GELU(tanh).
template <typename T, int OP>
__global__ void act_bulk2_one(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, i64 nbytes,
                              int chunk) {
    extern __shared__ __align__(128) uint4 buf[];
    __shared__ __align__(8) unsigned long long bar;
    constexpr int N = VecT<T>::N;
    const i64 off = (i64)blockIdx.x * chunk;
    const unsigned bytes = (unsigned)min((i64)chunk, nbytes - off);
    uint4 *bg = buf, *bx = buf + chunk / 16;
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        mbar_init_fence();
        mbar_expect_tx(&bar, 2 * bytes);
        bulk_load(bg, reinterpret_cast<const char*>(dy) + off, bytes, &bar);
        bulk_load(bx, reinterpret_cast<const char*>(x) + off, bytes, &bar);
    }
    __syncthreads();
    mbar_wait(&bar, 0);
    for (unsigned v = threadIdx.x; v < bytes / 16; v += blockDim.x) {
        float g[N], a[N];
        unpack_f32<T>(bg[v], g);
        unpack_f32<T>(bx[v], a);
#pragma unroll
        for (int j = 0; j < N; ++j) a[j] = g[j] * (OP == 0 ? silu_grad(a[j]) : gelu_tanh_grad(a[j]));
        bx[v] = pack_f32<T>(a);
    }
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == 0) {
        bulk_store(reinterpret_cast<char*>(dx) + off, bx, bytes);
        bulk_commit();
        bulk_wait_read<0>();
    }
}
