// Paged attention over the block tables (included by fused.cu): split-K first passes — tiles
// with block-wide reductions (`paged_attention_partial_bf16`), per-group online softmax
// (`paged_attention_split_bf16`, optional in-kernel combine), grouped-query attention on
// tensor cores (`paged_attention_mma_bf16_g*_d*`) — and the combine pass.

#define ATTN_TILE 512
#define ATTN_THREADS 128
#define ATTN_CHUNK_MIN 64

// Keys [k0, k1) of split s when a token attends to n keys in `splits` chunks (multiples of
// 16, at least ATTN_CHUNK_MIN; trailing splits may be empty: k0 >= k1).
__device__ __forceinline__ void split_keys(int n, int splits, int s, int& k0, int& k1) {
    int chunk = (n + splits - 1) / splits;
    chunk = max(ATTN_CHUNK_MIN, (chunk + 15) & ~15);
    k0 = s * chunk;
    k1 = min(n, k0 + chunk);
}

// This lane's 8 values of a query head row, times `scale`, as f32.
__device__ __forceinline__ void load_q8(const bf16* __restrict__ q, float scale, float* qr) {
    const uint4 raw = *reinterpret_cast<const uint4*>(q);
    const __nv_bfloat162* q2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 f = __bfloat1622float2(q2[e]);
        qr[2 * e] = f.x * scale;
        qr[2 * e + 1] = f.y * scale;
    }
}

// The partial of a split with no keys: nothing to add in the combine.
__device__ __forceinline__ void mark_empty(float* part_ml, long long pidx) {
    part_ml[2 * pidx] = -INFINITY;
    part_ml[2 * pidx + 1] = 0.f;
}

// Split-K ("flash decoding") paged attention, pass 1. grid (tokens, nh, splits), block
// ATTN_THREADS, shared: see PagedAttention::smem_bytes. Token t of row tok_row[t] (< 0:
// skip) at absolute position pos[t] attends to cache positions 0..=pos[t] of its row
// (causal for extend rows: earlier tokens of the step are already stored). Split s covers
// one chunk of those keys and writes its running max, sum and unnormalised output to
// part_ml / part_acc. Threads work in groups of hd/8 lanes, one 16-byte load each, so a
// key's K or V row is read by one group at a time and many keys are in flight. The last two
// arguments (the split kernel's in-kernel combine) are not used.
extern "C" __global__ void paged_attention_partial_bf16(
    const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ tok_row, const int* __restrict__ pos, float* __restrict__ part_ml,
    float* __restrict__ part_acc, int nh, int nkv, int hd, int block_size, float scale,
    int splits, unsigned int* __restrict__ unused_counters, bf16* __restrict__ unused_out) {
    pdl_begin();
    const int t = blockIdx.x, h = blockIdx.y, s = blockIdx.z, tid = threadIdx.x;
    const int row = tok_row[t];
    if (row < 0) return;
    int k0, k1;
    split_keys(pos[t] + 1, splits, s, k0, k1);
    const long long pidx = ((long long)t * nh + h) * splits + s;
    if (k0 >= k1) {
        if (tid == 0) mark_empty(part_ml, pidx);
        return;
    }
    const int kvh = h / (nh / nkv);
    const int tpr = hd / 8;              // lanes per key row (power of two <= 32)
    const int kg_n = ATTN_THREADS / tpr;  // keys in flight per pass
    const int kg = tid / tpr, ld = tid % tpr;
    extern __shared__ float smem[];
    float* sc = smem;                           // ATTN_TILE
    int* slot_s = (int*)(sc + ATTN_TILE);       // ATTN_TILE
    float* scratch = (float*)(slot_s + ATTN_TILE);  // 32
    float* red = scratch + 32;                  // kg_n * hd
    const long long kv_row = (long long)nkv * hd;
    const int* bt = block_tables + (long long)row * max_blocks;
    float qr[8];
    load_q8(q + ((long long)t * nh + h) * hd + ld * 8, scale, qr);
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.f;
    float m = -INFINITY, l = 0.f;
    const long long head_off = (long long)kvh * hd + ld * 8;
    for (int t0 = k0; t0 < k1; t0 += ATTN_TILE) {
        const int tn = min(ATTN_TILE, k1 - t0);
        for (int j = tid; j < tn; j += ATTN_THREADS) {
            const int p = t0 + j;
            slot_s[j] = bt[p / block_size] * block_size + p % block_size;
        }
        __syncthreads();
        float lmax = -INFINITY;
        // Uniform trip count: every lane takes part in the group's shuffles.
#pragma unroll 4
        for (int jb = 0; jb < tn; jb += kg_n) {
            const int j = jb + kg;
            float part = 0.f;
            if (j < tn) {
                const uint4 raw = *reinterpret_cast<const uint4*>(k_cache + slot_s[j] * kv_row + head_off);
                const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 f = __bfloat1622float2(k2[e]);
                    part += qr[2 * e] * f.x + qr[2 * e + 1] * f.y;
                }
            }
            for (int o = tpr / 2; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffff, part, o);
            if (j < tn) {
                if (ld == 0) sc[j] = part;
                lmax = fmaxf(lmax, part);
            }
        }
        const float m_new = fmaxf(m, block_max(lmax, scratch));
        float lsum = 0.f;
        for (int j = tid; j < tn; j += ATTN_THREADS) {
            const float e = __expf(sc[j] - m_new);
            sc[j] = e;
            lsum += e;
        }
        const float tsum = block_sum(lsum, scratch);
        const float corr = __expf(m - m_new);
        l = l * corr + tsum;
        m = m_new;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= corr;
#pragma unroll 4
        for (int j = kg; j < tn; j += kg_n) {
            const uint4 raw = *reinterpret_cast<const uint4*>(v_cache + slot_s[j] * kv_row + head_off);
            const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
            const float pj = sc[j];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float2 f = __bfloat1622float2(v2[e]);
                acc[2 * e] += pj * f.x;
                acc[2 * e + 1] += pj * f.y;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int e = 0; e < 8; e++) red[kg * hd + ld * 8 + e] = acc[e];
    __syncthreads();
    for (int i = tid; i < hd; i += ATTN_THREADS) {
        float sum = 0.f;
        for (int g = 0; g < kg_n; g++) sum += red[g * hd + i];
        part_acc[pidx * hd + i] = sum;
    }
    if (tid == 0) {
        part_ml[2 * pidx] = m;
        part_ml[2 * pidx + 1] = l;
    }
}

