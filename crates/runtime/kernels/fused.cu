// Fused bf16 kernels for the CUDA decode/extend step (compiled to PTX by build.rs when the
// `cuda` feature is on; launched from src/cuda/kernels.rs). They replace ~25 small candle ops
// per layer: the step of a small model is bound by kernel launches, and the gather-based
// attention copied every row's K/V per layer.
//
//   qk_norm_rope_store: per token and head, optional RMSNorm of q/k heads (Qwen3), RoPE, and
//                       the new K/V written into their paged-cache slots; q goes to q_out.
//   paged_attention:    split-K over the context (first pass + combine kernels): reads K/V
//                       in place through the row's block table, online softmax in f32
//                       (attention.cuh);
//   gemv:               skinny matmuls for decode steps, with neighbouring ops folded in
//                       (gemv.cuh).
//   silu_mul:           silu(gate) * up from the fused gate_up projection.
//   add_rms_norm:       residual add (in place) followed by RMSNorm of the sum.
//   sample_rows:        one token per row drawn where the logits are (sample.cuh).

#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

// Programmatic dependent launch (sm_90+; the launcher sets the launch attribute, see
// cuda/kernels.rs `launch_kernel`). Before `pdl_wait()` a kernel touches nothing the
// previous kernel in the stream writes: the wait blocks until that kernel has finished and
// its writes are visible (a no-op for a kernel launched without the attribute).
// `pdl_trigger()` lets the next kernel's blocks be scheduled (once every block of this one
// has triggered or exited), so its launch and prologue (a matmul's weight prefetch) overlap
// this kernel's work instead of following it.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The usual start: wait for the previous kernel, then let the next one launch.
__device__ __forceinline__ void pdl_begin() {
    pdl_wait();
    pdl_trigger();
}

// Bytes a kernel prefetches into L2 before its wait, at most: a third of the H100/H200 L2,
// so the prefetched lines outlive the previous kernel's (<= as many) bytes streamed meanwhile.
#define PDL_PREFETCH_BUDGET (16u << 20)

// Bring `bytes` (a multiple of 16, 16-byte aligned) at `p` into L2 without waiting.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Prefetch the start of one of `rows` rows of `bytes` each that a kernel's blocks read
// first: its share of PDL_PREFETCH_BUDGET (16-byte multiple), nothing below 16 bytes.
__device__ __forceinline__ void prefetch_share(const void* p, long long bytes, long long rows) {
    long long cap = (long long)PDL_PREFETCH_BUDGET / (rows > 0 ? rows : 1);
    if (cap < bytes) bytes = cap;
    bytes &= ~15ll;
    if (bytes >= 16) prefetch_l2(p, (unsigned)bytes);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// All threads get the result. blockDim.x must be a multiple of 32; scratch >= 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : -INFINITY;
    v = warp_max(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float round_bf16(float x) {
    return __bfloat162float(__float2bfloat16(x));
}

// grid (tokens, nh + 2 * nkv), block 128, shared (hd + 32) floats.
// q/k/v rows of token t start at q + t * in_stride (etc.); slots[t] < 0: do not store K/V.
extern "C" __global__ void qk_norm_rope_store_bf16(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
    long long in_stride, const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm,
    float eps, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    const int* __restrict__ pos, const int* __restrict__ slots, bf16* __restrict__ q_out,
    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int nh, int nkv, int hd,
    int interleaved) {
    pdl_begin();
    extern __shared__ float smem[];
    float* x = smem;
    float* scratch = smem + hd;
    const int t = blockIdx.x, h = blockIdx.y, half = hd / 2;
    const int slot = slots[t];
    const bf16* src;
    const bf16* w = nullptr;
    bf16* dst;
    bool rope = true;
    if (h < nh) {
        src = q + t * in_stride + (long long)h * hd;
        w = q_norm;
        dst = q_out + ((long long)t * nh + h) * hd;
    } else if (h < nh + nkv) {
        if (slot < 0) return;
        const int kh = h - nh;
        src = k + t * in_stride + (long long)kh * hd;
        w = k_norm;
        dst = k_cache + ((long long)slot * nkv + kh) * hd;
    } else {
        if (slot < 0) return;
        const int vh = h - nh - nkv;
        src = v + t * in_stride + (long long)vh * hd;
        dst = v_cache + ((long long)slot * nkv + vh) * hd;
        rope = false;
    }
    if (!rope) {
        for (int i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = src[i];
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        const float f = __bfloat162float(src[i]);
        x[i] = f;
        ss += f * f;
    }
    if (w != nullptr) {
        // Like HF's Qwen3RMSNorm: normalise in f32, round to bf16, then scale.
        const float r = rsqrtf(block_sum(ss, scratch) / hd + eps);
        for (int i = threadIdx.x; i < hd; i += blockDim.x)
            x[i] = round_bf16(round_bf16(x[i] * r) * __bfloat162float(w[i]));
    }
    __syncthreads();
    const float* c = cos_t + (long long)pos[t] * half;
    const float* s = sin_t + (long long)pos[t] * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int a = interleaved ? 2 * i : i;
        const int b = interleaved ? 2 * i + 1 : i + half;
        const float xa = x[a], xb = x[b];
        dst[a] = __float2bfloat16(xa * c[i] - xb * s[i]);
        dst[b] = __float2bfloat16(xb * c[i] + xa * s[i]);
    }
}

#include "attention.cuh"

// out[t, i] = silu(gu[t, i]) * gu[t, inter + i]; rounding like HF's bf16 `act(gate) * up`.
extern "C" __global__ void silu_mul_bf16(const bf16* __restrict__ gu, bf16* __restrict__ out,
                                         long long tokens, long long inter) {
    pdl_begin();
    const long long total = tokens * inter;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / inter, i = idx % inter;
        const float g = __bfloat162float(gu[t * 2 * inter + i]);
        const float u = __bfloat162float(gu[t * 2 * inter + inter + i]);
        out[idx] = __float2bfloat16(round_bf16(g / (1.f + __expf(-g))) * u);
    }
}

__device__ __forceinline__ void unpack8(const uint4 raw, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 v = __bfloat1622float2(h[e]);
        f[2 * e] = v.x;
        f[2 * e + 1] = v.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; e++) h[e] = __floats2bfloat162_rn(f[2 * e], f[2 * e + 1]);
    return raw;
}

