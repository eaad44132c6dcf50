// One-launch multi-tensor steps of the elementwise optimizers (flame_nn.optim: Lion, AdamWScheduleFree, Prodigy),
// each computing what the optimizer's per-operation path computes, with every product, sum, quotient and root
// rounded on its own (__f*_rn: no FMA contraction) so that fp32 gradients give the same bits.
//
// tensors: int64 [T, 8] rows: param (float*), grad, up to four float* state arrays (0 where absent), numel, the
//          packed kinds (flame_core.kernels.tensor_table: bits 0-3 the gradient's dtype, 0 fp32 / 1 fp16 / 2 bf16;
//          bits 4-7 the parameter's, 0 fp32 / 2 bf16 where the kernel takes bf16; bits 8+ the salt). chunk_tensor / chunk_start: the tensor and first element of
//          each block's OM_CHUNK elements.
#include "optim_grads.cuh"

#define OM_THREADS 256
#define OM_CHUNK 4096

struct OmRow {
    float* p;
    const void* g;
    float* a;
    float* b;
    float* c;
    float* d;
    i64 start, n;
    int kind;           // the gradient's dtype
    int pkind;          // the parameter's: 0 float32, 2 bfloat16 (Adafactor only; the others take float32)
    unsigned int salt;  // a bfloat16 parameter's stochastic-rounding salt
};

__device__ __forceinline__ OmRow om_row(const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor,
                                        const i64* __restrict__ chunk_start) {
    const i64* r = tensors + 8 * (i64)chunk_tensor[blockIdx.x];
    OmRow row;
    row.p = reinterpret_cast<float*>(r[0]);
    row.g = reinterpret_cast<const void*>(r[1]);
    row.a = reinterpret_cast<float*>(r[2]);
    row.b = reinterpret_cast<float*>(r[3]);
    row.c = reinterpret_cast<float*>(r[4]);
    row.d = reinterpret_cast<float*>(r[5]);
    row.start = chunk_start[blockIdx.x];
    row.n = min((i64)OM_CHUNK, r[6] - row.start);
    row.kind = (int)(r[7] & 15);
    row.pkind = (int)((r[7] >> 4) & 15);
    row.salt = (unsigned int)(r[7] >> 8);
    return row;
}


// Lion: a = exp_avg.  p *= decay;  p -= lr sign(b1 m + (1 - b1) g);  m = b2 m + (1 - b2) g
extern "C" __global__ void __launch_bounds__(OM_THREADS) lion_multi(
        const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start,
        float lr, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2, float decay,
        int apply_decay) {
    const OmRow r = om_row(tensors, chunk_tensor, chunk_start);
    for (i64 j = threadIdx.x; j < r.n; j += OM_THREADS) {
        const i64 i = r.start + j;
        const float g = load_grad(r.g, i, r.kind);
        float m = r.a[i], w = r.p[i];
        if (apply_decay) w = __fmul_rn(w, decay);
        const float c = __fadd_rn(__fmul_rn(m, beta1), __fmul_rn(g, one_minus_beta1));
        const float sgn = c > 0.f ? 1.f : (c < 0.f ? -1.f : c);  // sign: 0 stays 0, NaN stays NaN
        r.p[i] = __fsub_rn(w, __fmul_rn(lr, sgn));
        r.a[i] = __fadd_rn(__fmul_rn(m, beta2), __fmul_rn(one_minus_beta2, g));
    }
}