// With `counters` (zeroed, one per (token, head)): the last split block of a (token, head)
// to finish combines all splits into `out`, as paged_attention_combine_bf16 does, and
// zeroes its counter again (graph replays reuse it): one launch less per layer. Partials of
// other blocks are read past L1 (__ldcg), after their writers' fences.
__device__ void combine_if_last(unsigned int* counters, int t, int h, int nh, int hd,
                                int splits, const float* part_ml, const float* part_acc,
                                bf16* out) {
    if (counters == nullptr) return;
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int prev = atomicAdd(&counters[t * nh + h], 1u);
        last = prev == (unsigned int)(splits - 1);
        if (last) counters[t * nh + h] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const long long base = ((long long)t * nh + h) * splits;
    float mx = -INFINITY;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, __ldcg(&part_ml[2 * (base + s)]));
    float total = 0.f;
    for (int s = 0; s < splits; s++) {
        const float ms = __ldcg(&part_ml[2 * (base + s)]);
        if (ms > -INFINITY) total += __ldcg(&part_ml[2 * (base + s) + 1]) * __expf(ms - mx);
    }
    const float inv = 1.f / total;
    bf16* op = out + ((long long)t * nh + h) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < splits; s++) {
            const float ms = __ldcg(&part_ml[2 * (base + s)]);
            if (ms > -INFINITY) o += __ldcg(&part_acc[(base + s) * hd + i]) * __expf(ms - mx);
        }
        op[i] = __float2bfloat16(o * inv);
    }
}