#define ROW_BATCH 4
// The norm rows' first pass, 16-byte loads (n % 8 == 0): the sum of squares of this thread's
// values of the row x (chunks of 8: tid, tid + blockDim, ...; always summed in that order,
// so every kernel using it gets the same norm), with y: x += y first (rounded to bf16 like
// the bf16 residual stream, written back), with buf: the values kept there. Loads are issued
// ROW_BATCH chunks at a time before their use: a 5120-wide row costs a few memory latencies
// instead of one per element.
__device__ float row_sumsq8(bf16* x, const bf16* y, float* buf, int n) {
    const int chunks = n / 8;
    float ss = 0.f;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += ROW_BATCH * blockDim.x) {
        uint4 xr[ROW_BATCH], yr[ROW_BATCH];
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            const int c = c0 + u * blockDim.x;
            if (c < chunks) {
                xr[u] = reinterpret_cast<const uint4*>(x)[c];
                if (y != nullptr) yr[u] = reinterpret_cast<const uint4*>(y)[c];
            }
        }
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            const int c = c0 + u * blockDim.x;
            if (c >= chunks) break;
            float v[8];
            unpack8(xr[u], v);
            if (y != nullptr) {
                float d[8];
                unpack8(yr[u], d);
#pragma unroll
                for (int e = 0; e < 8; e++) v[e] = round_bf16(v[e] + d[e]);
                reinterpret_cast<uint4*>(x)[c] = pack8(v);
            }
#pragma unroll
            for (int e = 0; e < 8; e++) {
                if (buf != nullptr) buf[c * 8 + e] = v[e];
                ss += v[e] * v[e];
            }
        }
    }
    return ss;
}

// The norm rows' second pass, 16-byte loads: out = bf16(round_bf16(v * r) * w) for the row's
// values v (from buf if given, else read from x).
__device__ void row_scale8(const bf16* x, const float* buf, const bf16* __restrict__ w,
                           float r, bf16* out, int n) {
    const int chunks = n / 8;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += ROW_BATCH * blockDim.x) {
        uint4 xr[ROW_BATCH], wr[ROW_BATCH];
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            const int c = c0 + u * blockDim.x;
            if (c < chunks) {
                if (buf == nullptr) xr[u] = reinterpret_cast<const uint4*>(x)[c];
                wr[u] = reinterpret_cast<const uint4*>(w)[c];
            }
        }
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            const int c = c0 + u * blockDim.x;
            if (c >= chunks) break;
            float v[8], g[8];
            if (buf == nullptr) {
                unpack8(xr[u], v);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) v[e] = buf[c * 8 + e];
            }
            unpack8(wr[u], g);
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = round_bf16(v[e] * r) * g[e];
            reinterpret_cast<uint4*>(out)[c] = pack8(v);
        }
    }
}

// grid (tokens), block 256, shared (hidden + 32) floats. With y != null: x += y in place
// (rounded to bf16 like the bf16 residual stream); then out = RMSNorm(x) * w. Rows of a
// multiple of 8 values take the 16-byte passes above.
extern "C" __global__ void add_rms_norm_bf16(bf16* __restrict__ x, const bf16* __restrict__ y,
                                             const bf16* __restrict__ w, bf16* __restrict__ out,
                                             int hidden, float eps) {
    pdl_begin();
    extern __shared__ float smem[];
    float* buf = smem;
    float* scratch = smem + hidden;
    const long long base = (long long)blockIdx.x * hidden;
    if (hidden % 8 == 0) {
        const float ss = row_sumsq8(x + base, y == nullptr ? nullptr : y + base, buf, hidden);
        const float r = rsqrtf(block_sum(ss, scratch) / hidden + eps);
        row_scale8(nullptr, buf, w, r, out + base, hidden);
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = __bfloat162float(x[base + i]);
        if (y != nullptr) {
            v = round_bf16(v + __bfloat162float(y[base + i]));
            x[base + i] = __float2bfloat16(v);
        }
        buf[i] = v;
        ss += v * v;
    }
    const float r = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[base + i] = __float2bfloat16(round_bf16(buf[i] * r) * __bfloat162float(w[i]));
}

// grid (tokens), block 256: out[t] = weight[ids[t]] (token embeddings from ids in device
// memory, so CUDA graphs can replay with new ids).
extern "C" __global__ void embed_gather_bf16(const bf16* __restrict__ weight,
                                             const int* __restrict__ ids, bf16* __restrict__ out,
                                             int hidden) {
    pdl_begin();
    const long long t = blockIdx.x;
    const bf16* src = weight + (long long)ids[t] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[t * hidden + i] = src[i];
}

#include "gemv.cuh"
#include "sample.cuh"
