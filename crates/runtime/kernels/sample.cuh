// sample_rows_f32: one token per row of f32 logits, drawn where they are (a sampled request
// then costs what a greedy one does: two numbers per row reach the host, not the
// vocabulary). src/sampling/race.rs is the reference, step for step; read it for the why.
// One block of 1024 threads per row:
//   1. NaN?, the raw max, the best allowed id (first of equals); 2. the raw log-sum-exp;
//   then, when sampled, in scaled logits s = (l - best) / T:
//   3. top-k: a 16-way search (7 passes) for the largest t with #{s >= t} >= k;
//   4. top-p: the same search for the largest t with Σ_{s >= t} e^s >= top_p Σ_{s >= base} e^s;
//   5. the Gumbel race: argmax of s + (-ln(-ln u_i)) over s >= max(base, ln min_p, t_p);
//   6. the top alternatives asked for, one pass each over the raw row.
// Penalties and bias are applied first to a copy of the logits (adjust_logits_f32).
// Sums are per thread, then a fixed tree: a row's pick depends on nothing but its inputs.
// Cuts are computed with explicit rounding (no FMA contraction) as the reference does.

#define SAMPLE_WAYS 16
#define SAMPLE_PASSES 7
#define SAMPLE_FLOOR (-30.0f)
#define SAMPLE_LOWEST (-88.0f)

__device__ __forceinline__ float race_uniform(unsigned long long key, unsigned id) {
    unsigned long long z = key ^ ((unsigned long long)id * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return __fmul_rn(__fadd_rn((float)(z >> 41), 0.5f), 1.0f / 8388608.0f);
}

__device__ __forceinline__ float race_gumbel(unsigned long long key, unsigned id) {
    return -logf(-logf(race_uniform(key, id)));
}

// Keep (v, i) or take (v2, i2): the larger value, then the lower id; i < 0 is "none".
__device__ __forceinline__ void race_better(float& v, int& i, float v2, int i2) {
    if (i2 >= 0 && (i < 0 || v2 > v || (v2 == v && i2 < i))) {
        v = v2;
        i = i2;
    }
}

// Every thread gets the block's best (value, id). sv, si: >= 32 entries.
__device__ void race_block_argmax(float& v, int& i, float* sv, int* si) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1)
        race_better(v, i, __shfl_xor_sync(0xffffffff, v, o), __shfl_xor_sync(0xffffffff, i, o));
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sv[lane] : -INFINITY;
        i = lane < nw ? si[lane] : -1;
        for (int o = 16; o > 0; o >>= 1)
            race_better(v, i, __shfl_xor_sync(0xffffffff, v, o), __shfl_xor_sync(0xffffffff, i, o));
        if (lane == 0) {
            sv[0] = v;
            si[0] = i;
        }
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    __syncthreads();
}

// The block's sums of 16 per-thread values into out[16] (shared; every thread reads them).
__device__ void race_block_sum16(const float* v, float* scratch, float* out) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int j = 0; j < SAMPLE_WAYS; ++j) {
        float x = warp_sum(v[j]);
        if (lane == 0) scratch[warp * SAMPLE_WAYS + j] = x;
    }
    __syncthreads();
    if (threadIdx.x < SAMPLE_WAYS) {
        float acc = 0.f;
        for (int w = 0; w < nw; ++w) acc += scratch[w * SAMPLE_WAYS + threadIdx.x];
        out[threadIdx.x] = acc;
    }
    __syncthreads();
}

__device__ __forceinline__ float race_scaled(float v, float best, float inv_t) {
    return __fmul_rn(__fsub_rn(v, best), inv_t);
}

// The largest t >= lo (to the last pass's step) with F(t) = Σ_{s >= t} w(s) >= target (w = e^s
// when `mass`, else 1); with share >= 0 the target is share * F(lo). `lo` when F(lo) falls short.
__device__ float race_search(const float* row, const unsigned char* ok, int limit, float best,
                             float inv_t, float lo, float target, bool mass, float share,
                             float* scratch, float* sums) {
    float hi = 1.0f / 1024.0f;
    for (int pass = 0; pass < SAMPLE_PASSES; ++pass) {
        float step = __fdiv_rn(__fsub_rn(hi, lo), (float)SAMPLE_WAYS);
        float cut[SAMPLE_WAYS];
#pragma unroll
        for (int j = 0; j < SAMPLE_WAYS; ++j) cut[j] = __fadd_rn(lo, __fmul_rn((float)j, step));
        float acc[SAMPLE_WAYS];
#pragma unroll
        for (int j = 0; j < SAMPLE_WAYS; ++j) acc[j] = 0.f;
        float above = 0.f;  // weight at or above hi: above every cut
        for (int i = threadIdx.x; i < limit; i += blockDim.x) {
            if (ok && !ok[i]) continue;
            float s = race_scaled(row[i], best, inv_t);
            if (s < lo) continue;
            float w = mass ? expf(s) : 1.f;
            if (s >= hi) {
                above += w;
                continue;
            }
#pragma unroll
            for (int j = 0; j < SAMPLE_WAYS; ++j)
                if (s >= cut[j]) acc[j] += w;
        }
#pragma unroll
        for (int j = 0; j < SAMPLE_WAYS; ++j) acc[j] += above;
        race_block_sum16(acc, scratch, sums);
        if (pass == 0) {
            if (share >= 0.f) target = share * sums[0];
            if (sums[0] < target) return lo;
        }
        int jj = 0;
        for (int j = SAMPLE_WAYS - 1; j >= 0; --j)
            if (sums[j] >= target) {
                jj = j;
                break;
            }
        float nhi = jj + 1 < SAMPLE_WAYS ? cut[jj + 1] : hi;
        lo = cut[jj];
        hi = nhi;
        __syncthreads();  // sums is rewritten by the next pass
    }
    return lo;
}