// AdamWScheduleFree (train mode, p = y): a = z, b = exp_avg_sq.
//   v = b2 v + (1 - b2) g^2;  u = g / (sqrt(v / bc2) + eps) (+ decay y);  y += ckp1 (z - y);  y += y_coef u;
//   z -= lr u
extern "C" __global__ void __launch_bounds__(OM_THREADS) sfadamw_multi(
        const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start,
        float beta2, float one_minus_beta2, float bc2, float eps, float decay, int apply_decay, float ckp1,
        float y_coef, float lr) {
    const OmRow r = om_row(tensors, chunk_tensor, chunk_start);
    for (i64 j = threadIdx.x; j < r.n; j += OM_THREADS) {
        const i64 i = r.start + j;
        const float g = load_grad(r.g, i, r.kind);
        float y = r.p[i], z = r.a[i], v = r.b[i];
        v = __fadd_rn(__fmul_rn(v, beta2), __fmul_rn(one_minus_beta2, __fmul_rn(g, g)));
        float u = __fdiv_rn(g, __fadd_rn(__fsqrt_rn(__fdiv_rn(v, bc2)), eps));
        if (apply_decay) u = __fadd_rn(u, __fmul_rn(decay, y));
        y = __fadd_rn(y, __fmul_rn(ckp1, __fsub_rn(z, y)));
        y = __fadd_rn(y, __fmul_rn(y_coef, u));
        r.p[i] = y;
        r.a[i] = __fsub_rn(z, __fmul_rn(lr, u));
        r.b[i] = v;
    }
}

__device__ __forceinline__ float om_block_sum(float x, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    __syncthreads();  // `red` may still be read by the previous sum
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < OM_THREADS / 32; ++w) s += red[w];
    return s;
}

// Prodigy, first pass (lr > 0): a = p0 (0: an all-zero initial point), b = exp_avg (0 when beta1 = 0),
// c = exp_avg_sq, d = s.  m = b1 m + m_coef g;  v = b2 v + v_coef g^2;  s = beta3 s + s_coef g; and per block the
// partial sums of g (p0 - p) and |s| (the new s) into partials[2 block], partials[2 block + 1].
extern "C" __global__ void __launch_bounds__(OM_THREADS) prodigy_stats_multi(
        const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start,
        float* __restrict__ partials, float beta1, float m_coef, float beta2, float v_coef, float beta3,
        float s_coef) {
    __shared__ float red[OM_THREADS / 32];
    const OmRow r = om_row(tensors, chunk_tensor, chunk_start);
    float dot = 0.f, abs_s = 0.f;
    for (i64 j = threadIdx.x; j < r.n; j += OM_THREADS) {
        const i64 i = r.start + j;
        const float g = load_grad(r.g, i, r.kind), w = r.p[i];
        const float p0 = r.a ? r.a[i] : 0.f;
        dot += __fmul_rn(g, __fsub_rn(p0, w));
        if (r.b) r.b[i] = __fadd_rn(__fmul_rn(r.b[i], beta1), __fmul_rn(m_coef, g));
        r.c[i] = __fadd_rn(__fmul_rn(r.c[i], beta2), __fmul_rn(v_coef, __fmul_rn(g, g)));
        const float s = __fadd_rn(__fmul_rn(r.d[i], beta3), __fmul_rn(s_coef, g));
        r.d[i] = s;
        abs_s += fabsf(s);
    }
    dot = om_block_sum(dot, red);
    abs_s = om_block_sum(abs_s, red);
    if (threadIdx.x == 0) {
        partials[2 * (i64)blockIdx.x] = dot;
        partials[2 * (i64)blockIdx.x + 1] = abs_s;
    }
}

// Prodigy, second pass: b = exp_avg (beta1 > 0), c = exp_avg_sq.
//   p *= decay (decoupled);  p -= (dlr m) / (sqrt(v) + d_eps)
extern "C" __global__ void __launch_bounds__(OM_THREADS) prodigy_update_multi(
        const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start,
        float dlr, float d_eps, float decay, int apply_decay) {
    const OmRow r = om_row(tensors, chunk_tensor, chunk_start);
    for (i64 j = threadIdx.x; j < r.n; j += OM_THREADS) {
        const i64 i = r.start + j;
        float w = r.p[i];
        const float denom = __fadd_rn(__fsqrt_rn(r.c[i]), d_eps);
        if (apply_decay) w = __fmul_rn(w, decay);
        r.p[i] = __fsub_rn(w, __fdiv_rn(__fmul_rn(dlr, r.b[i]), denom));
    }
}

