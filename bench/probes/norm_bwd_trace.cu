// norm_bwd_tma with timers (appended to the expanded cuda_src/norms.cu by bench/norm_trace_probe.py): the same body
// as norm_bwd_tma_body (CL 1, LOOP 0, `opts` as there), thread 0 of each block recording into
// trace[block * 12 + ...]:
//   0 globaltimer at entry, 1 after the first row's data arrived, 2 at exit (ns)
//   3 cycles in mbar_wait, 4 in pass 1, 5 in block_sum2, 6 in pass 2 (dx, partials), 7 writing the part rows,
//   8 cycles entry -> exit, 9 SM id, 10 rows, 11 cycles from entry to the first fill issued
__device__ __forceinline__ long long gtimer() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

template <typename T, int VPT, int ACC, int REGS>
__global__ void __maxnreg__(REGS) norm_bwd_tma_trace(NORM_TMA_PARAMS, long long* __restrict__ trace) {
    constexpr int N = VecT<T>::N;
    extern __shared__ __align__(128) unsigned char norm_rows[];
    __shared__ unsigned long long full[NORM_TMA_MAX_STAGES];
    __shared__ float2 red[2][32];
    float wr[VPT][N];  // unused (WR false)
    const long long g0 = gtimer(), c0 = clock64();
    long long cw = 0, cp1 = 0, cr = 0, cp2 = 0, gfirst = 0, cfill = 0;
    grid_dependents_launch();
    const int nvec = cols / N;
    const i64 mine = rows > (i64)blockIdx.x ? (rows - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int early = (opts & 15) && (opts & 15) < stages ? (opts & 15) : stages;
    const bool one_barrier = opts & 16;
    float nmu = 0.f, nrs = 0.f;
    if (mine > 0) {
        nmu = rms ? 0.f : mean[blockIdx.x];
        nrs = rstd[blockIdx.x];
    }
    T* sbuf = reinterpret_cast<T*>(norm_rows);
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
        mbar_init_fence();
        for (int s = 0; s < early && s < mine; ++s)
            norm_tma_fill<T>(sbuf, full, s, x, dy, blockIdx.x + (i64)s * gridDim.x, cols);
        cfill = clock64() - c0;
    }
    __syncthreads();
    float aw[VPT][N], ab[VPT][N];
#pragma unroll
    for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) aw[i][j] = ab[i][j] = 0.f;
    const float inv_cols = 1.f / cols;
    int s = 0;
    unsigned phase = 0;
    for (i64 it = 0; it < mine; ++it) {
        const i64 row = blockIdx.x + it * gridDim.x;
        const float mu = nmu, rs = nrs;
        if (it + 1 < mine) {
            nmu = rms ? 0.f : mean[row + gridDim.x];
            nrs = rstd[row + gridDim.x];
        }
        long long t = clock64();
        mbar_wait(&full[s], phase);
        long long u = clock64();
        cw += u - t;
        if (it == 0) gfirst = gtimer();
        if (it == 0 && threadIdx.x == 0)
            for (int f = early; f < stages && f < mine; ++f)
                norm_tma_fill<T>(sbuf, full, f, x, dy, blockIdx.x + (i64)f * gridDim.x, cols);
        const T* xs = sbuf + (i64)2 * s * cols;
        float sg = 0.f, sgx = 0.f;
        norm_tma_pass<T, VPT, ACC, N, false, false>(xs, xs + cols, w, nvec, wf32, wr, mu, rs, sg, sgx, dx, aw, ab);
        t = clock64();
        cp1 += t - u;
        if (one_barrier)
            block_sum2_1b(sg, sgx, red[it & 1]);
        else
            block_sum2(sg, sgx, reinterpret_cast<float*>(red[0]));
        u = clock64();
        cr += u - t;
        if (threadIdx.x == 0 && it >= 1 && it - 1 + stages < mine) {
            fence_proxy_async();
            norm_tma_fill<T>(sbuf, full, s == 0 ? stages - 1 : s - 1, x, dy, row + (i64)(stages - 1) * gridDim.x,
                             cols);
        }
        float mg = rms ? 0.f : sg * inv_cols, mgx = sgx * inv_cols;
        norm_tma_pass<T, VPT, ACC, N, true, false>(xs, xs + cols, w, nvec, wf32, wr, mu, rs, mg, mgx, dx + row * cols, aw, ab);
        cp2 += clock64() - u;
        if (++s == stages) {
            s = 0;
            phase ^= 1u;
        }
    }
    long long t = clock64();
    const i64 base = (i64)blockIdx.x * cols;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int k = i * blockDim.x + threadIdx.x;
        if (k < nvec) {
            if (dw_part) store_f32<float, N>(dw_part + base + (i64)k * N, aw[i]);
            if (ACC == 2 && db_part) store_f32<float, N>(db_part + base + (i64)k * N, ab[i]);
        }
    }
    if (threadIdx.x == 0) {
        const long long c1 = clock64();
        long long* o = trace + (i64)blockIdx.x * 12;
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        o[0] = g0; o[1] = gfirst; o[2] = gtimer();
        o[3] = cw; o[4] = cp1; o[5] = cr; o[6] = cp2; o[7] = c1 - t; o[8] = c1 - c0; o[9] = smid; o[10] = mine;
        o[11] = cfill;
    }
}