// Penalties and bias on a copy of the logits: entries [n, 5] f32 (row, id, sub, rep, bias), at
// most one per (row, id): x + bias, then / rep when positive and * rep otherwise, then - sub
// (vLLM's and llama.cpp's order; race.rs `Adjust::apply`).
extern "C" __global__ void adjust_logits_f32(float* __restrict__ logits, int limit,
                                             const float* __restrict__ entries, int n) {
    pdl_begin();
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const float* en = entries + 5 * (long long)e;
    float* at = logits + (long long)en[0] * limit + (long long)en[1];
    float x = __fadd_rn(*at, en[4]);
    const float rep = en[3];
    if (rep != 1.f) x = x > 0.f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
    *at = __fsub_rn(x, en[2]);
}

// raw [rows, limit] f32 (the model's logits); sel: the logits the token is chosen from (raw
// after penalties and bias; null: raw); allowed [rows, limit] u8 or null; params [rows, 4] f32
// (temperature, top_p, min_p, top_k); keys [rows, 2] u32 (low, high); out [rows, 2 + 2 top_n]
// f32: the token's bits, its raw log-probability (NaN for a row holding a NaN), then the
// top_n best raw ids (bits) and log-probabilities, best first, ties to the lower id.
extern "C" __global__ void sample_rows_f32(const float* __restrict__ raw_logits,
                                           const float* __restrict__ sel_logits, int limit,
                                           const unsigned char* __restrict__ allowed,
                                           const float* __restrict__ params,
                                           const unsigned* __restrict__ keys, int top_n,
                                           float* __restrict__ out) {
    pdl_begin();
    __shared__ float scratch[32 * SAMPLE_WAYS];
    __shared__ float sums[SAMPLE_WAYS];
    __shared__ float sv[32];
    __shared__ int si[32];
    const int r = blockIdx.x;
    const float* raw = raw_logits + (long long)r * limit;
    const float* row = sel_logits ? sel_logits + (long long)r * limit : raw;
    const unsigned char* ok = allowed ? allowed + (long long)r * limit : nullptr;
    const float temp = params[4 * r], top_p = params[4 * r + 1], min_p = params[4 * r + 2];
    const float top_k = params[4 * r + 3];
    const unsigned long long key = ((unsigned long long)keys[2 * r + 1] << 32) | keys[2 * r];
    float* o = out + (long long)r * (2 + 2 * top_n);

    int nan = 0;
    float rmax = -INFINITY, bval = -INFINITY;
    int bidx = -1;
    for (int i = threadIdx.x; i < limit; i += blockDim.x) {
        float v = raw[i];
        nan |= isnan(v);
        rmax = fmaxf(rmax, v);
        float w = row[i];
        if ((!ok || ok[i]) && (bidx < 0 || w > bval)) {
            bval = w;
            bidx = i;
        }
    }
    nan = __syncthreads_or(nan);
    rmax = block_max(rmax, scratch);
    race_block_argmax(bval, bidx, sv, si);
    float sum = 0.f;
    for (int i = threadIdx.x; i < limit; i += blockDim.x) sum += expf(raw[i] - rmax);
    sum = block_sum(sum, scratch);
    const float lse = rmax + logf(sum);

    int token = bidx < 0 ? 0 : bidx;
    if (!nan && temp > 0.f && bidx >= 0 && bval > -INFINITY) {
        const float inv_t = __fdiv_rn(1.0f, temp);
        float base = SAMPLE_FLOOR;
        if (top_k > 0.f)
            base = race_search(row, ok, limit, bval, inv_t, SAMPLE_LOWEST, top_k, false, -1.f,
                               scratch, sums);
        float t = base;
        if (min_p > 0.f) t = fmaxf(t, logf(min_p));
        if (top_p < 1.f)
            t = fmaxf(t, race_search(row, ok, limit, bval, inv_t, base, 0.f, true, top_p, scratch,
                                     sums));
        float gv = -INFINITY;
        int gi = -1;
        for (int i = threadIdx.x; i < limit; i += blockDim.x) {
            if (ok && !ok[i]) continue;
            float s = race_scaled(row[i], bval, inv_t);
            if (s >= t && s > -INFINITY) {
                float v = __fadd_rn(s, race_gumbel(key, (unsigned)i));
                if (gi < 0 || v > gv) {
                    gv = v;
                    gi = i;
                }
            }
        }
        race_block_argmax(gv, gi, sv, si);
        if (gi >= 0) token = gi;
    }
    if (threadIdx.x == 0) {
        o[0] = __uint_as_float((unsigned)token);
        o[1] = nan ? NAN : raw[token] - lse;
    }
    // The top alternatives: each pass the best after the previous pick (value desc, id asc).
    float pv = INFINITY;
    int pi = -1;
    for (int k = 0; k < top_n && !nan; ++k) {
        float v = -INFINITY;
        int vi = -1;
        for (int i = threadIdx.x; i < limit; i += blockDim.x) {
            float x = raw[i];
            if (pi < 0 || x < pv || (x == pv && i > pi)) race_better(v, vi, x, i);
        }
        race_block_argmax(v, vi, sv, si);
        if (threadIdx.x == 0) {
            o[2 + 2 * k] = __uint_as_float((unsigned)(vi < 0 ? 0 : vi));
            o[3 + 2 * k] = vi < 0 ? -INFINITY : v - lse;
        }
        pv = v;
        pi = vi;
    }
}