// Adafactor over a table of parameters of three kinds -- a 2-D one (R x C) factored; one of more dimensions factored
// over its last two (a batch of B small R x C matrices, R and C at most AF_SMALL: convolution kernels); any other
// unfactored (flattened) -- float32 or bfloat16 (written back with stochastic rounding: sr_bits(seed, the row's salt,
// i)), in four launches. Rows: param, grad, a = exp_avg (0 without beta1), b = exp_avg_sq_row (B x R) or exp_avg_sq
// (n, unfactored), c = exp_avg_sq_col (B x C; 0 unfactored), d = the tensor's scratch: [0] rms(w), [1] the sum of u^2,
// [2] the mean of the new row (2-D), [3] lr_t, [4] the sum of w^2, then (2-D) R row sums and C column sums of
// g^2 + eps1; the sums are zero between steps. dims[2t], dims[2t + 1]: R and C of tensor t (0, 0: unfactored).
//   1 adafactor_sums_multi (per OM_CHUNK): the sum of w^2; 2-D: row and column sums of g^2 + eps1 (a warp's run of
//     a row summed by shuffles, shared-memory partials, then one global atomic per touched row / column); batched: a thread per matrix (the block's matrices:
//     those starting in its chunk) updates its row and column states; unfactored: v = b2t v + (1 - b2t) (g^2 + eps1)
//   2 adafactor_factors_multi (one block per tensor): rms(w); 2-D: row = b2t row + (1 - b2t) rowsum / C, col likewise
//     over R, mean(row); lr_t = (scale ? max(eps2, rms) : 1) rel; the sums zeroed
//   3 adafactor_rms_multi (per OM_CHUNK): the sum of u^2, u = g rsqrt(row_i / mean) rsqrt(col_j) (factored; batched:
//     the mean of its matrix's rows) or g rsqrt(v_i)
//   4 adafactor_update_multi (per OM_CHUNK): u / max(rms(u) / clip, 1) lr_t; m = b1 m + (1 - b1) u, u = m (beta1);
//     w = w (1 - wd lr_t) - u
#define AF_HEAD 5
#define AF_SMALL 16

struct AfRow {
    OmRow r;
    i64 total, R, C;  // R = C = 0: unfactored; R C < total: a batch of matrices
    bool batched;
    float* rowsum;
    float* colsum;
};

__device__ __forceinline__ AfRow af_row(const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor,
                                        const i64* __restrict__ chunk_start, const i64* __restrict__ dims) {
    AfRow a;
    a.r = om_row(tensors, chunk_tensor, chunk_start);
    const int t = chunk_tensor[blockIdx.x];
    a.total = tensors[8 * (i64)t + 6];
    a.R = dims[2 * (i64)t];
    a.C = dims[2 * (i64)t + 1];
    a.batched = a.C && a.R * a.C < a.total;
    a.rowsum = a.r.d + AF_HEAD;
    a.colsum = a.rowsum + a.R;
    return a;
}

__device__ __forceinline__ float af_load_w(const OmRow& r, i64 i) {
    return r.pkind == 2 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(r.p)[i]) : r.p[i];
}

__device__ __forceinline__ void af_store_w(const OmRow& r, i64 i, float w, unsigned int seed) {
    if (r.pkind == 2)
        reinterpret_cast<__nv_bfloat16*>(r.p)[i] = sr_bf16(w, sr_bits(seed, r.salt, i));
    else
        r.p[i] = w;
}

// u before clipping: g scaled by its row's factor over the mean (inv_mean: 1 / the mean of the tensor's rows, or of
// its matrix's rows in a batch) and its column's
__device__ __forceinline__ float af_u(const AfRow& a, i64 row, i64 col, float g, float inv_mean) {
    const float rf = rsqrtf(__fmul_rn(a.r.b[row], inv_mean)), cf = rsqrtf(a.r.c[col]);
    return __fmul_rn(__fmul_rn(rf, cf), g);
}