// Pass 1 without tiles (the default): each group of hd/8 lanes owns every kg_n-th key of the
// split's chunk and keeps its own online softmax in registers, loading ATTN_UNROLL keys' K
// and V rows at once, so a short chunk costs about one memory latency instead of a
// sequence of tile phases with block-wide reductions; the groups are merged once at the
// end. Same grid, arguments and outputs as paged_attention_partial_bf16; shared:
// kg_n * (hd + 2) floats.
#define ATTN_UNROLL 8
extern "C" __global__ void paged_attention_split_bf16(
    const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ tok_row, const int* __restrict__ pos, float* __restrict__ part_ml,
    float* __restrict__ part_acc, int nh, int nkv, int hd, int block_size, float scale,
    int splits, unsigned int* __restrict__ counters, bf16* __restrict__ out) {
    pdl_begin();
    const int t = blockIdx.x, h = blockIdx.y, s = blockIdx.z, tid = threadIdx.x;
    const int row = tok_row[t];
    if (row < 0) return;
    int k0, k1;
    split_keys(pos[t] + 1, splits, s, k0, k1);
    const long long pidx = ((long long)t * nh + h) * splits + s;
    if (k0 >= k1) {
        if (tid == 0) mark_empty(part_ml, pidx);
        combine_if_last(counters, t, h, nh, hd, splits, part_ml, part_acc, out);
        return;
    }
    const int kvh = h / (nh / nkv);
    const int tpr = hd / 8;
    const int kg_n = ATTN_THREADS / tpr;
    const int kg = tid / tpr, ld = tid % tpr;
    extern __shared__ float smem[];
    float* red = smem;                 // kg_n * hd
    float* gml = smem + kg_n * hd;     // kg_n * 2
    const long long kv_row = (long long)nkv * hd;
    const int* bt = block_tables + (long long)row * max_blocks;
    const long long head_off = (long long)kvh * hd + ld * 8;
    float qr[8];
    load_q8(q + ((long long)t * nh + h) * hd + ld * 8, scale, qr);
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.f;
    float m = -INFINITY, l = 0.f;
    // Trip count uniform over the block: every lane takes part in the shuffles.
    for (int jb = k0; jb < k1; jb += kg_n * ATTN_UNROLL) {
        uint4 kr[ATTN_UNROLL], vr[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            const int p = jb + kg + u * kg_n;
            if (p < k1) {
                const long long slot = (long long)bt[p / block_size] * block_size + p % block_size;
                kr[u] = *reinterpret_cast<const uint4*>(k_cache + slot * kv_row + head_off);
                vr[u] = *reinterpret_cast<const uint4*>(v_cache + slot * kv_row + head_off);
            } else {
                kr[u] = make_uint4(0, 0, 0, 0);
                vr[u] = make_uint4(0, 0, 0, 0);
            }
        }
        float sc[ATTN_UNROLL];
        float mx = m;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&kr[u]);
            float part = 0.f;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float2 f = __bfloat1622float2(k2[e]);
                part += qr[2 * e] * f.x + qr[2 * e + 1] * f.y;
            }
            for (int o = tpr / 2; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffff, part, o);
            sc[u] = jb + kg + u * kg_n < k1 ? part : -INFINITY;
            mx = fmaxf(mx, sc[u]);
        }
        if (mx == -INFINITY) continue;  // this group has no key in this pass
        const float corr = __expf(m - mx);
        l *= corr;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= corr;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            const float pu = __expf(sc[u] - mx);
            l += pu;
            const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&vr[u]);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float2 f = __bfloat1622float2(v2[e]);
                acc[2 * e] += pu * f.x;
                acc[2 * e + 1] += pu * f.y;
            }
        }
        m = mx;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) red[kg * hd + ld * 8 + e] = acc[e];
    if (ld == 0) {
        gml[2 * kg] = m;
        gml[2 * kg + 1] = l;
    }
    __syncthreads();
    float mt = -INFINITY;
    for (int g = 0; g < kg_n; g++) mt = fmaxf(mt, gml[2 * g]);
    for (int i = tid; i < hd; i += ATTN_THREADS) {
        float sum = 0.f;
        for (int g = 0; g < kg_n; g++)
            if (gml[2 * g] > -INFINITY) sum += red[g * hd + i] * __expf(gml[2 * g] - mt);
        part_acc[pidx * hd + i] = sum;
    }
    if (tid == 0) {
        float lt = 0.f;
        for (int g = 0; g < kg_n; g++)
            if (gml[2 * g] > -INFINITY) lt += gml[2 * g + 1] * __expf(gml[2 * g] - mt);
        part_ml[2 * pidx] = mt;
        part_ml[2 * pidx + 1] = lt;
    }
    combine_if_last(counters, t, h, nh, hd, splits, part_ml, part_acc, out);
}

