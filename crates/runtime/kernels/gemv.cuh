// Skinny bf16 matmuls for decode steps (included by fused.cu, after the norm helpers they
// fold in): the plain `gemv_bf16_m*` and the variants with the input norm, bias, silu*mul or
// residual add folded in (`gemv_norm_*`, `gemv_silu_*`, `gemv_resid_*`).

// acc[m] += (16-byte chunk c of row m of x) . wv, for the M rows of x (f32).
template <int M>
__device__ __forceinline__ void dot_chunk(const uint4 wv, const bf16* __restrict__ x, int k,
                                          int c, float* acc) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
    float wf[8];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 f = __bfloat1622float2(w2[e]);
        wf[2 * e] = f.x;
        wf[2 * e + 1] = f.y;
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        const uint4 xv = reinterpret_cast<const uint4*>(x + (long long)m * k)[c];
        const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 f = __bfloat1622float2(x2[e]);
            acc[m] += wf[2 * e] * f.x + wf[2 * e + 1] * f.y;
        }
    }
}

// Skinny matmul y = x W^T for M <= 8 rows (decode steps): x [M, K], W [N, K] (row-major,
// as stored), y [M, N], all bf16, f32 accumulation. One warp per output column n streams
// W's row with 16-byte loads (weights are read once, at close to full bandwidth; x stays
// in L1/L2). grid (ceil(N / 8)), block 256. K must be a multiple of 8.
template <int M>
__device__ void gemv_rows(const bf16* __restrict__ x, const bf16* __restrict__ w,
                          bf16* __restrict__ y, int n_out, int k) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * 8 + warp;
    if (n < n_out && lane == 0) prefetch_share(w + (long long)n * k, 2ll * k, n_out);
    pdl_wait();
    // Small weights: let the next kernel start now (its prefetch fits L2 beside ours); large
    // ones stream more than L2 holds, which would evict its prefetch: let it start at our end.
    const bool early = 2ll * k * n_out <= PDL_PREFETCH_BUDGET;
    if (early) pdl_trigger();
    if (n >= n_out) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)n * k);
    const int chunks = k / 8;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.f;
#pragma unroll 4
    for (int c = lane; c < chunks; c += 32) dot_chunk<M>(wr[c], x, k, c, acc);
#pragma unroll
    for (int m = 0; m < M; m++) {
        const float v = warp_sum(acc[m]);
        if (lane == 0) y[(long long)m * n_out + n] = __float2bfloat16(v);
    }
}

#define GEMV(MM)                                                                           \
    extern "C" __global__ void gemv_bf16_m##MM(const bf16* __restrict__ x,                 \
                                               const bf16* __restrict__ w,                 \
                                               bf16* __restrict__ y, int n_out, int k) {   \
        gemv_rows<MM>(x, w, y, n_out, k);                                                  \
    }
GEMV(1)
GEMV(2)
GEMV(3)
GEMV(4)
GEMV(5)
GEMV(6)
GEMV(7)
GEMV(8)

// Skinny matmul with the neighbouring small ops folded in (decode steps of 1-2 rows, where
// the step is bound by the number of kernels, not by their work):
//   IN_NORM:  the input is RMSNorm(resid) * norm_w, computed by every block into shared
//             memory (hidden <= GEMV_NORM_MAX_K; same rounding as add_rms_norm_bf16);
//   OUT_BIAS: y = bf16(acc) (+ bias, rounded like the bf16 broadcast add), [M, cols];
//   OUT_RESID: resid[m, n] += bf16(acc), in place (each n belongs to one warp);
//   OUT_SILU: the warp computes gate row n and up row cols + n of the fused [gate | up]
//             weight; y = bf16(silu(gate) * up) with silu_mul_bf16's rounding.
// grid <= ceil(cols / 8) (columns grid-stride), block 256, shared: IN_NORM (32 floats +
// M * k bf16), else 0.
#define IN_PLAIN 0
#define IN_NORM 1
#define OUT_BIAS 0
#define OUT_RESID 1
#define OUT_SILU 2