// (row, column) of a thread's elements r.start + j, j = threadIdx.x, + OM_THREADS, ... of a 2-D tensor: one 64-bit
// division at the start, then steps (wide rows: a subtraction; rows narrower than a step: a 32-bit division)
struct AfPos {
    i64 row;
    unsigned int col, C;
    __device__ __forceinline__ AfPos(i64 start, i64 C_) {
        const i64 q = start % C_ + threadIdx.x;
        row = start / C_ + q / C_;
        col = (unsigned int)(q % C_);
        C = (unsigned int)C_;
    }
    __device__ __forceinline__ void next() {
        col += OM_THREADS;
        if (C >= OM_THREADS) {
            if (col >= C) { col -= C; ++row; }
        } else {
            row += col / C;
            col %= C;
        }
    }
};

// the matrices a block takes in the batched case: those whose first element lies in its chunk
__device__ __forceinline__ void af_matrices(const AfRow& a, i64* m0, i64* m1) {
    const i64 rc = a.R * a.C;
    *m0 = (a.r.start + rc - 1) / rc;
    *m1 = (a.r.start + a.r.n - 1) / rc + 1;
}

__device__ __forceinline__ float af_matrix_inv_mean(const AfRow& a, i64 m) {
    float s = 0.f;
    for (int k = 0; k < a.R; ++k) s += a.r.b[m * a.R + k];
    return 1.f / (s / (float)a.R);
}

extern "C" __global__ void __launch_bounds__(OM_THREADS) adafactor_sums_multi(
        const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start,
        const i64* __restrict__ dims, float eps1, float beta2t, float one_minus_beta2t) {
    __shared__ float acc[OM_CHUNK + 2 * OM_THREADS];  // the chunk's row partials, then its column partials
    __shared__ float red[OM_THREADS / 32];
    const AfRow a = af_row(tensors, chunk_tensor, chunk_start, dims);
    const OmRow& r = a.r;
    float sw = 0.f;
    if (!a.C) {  // unfactored: the second moment itself
        for (i64 j = threadIdx.x; j < r.n; j += OM_THREADS) {
            const i64 i = r.start + j;
            const float g = load_grad(r.g, i, r.kind), w = af_load_w(r, i);
            sw += __fmul_rn(w, w);
            r.b[i] = __fadd_rn(__fmul_rn(r.b[i], beta2t), __fmul_rn(one_minus_beta2t, __fadd_rn(__fmul_rn(g, g), eps1)));
        }
    } else if (a.batched) {  // a thread per small matrix: its row and column means, and its states
        i64 m0, m1;
        af_matrices(a, &m0, &m1);
        const int R = (int)a.R, C = (int)a.C;
        for (i64 m = m0 + threadIdx.x; m < m1; m += OM_THREADS) {
            float rs[AF_SMALL], cs[AF_SMALL];
            for (int c = 0; c < C; ++c) cs[c] = 0.f;
            for (int k = 0; k < R; ++k) {
                rs[k] = 0.f;
                for (int c = 0; c < C; ++c) {
                    const i64 i = (m * R + k) * C + c;
                    const float g = load_grad(r.g, i, r.kind), w = af_load_w(r, i);
                    sw += __fmul_rn(w, w);
                    const float ue = __fadd_rn(__fmul_rn(g, g), eps1);
                    rs[k] += ue;
                    cs[c] += ue;
                }
            }
            for (int k = 0; k < R; ++k)
                r.b[m * R + k] = __fadd_rn(__fmul_rn(r.b[m * R + k], beta2t), __fmul_rn(one_minus_beta2t, rs[k] / (float)C));
            for (int c = 0; c < C; ++c)
                r.c[m * C + c] = __fadd_rn(__fmul_rn(r.c[m * C + c], beta2t), __fmul_rn(one_minus_beta2t, cs[c] / (float)R));
        }
    } else {
        const i64 row0 = r.start / a.C;
        const int nrows = (int)((r.start + r.n - 1) / a.C - row0 + 1);   // <= OM_CHUNK / C + 2
        const int ncols = (int)min(a.C, (i64)OM_CHUNK);
        const i64 col0 = a.C <= OM_CHUNK ? 0 : r.start % a.C;          // wider rows: the chunk's run of columns
        float* racc = acc;
        float* cacc = acc + nrows;
        for (int k = threadIdx.x; k < nrows + ncols; k += OM_THREADS) acc[k] = 0.f;
        __syncthreads();
        const int lane = threadIdx.x & 31;
        AfPos pos(r.start, a.C);
        for (i64 base = 0; base < r.n; base += OM_THREADS) {   // (every lane of a warp in each step: the shuffles)
            const i64 j = base + threadIdx.x;
            const bool on = j < r.n;
            float ue = 0.f;
            if (on) {
                const i64 i = r.start + j;
                const float g = load_grad(r.g, i, r.kind), w = af_load_w(r, i);
                sw += __fmul_rn(w, w);
                ue = __fadd_rn(__fmul_rn(g, g), eps1);
                const i64 d = (i64)pos.col - col0;   // (both in [0, C): the run's column, wrapping at C)
                atomicAdd(&cacc[d < 0 ? d + a.C : d], ue);
            }
            // a row's run within the warp summed by a segmented shuffle reduction (the lanes' rows ascend): the
            // first lane of each run adds it, instead of 32 lanes contending for one address
            const int key = on ? (int)(pos.row - row0) : 0x7fffffff;
            float v = ue;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const float ov = __shfl_down_sync(0xffffffffu, v, off);
                const int ok = __shfl_down_sync(0xffffffffu, key, off);
                if (lane + off < 32 && ok == key) v += ov;
            }
            const int prev = __shfl_up_sync(0xffffffffu, key, 1);
            if (on && (lane == 0 || prev != key)) atomicAdd(&racc[key], v);
            pos.next();
        }
        __syncthreads();
        for (int k = threadIdx.x; k < nrows; k += OM_THREADS) atomicAdd(&a.rowsum[row0 + k], racc[k]);
        for (int k = threadIdx.x; k < ncols; k += OM_THREADS) atomicAdd(&a.colsum[(col0 + k) % a.C], cacc[k]);
    }
    sw = om_block_sum(sw, red);
    if (threadIdx.x == 0) atomicAdd(&r.d[4], sw);
}