// Pass 1 on tensor cores for grouped-query attention (mma.m16n8k16, bf16 in, f32 out): one
// block per (token, KV head, split), the G <= 8 query heads sharing the KV head are the rows
// of the A operand (padded to 16). Each warp takes 16 keys at a time: S = Q K^T as two 8-key
// tiles, an online softmax per head row, then O += P V with P taken straight from S's
// accumulators (the C fragment of two 8-key tiles is the A fragment of one 16-key mma).
// The CUDA-core kernels spend ~270 us per layer on 32 tokens of Qwen3-32B (64 heads, 1024
// keys): ~4 TFLOP/s of dot products, far from any memory limit.
//
// Both products sum over an index whose order we choose: in Q K^T (head dims) thread t of a
// quad loads 16-byte runs of a K row (dims 8t + 32j ..) and the same dims of Q, and feeds
// their bf16 pairs to the mma slices (slice 2j + b takes words 2b (k 2t, 2t+1) and 2b + 1 (k
// 2t + 8, 2t + 9) of run j); in P V the n index (output dims) is permuted so that thread g
// loads a contiguous run of a V row: column g of n-tile j is dim g * HD/8 + j.
//
// grid (tokens, nh / G, splits), block 128 (4 warps; their states are merged at the end),
// shared: 4 * G * (HD + 2) floats. Outputs as paged_attention_partial_bf16.
__device__ __forceinline__ void mma_16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// The bf16 at index i (0..7) of a 16-byte run.
__device__ __forceinline__ uint32_t bf16_bits(const uint4& v, int i) {
    const uint32_t w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
    return (i & 1) ? (w >> 16) : (w & 0xffff);
}