template <int M, int IN, int OUT>
__device__ void gemv_fused(const bf16* __restrict__ x, const bf16* __restrict__ norm_w,
                           float eps, const bf16* __restrict__ w,
                           const bf16* __restrict__ bias, bf16* __restrict__ y, int cols,
                           int k) {
    extern __shared__ float gemv_smem[];
    // The weights do not depend on the previous kernel: start reading the rows of this
    // warp's first column (the grid's first columns), within the prefetch budget.
    const long long first_rows = (long long)min(cols, gridDim.x * 8) * (OUT == OUT_SILU ? 2 : 1);
    {
        const int n = blockIdx.x * 8 + (threadIdx.x >> 5);
        if ((threadIdx.x & 31) == 0 && n < cols) {
            prefetch_share(w + (long long)n * k, 2ll * k, first_rows);
            if (OUT == OUT_SILU) prefetch_share(w + (long long)(cols + n) * k, 2ll * k, first_rows);
        }
    }
    pdl_wait();
    // As in gemv_rows: the next kernel starts now only if our weights are small.
    const bool early = 2ll * k * cols * (OUT == OUT_SILU ? 2 : 1) <= PDL_PREFETCH_BUDGET;
    if (early) pdl_trigger();
    const bf16* xin = x;
    if (IN == IN_NORM) {
        float* scratch = gemv_smem;
        bf16* xs = reinterpret_cast<bf16*>(gemv_smem + 32);
        for (int m = 0; m < M; m++) {
            // k % 8 == 0 (checked by the launcher): the same passes as add_rms_norm_bf16.
            bf16* xr = const_cast<bf16*>(x) + (long long)m * k;
            const float ss = row_sumsq8(xr, nullptr, nullptr, k);
            const float r = rsqrtf(block_sum(ss, scratch) / k + eps);
            row_scale8(xr, nullptr, norm_w, r, xs + m * k, k);
        }
        __syncthreads();
        xin = xs;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunks = k / 8;
    // Columns grid-stride, so a grid of a few blocks per SM pays the norm prologue once.
    for (int n = blockIdx.x * 8 + warp; n < cols; n += gridDim.x * 8) {
        float acc[M], acc2[M];
#pragma unroll
        for (int m = 0; m < M; m++) acc[m] = acc2[m] = 0.f;
        const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)n * k);
        const uint4* wr2 = reinterpret_cast<const uint4*>(w + (long long)(cols + n) * k);
#pragma unroll 4
        for (int c = lane; c < chunks; c += 32) {
            const uint4 wv = wr[c];
            if (OUT == OUT_SILU) {
                const uint4 wv2 = wr2[c];
                dot_chunk<M>(wv, xin, k, c, acc);
                dot_chunk<M>(wv2, xin, k, c, acc2);
            } else {
                dot_chunk<M>(wv, xin, k, c, acc);
            }
        }
#pragma unroll
        for (int m = 0; m < M; m++) {
            const float v = warp_sum(acc[m]);
            const float v2 = OUT == OUT_SILU ? warp_sum(acc2[m]) : 0.f;
            if (lane != 0) continue;
            const long long o = (long long)m * cols + n;
            if (OUT == OUT_BIAS) {
                float r = round_bf16(v);
                if (bias != nullptr) r += __bfloat162float(bias[n]);
                y[o] = __float2bfloat16(r);
            } else if (OUT == OUT_RESID) {
                y[o] = __float2bfloat16(__bfloat162float(y[o]) + round_bf16(v));
            } else {
                const float g = round_bf16(v), u = round_bf16(v2);
                y[o] = __float2bfloat16(round_bf16(g / (1.f + __expf(-g))) * u);
            }
        }
    }
}

#define GEMV_FUSED(MM, IN, OUT, NAME)                                                       \
    extern "C" __global__ void NAME##_m##MM(const bf16* __restrict__ x,                      \
                                            const bf16* __restrict__ norm_w, float eps,      \
                                            const bf16* __restrict__ w,                      \
                                            const bf16* __restrict__ bias,                   \
                                            bf16* __restrict__ y, int cols, int k) {         \
        gemv_fused<MM, IN, OUT>(x, norm_w, eps, w, bias, y, cols, k);                        \
    }
GEMV_FUSED(1, IN_NORM, OUT_BIAS, gemv_norm_bf16)
GEMV_FUSED(2, IN_NORM, OUT_BIAS, gemv_norm_bf16)
GEMV_FUSED(1, IN_NORM, OUT_SILU, gemv_norm_silu_bf16)
GEMV_FUSED(2, IN_NORM, OUT_SILU, gemv_norm_silu_bf16)
GEMV_FUSED(1, IN_PLAIN, OUT_SILU, gemv_silu_bf16)
GEMV_FUSED(2, IN_PLAIN, OUT_SILU, gemv_silu_bf16)
GEMV_FUSED(1, IN_PLAIN, OUT_RESID, gemv_resid_bf16)
GEMV_FUSED(2, IN_PLAIN, OUT_RESID, gemv_resid_bf16)