extern "C" __global__ void __launch_bounds__(OM_THREADS) adafactor_factors_multi(
        const i64* __restrict__ tensors, const i64* __restrict__ dims, float beta2t, float one_minus_beta2t,
        float eps2, float rel, int scale_parameter) {
    __shared__ float red[OM_THREADS / 32];
    const i64* row = tensors + 8 * (i64)blockIdx.x;
    float* vr = reinterpret_cast<float*>(row[3]);
    float* vc = reinterpret_cast<float*>(row[4]);
    float* scratch = reinterpret_cast<float*>(row[5]);
    const i64 n = row[6], R0 = dims[2 * (i64)blockIdx.x], C0 = dims[2 * (i64)blockIdx.x + 1];
    const bool matrix = C0 && R0 * C0 == n;  // (batched: the sums launch updated the states)
    const i64 R = matrix ? R0 : 0, C = matrix ? C0 : 0;
    float* rowsum = scratch + AF_HEAD;
    float* colsum = rowsum + R;
    float sr = 0.f;
    for (i64 i = threadIdx.x; i < R; i += OM_THREADS) {
        const float v = __fadd_rn(__fmul_rn(vr[i], beta2t), __fmul_rn(one_minus_beta2t, rowsum[i] / (float)C));
        vr[i] = v;
        sr += v;
        rowsum[i] = 0.f;
    }
    for (i64 j = threadIdx.x; j < C; j += OM_THREADS) {
        vc[j] = __fadd_rn(__fmul_rn(vc[j], beta2t), __fmul_rn(one_minus_beta2t, colsum[j] / (float)R));
        colsum[j] = 0.f;
    }
    sr = om_block_sum(sr, red);
    if (threadIdx.x == 0) {
        const float rms = sqrtf(scratch[4] / (float)n);
        scratch[0] = rms;
        scratch[1] = 0.f;
        scratch[2] = R ? sr / (float)R : 1.f;
        scratch[3] = (scale_parameter ? fmaxf(eps2, rms) : 1.f) * rel;
        scratch[4] = 0.f;
    }
}