template <int G, int HD>
__device__ void attention_mma(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                              const bf16* __restrict__ v_cache,
                              const int* __restrict__ block_tables, int max_blocks,
                              const int* __restrict__ tok_row, const int* __restrict__ pos,
                              float* __restrict__ part_ml, float* __restrict__ part_acc, int nh,
                              int nkv, int block_size, float scale, int splits) {
    constexpr int NJ = HD / 32;   // 16-byte runs of a K row per thread
    constexpr int NT = HD / 8;    // n-tiles of P V
    constexpr int VR = HD / 8;    // V elements per thread and key (NT)
    const int t = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const long long kv_row = (long long)nkv * HD;
    // Positions and block tables come from the host, and the cached keys are not written by
    // the previous kernel (it stores the step's own): start reading this chunk's first K/V
    // rows, the block's share of the prefetch budget.
    const int row = tok_row[t];
    int k0 = 0, k1 = 0;
    if (row >= 0) {
        split_keys(pos[t] + 1, splits, s, k0, k1);
        const int* bt = block_tables + (long long)row * max_blocks;
        const long long blocks = (long long)gridDim.x * gridDim.y * gridDim.z;
        const int keys = (int)min((long long)(k1 - k0), PDL_PREFETCH_BUDGET / (blocks * 4 * HD));
        for (int p = k0 + threadIdx.x; p < k0 + keys; p += blockDim.x) {
            const long long at =
                ((long long)bt[p / block_size] * block_size + p % block_size) * kv_row +
                (long long)kvh * HD;
            prefetch_l2(k_cache + at, HD * 2);
            prefetch_l2(v_cache + at, HD * 2);
        }
    }
    pdl_begin();
    if (row < 0) return;
    const long long pbase = ((long long)t * nh + kvh * G) * splits + s;  // + gi * splits
    if (k0 >= k1) {
        if (threadIdx.x < G) {
            part_ml[2 * (pbase + threadIdx.x * splits)] = -INFINITY;
            part_ml[2 * (pbase + threadIdx.x * splits) + 1] = 0.f;
        }
        return;
    }
    const int* bt = block_tables + (long long)row * max_blocks;
    // Q fragments: row g is query head kvh * G + g (rows >= G are zero padding).
    uint32_t qa[2 * NJ][2];
    {
        const bool real = g < G;
        const bf16* qp = q + ((long long)t * nh + kvh * G + (real ? g : 0)) * HD;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            uint4 v = real ? *reinterpret_cast<const uint4*>(qp + 8 * tq + 32 * j)
                           : make_uint4(0, 0, 0, 0);
            qa[2 * j][0] = v.x;
            qa[2 * j][1] = v.y;
            qa[2 * j + 1][0] = v.z;
            qa[2 * j + 1][1] = v.w;
        }
    }
    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m = -INFINITY, l = 0.f;  // head g's running max and this thread's share of the sum
    auto slot_of = [&](int p) -> long long {
        return (long long)bt[p / block_size] * block_size + p % block_size;
    };
    for (int kb = k0 + 16 * warp; kb < k1; kb += 64) {
        // K rows kb + g (tile 0) and kb + 8 + g (tile 1); V rows kb + 2tq + {0, 1, 8, 9}.
        uint4 kr[2][NJ];
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++) {
            const int p = kb + 8 * h2 + g;
            if (p < k1) {
                const bf16* kp = k_cache + slot_of(p) * kv_row + (long long)kvh * HD + 8 * tq;
#pragma unroll
                for (int j = 0; j < NJ; j++) kr[h2][j] = *reinterpret_cast<const uint4*>(kp + 32 * j);
            } else {
#pragma unroll
                for (int j = 0; j < NJ; j++) kr[h2][j] = make_uint4(0, 0, 0, 0);
            }
        }
        uint4 vr[4][VR / 8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int p = kb + 2 * tq + (i & 1) + 8 * (i >> 1);
            if (p < k1) {
                const bf16* vp = v_cache + slot_of(p) * kv_row + (long long)kvh * HD + g * VR;
#pragma unroll
                for (int j = 0; j < VR / 8; j++) vr[i][j] = *reinterpret_cast<const uint4*>(vp + 8 * j);
            } else {
#pragma unroll
                for (int j = 0; j < VR / 8; j++) vr[i][j] = make_uint4(0, 0, 0, 0);
            }
        }
        // S tiles: sc[h2] = (head g, keys kb + 8 h2 + 2tq, +1), (head g + 8, same keys).
        float sc[2][4];
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++) {
            sc[h2][0] = sc[h2][1] = sc[h2][2] = sc[h2][3] = 0.f;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const uint4 kv = kr[h2][j];
                mma_16816(sc[h2], qa[2 * j][0], 0u, qa[2 * j][1], 0u, kv.x, kv.y);
                mma_16816(sc[h2], qa[2 * j + 1][0], 0u, qa[2 * j + 1][1], 0u, kv.z, kv.w);
            }
        }
        float mx = m;
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int p = kb + 8 * h2 + 2 * tq + e;
                sc[h2][e] = p < k1 ? sc[h2][e] * scale : -INFINITY;
                mx = fmaxf(mx, sc[h2][e]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        // Every key of this warp's tile is past the end only on the chunk's last tile, where
        // it is the same for the whole warp: nothing to add.
        if (mx == -INFINITY) continue;
        const float corr = __expf(m - mx);
        m = mx;
        l *= corr;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            o[j][0] *= corr;
            o[j][1] *= corr;
        }
        float pr[2][2];
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                pr[h2][e] = __expf(sc[h2][e] - mx);
                l += pr[h2][e];
            }
        const uint32_t pa0 = pack_bf16(pr[0][0], pr[0][1]);
        const uint32_t pa2 = pack_bf16(pr[1][0], pr[1][1]);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            // Column g of n-tile j: dim g * VR + j, element j of this thread's V runs.
            const uint32_t b0 = bf16_bits(vr[0][j / 8], j % 8) | (bf16_bits(vr[1][j / 8], j % 8) << 16);
            const uint32_t b1 = bf16_bits(vr[2][j / 8], j % 8) | (bf16_bits(vr[3][j / 8], j % 8) << 16);
            mma_16816(o[j], pa0, 0u, pa2, 0u, b0, b1);
        }
    }
    // Merge the 4 warps' states per head through shared memory.
    extern __shared__ float mma_merge[];
    float* red = mma_merge;              // [4][G][HD]
    float* gml = mma_merge + 4 * G * HD; // [4][G][2]
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    if (g < G) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            red[(warp * G + g) * HD + (2 * tq) * VR + j] = o[j][0];
            red[(warp * G + g) * HD + (2 * tq + 1) * VR + j] = o[j][1];
        }
        if (tq == 0) {
            gml[2 * (warp * G + g)] = m;
            gml[2 * (warp * G + g) + 1] = l;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int gi = i / HD, d = i % HD;
        float mt = -INFINITY;
        for (int w = 0; w < 4; w++) mt = fmaxf(mt, gml[2 * (w * G + gi)]);
        float sum = 0.f;
        for (int w = 0; w < 4; w++) {
            const float mw = gml[2 * (w * G + gi)];
            if (mw > -INFINITY) sum += red[(w * G + gi) * HD + d] * __expf(mw - mt);
        }
        part_acc[(pbase + gi * splits) * HD + d] = sum;
    }
    if (threadIdx.x < G) {
        const int gi = threadIdx.x;
        float mt = -INFINITY, lt = 0.f;
        for (int w = 0; w < 4; w++) mt = fmaxf(mt, gml[2 * (w * G + gi)]);
        for (int w = 0; w < 4; w++) {
            const float mw = gml[2 * (w * G + gi)];
            if (mw > -INFINITY) lt += gml[2 * (w * G + gi) + 1] * __expf(mw - mt);
        }
        part_ml[2 * (pbase + gi * splits)] = mt;
        part_ml[2 * (pbase + gi * splits) + 1] = lt;
    }
}