// every element of a chunk in its layout (vector, batch of small matrices, one matrix): f(i, u) with u the element's
// update before clipping, g / sqrt(v) (the RMS pass sums u^2, the update applies it)
template <typename F>
__device__ __forceinline__ void af_each(const AfRow& a, F f) {
    const OmRow& r = a.r;
    if (!a.C) {
        for (i64 j = threadIdx.x; j < r.n; j += OM_THREADS) {
            const i64 i = r.start + j;
            f(i, __fmul_rn(rsqrtf(r.b[i]), load_grad(r.g, i, r.kind)));
        }
    } else if (a.batched) {
        i64 m0, m1;
        af_matrices(a, &m0, &m1);
        const int R = (int)a.R, C = (int)a.C;
        for (i64 m = m0 + threadIdx.x; m < m1; m += OM_THREADS) {
            const float inv_mean = af_matrix_inv_mean(a, m);
            for (int k = 0; k < R; ++k)
                for (int c = 0; c < C; ++c) {
                    const i64 i = (m * R + k) * C + c;
                    f(i, af_u(a, m * R + k, m * C + c, load_grad(r.g, i, r.kind), inv_mean));
                }
        }
    } else {
        const float inv_mean = 1.f / r.d[2];
        AfPos pos(r.start, a.C);
        for (i64 j = threadIdx.x; j < r.n; j += OM_THREADS, pos.next()) {
            const i64 i = r.start + j;
            f(i, af_u(a, pos.row, pos.col, load_grad(r.g, i, r.kind), inv_mean));
        }
    }
}

extern "C" __global__ void __launch_bounds__(OM_THREADS) adafactor_rms_multi(
        const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start,
        const i64* __restrict__ dims) {
    __shared__ float red[OM_THREADS / 32];
    const AfRow a = af_row(tensors, chunk_tensor, chunk_start, dims);
    const OmRow& r = a.r;
    float su = 0.f;
    af_each(a, [&](i64, float u) { su += __fmul_rn(u, u); });
    su = om_block_sum(su, red);
    if (threadIdx.x == 0) atomicAdd(&r.d[1], su);
}

struct AfStep {   // the update's scalars
    float clip, lr_t, beta1, weight_decay, decay;
    int use_beta1;
    unsigned int seed;
};

// u (before clipping) of element i applied: clipped, scaled by lr_t, through the first moment (beta1), decayed
__device__ __forceinline__ void af_apply(const OmRow& r, i64 i, float u, const AfStep& s) {
    u = __fmul_rn(u / s.clip, s.lr_t);
    if (s.use_beta1) {
        u = __fadd_rn(__fmul_rn(r.a[i], s.beta1), __fmul_rn(1.f - s.beta1, u));
        r.a[i] = u;
    }
    const float w = af_load_w(r, i);
    af_store_w(r, i, __fsub_rn(s.weight_decay != 0.f ? __fmul_rn(w, s.decay) : w, u), s.seed);
}

extern "C" __global__ void __launch_bounds__(OM_THREADS) adafactor_update_multi(
        const i64* __restrict__ tensors, const int* __restrict__ chunk_tensor, const i64* __restrict__ chunk_start,
        const i64* __restrict__ dims, float clip_threshold, float beta1, int use_beta1, float weight_decay,
        unsigned int seed) {
    const AfRow a = af_row(tensors, chunk_tensor, chunk_start, dims);
    const OmRow& r = a.r;
    AfStep s;
    s.lr_t = r.d[3];
    s.clip = fmaxf(sqrtf(r.d[1] / (float)a.total) / clip_threshold, 1.f);
    s.beta1 = beta1;
    s.use_beta1 = use_beta1;
    s.weight_decay = weight_decay;
    s.decay = 1.f - weight_decay * s.lr_t;
    s.seed = seed;
    af_each(a, [&](i64 i, float u) { af_apply(r, i, u, s); });
}