// Kernel names paged_attention_mma_bf16_g{G}_d{HD}; same arguments as the other first passes
// (hd is the template's; the in-kernel combine's counters/out are not used).
#define ATTN_MMA(G, HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(128) paged_attention_mma_bf16_g##G##_d##HD( \
        const bf16* __restrict__ q, const bf16* __restrict__ k_cache,                       \
        const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,             \
        int max_blocks, const int* __restrict__ tok_row, const int* __restrict__ pos,       \
        float* __restrict__ part_ml, float* __restrict__ part_acc, int nh, int nkv, int hd, \
        int block_size, float scale, int splits, unsigned int* __restrict__ unused_counters,\
        bf16* __restrict__ unused_out) {                                                    \
        attention_mma<G, HD>(q, k_cache, v_cache, block_tables, max_blocks, tok_row, pos,   \
                             part_ml, part_acc, nh, nkv, block_size, scale, splits);        \
    }
ATTN_MMA(2, 64)
ATTN_MMA(3, 64)
ATTN_MMA(4, 64)
ATTN_MMA(5, 64)
ATTN_MMA(6, 64)
ATTN_MMA(7, 64)
ATTN_MMA(8, 64)
ATTN_MMA(2, 128)
ATTN_MMA(3, 128)
ATTN_MMA(4, 128)
ATTN_MMA(5, 128)
ATTN_MMA(6, 128)
ATTN_MMA(7, 128)
ATTN_MMA(8, 128)

// Pass 2: combine the splits of each (token, head). grid (tokens, nh), block 128.
extern "C" __global__ void paged_attention_combine_bf16(
    const int* __restrict__ tok_row, const float* __restrict__ part_ml,
    const float* __restrict__ part_acc, bf16* __restrict__ out, int nh, int hd, int splits) {
    pdl_begin();
    const int t = blockIdx.x, h = blockIdx.y;
    if (tok_row[t] < 0) return;
    const long long base = ((long long)t * nh + h) * splits;
    float mx = -INFINITY;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_ml[2 * (base + s)]);
    float total = 0.f;
    for (int s = 0; s < splits; s++) {
        const float ms = part_ml[2 * (base + s)];
        if (ms > -INFINITY) total += part_ml[2 * (base + s) + 1] * __expf(ms - mx);
    }
    const float inv = 1.f / total;
    bf16* op = out + ((long long)t * nh + h) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < splits; s++) {
            const float ms = part_ml[2 * (base + s)];
            if (ms > -INFINITY) o += part_acc[(base + s) * hd + i] * __expf(ms - mx);
        }
        op[i] = __float2bfloat16(o * inv);
    }
}
