//! CPU attention over the paged KV cache for a ragged batch. Each query token attends to
//! its own sequence's cached positions `0..=pos` read straight from the blocks (no gather,
//! no concatenation, no K/V expansion for grouped-query heads), with rotary embeddings
//! applied in place. Decode rows (1 token) and extend rows (many) share one call.

use crate::config::RopeStyle;
use crate::kv::{BlockTable, LayerKv};

/// One row of a ragged batch as attention sees it.
#[derive(Clone, Copy, Debug)]
pub struct RowSpan {
    /// Offset of the row's first token in the flattened batch.
    pub start: usize,
    /// Number of new tokens.
    pub len: usize,
    /// Positions already cached before this step.
    pub past: usize,
}

/// Precomputed rotary cos/sin per position.
#[derive(Debug)]
pub struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    style: RopeStyle,
    max_pos: usize,
}

impl RopeTable {
    /// The angles as llama.cpp computes them (`ggml_rope_cache_init`): in f32, `theta =
    /// pos` times `base^(-2 / head_dim)` once per pair, `cosf` / `sinf` of each.
    pub fn new(head_dim: usize, theta: f64, max_pos: usize, style: RopeStyle) -> Self {
        let half = head_dim / 2;
        let theta_scale = (theta as f32).powf(-2.0 / head_dim as f32);
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            let mut a = p as f32;
            for _ in 0..half {
                cos.push(a.cos());
                sin.push(a.sin());
                a *= theta_scale;
            }
        }
        Self {
            cos,
            sin,
            half,
            style,
            max_pos,
        }
    }

    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// `(cos, sin, head_dim / 2, style)`: row-major `[max_pos, head_dim / 2]` tables.
    pub fn parts(&self) -> (&[f32], &[f32], usize, RopeStyle) {
        (&self.cos, &self.sin, self.half, self.style)
    }

    /// Rotate one head vector in place for position `pos`.
    #[inline]
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let h = self.half;
        let c = &self.cos[pos * h..(pos + 1) * h];
        let s = &self.sin[pos * h..(pos + 1) * h];
        match self.style {
            RopeStyle::HalfSplit => {
                let (a, b) = x.split_at_mut(h);
                for i in 0..h {
                    (a[i], b[i]) = rotate(a[i], b[i], c[i], s[i]);
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..h {
                    (x[2 * i], x[2 * i + 1]) = rotate(x[2 * i], x[2 * i + 1], c[i], s[i]);
                }
            }
        }
    }
}

/// `(x0 cos - x1 sin, x0 sin + x1 cos)` with the fused multiply-adds GCC makes of
/// llama.cpp's `rotate_pairs` (its first product fused with the other term).
#[inline]
fn rotate(x0: f32, x1: f32, c: f32, s: f32) -> (f32, f32) {
    (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c))
}

/// Output pointer shared by pool workers that write disjoint slices.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: workers only write disjoint ranges (see `paged_attention`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Shapes of one attention layer.
#[derive(Clone, Copy, Debug)]
pub struct HeadDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// ggml's `ggml_vec_dot_f16` order (AVX2): four accumulators of eight lanes over 32-value
/// steps, `acc = fma(a, b, acc)`, then `(acc0 + acc2) + (acc1 + acc3)` and the lanes summed
/// as `(l0 + l4) + (l1 + l5)` plus `(l2 + l6) + (l3 + l7)`; a tail of `n % 32` values is
/// added one by one in f64 as ggml does.
fn dot_f16(a: &[f32], b: &[f32]) -> f32 {
    if let Some(d) = f16_lanes::dot(a, b) {
        return d;
    }
    let n = a.len();
    let np = n - n % 32;
    let mut acc = [[0f32; 8]; 4];
    for i in (0..np).step_by(32) {
        for (j, accj) in acc.iter_mut().enumerate() {
            for (l, s) in accj.iter_mut().enumerate() {
                let e = i + 8 * j + l;
                *s = a[e].mul_add(b[e], *s);
            }
        }
    }
    let x: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = std::array::from_fn(|l| x[l] + x[l + 4]);
    let mut sum = f64::from((t[0] + t[1]) + (t[2] + t[3]));
    for e in np..n {
        sum += f64::from(a[e] * b[e]);
    }
    sum as f32
}

/// `round(f16)` of an f32.
#[inline]
fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The x86-64-v3 build (`.cargo/config.toml`): eight lanes at a time with F16C.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod f16_lanes {
    use std::arch::x86_64::*;

    /// Round eight f32 to f16 precision (to nearest, ties to even, like `f16r`).
    #[inline]
    unsafe fn round(v: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
    }

    /// `o[i] = f16(v[i] * w + o[i])` for the first multiple of eight; returns how many.
    #[inline]
    pub fn mad(o: &mut [f32], v: &[f32], w: f32) -> usize {
        let n = o.len().min(v.len()) / 8 * 8;
        // SAFETY: the target features are enabled for the whole build (cfg above); the
        // loads and stores stay within the first `n` elements of both slices.
        unsafe {
            let w = _mm256_set1_ps(w);
            for c in (0..n).step_by(8) {
                let a = _mm256_loadu_ps(o.as_ptr().add(c));
                let b = _mm256_loadu_ps(v.as_ptr().add(c));
                _mm256_storeu_ps(o.as_mut_ptr().add(c), round(_mm256_fmadd_ps(b, w, a)));
            }
        }
        n
    }

    /// `dot_f16` for lengths that are a multiple of 32 (the same lanes, steps and final
    /// sums), else `None`.
    #[inline]
    pub fn dot(a: &[f32], b: &[f32]) -> Option<f32> {
        if a.len() != b.len() || !a.len().is_multiple_of(32) {
            return None;
        }
        // SAFETY: the target features are enabled for the whole build; loads stay within
        // both slices (a multiple of 32 long).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in (0..a.len()).step_by(32) {
                for (j, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_loadu_ps(a.as_ptr().add(i + 8 * j));
                    let y = _mm256_loadu_ps(b.as_ptr().add(i + 8 * j));
                    *acc = _mm256_fmadd_ps(x, y, *acc);
                }
            }
            let x = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
            let t = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
            let t = _mm_hadd_ps(t, t);
            Some(_mm_cvtss_f32(_mm_hadd_ps(t, t)))
        }
    }

    /// `o[i] = f16(o[i] * s)` for the first multiple of eight; returns how many.
    #[inline]
    pub fn scale(o: &mut [f32], s: f32) -> usize {
        let n = o.len() / 8 * 8;
        // SAFETY: as in `mad`.
        unsafe {
            let s = _mm256_set1_ps(s);
            for c in (0..n).step_by(8) {
                let a = _mm256_loadu_ps(o.as_ptr().add(c));
                _mm256_storeu_ps(o.as_mut_ptr().add(c), round(_mm256_mul_ps(a, s)));
            }
        }
        n
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
mod f16_lanes {
    pub fn dot(_: &[f32], _: &[f32]) -> Option<f32> {
        None
    }
    pub fn mad(_: &mut [f32], _: &[f32], _: f32) -> usize {
        0
    }
    pub fn scale(_: &mut [f32], _: f32) -> usize {
        0
    }
}

/// `o = f16(v * w + o)` (ggml's `ggml_vec_mad_f16`: a fused multiply-add, stored as f16).
fn mad_f16(o: &mut [f32], v: &[f32], w: f32) {
    let done = f16_lanes::mad(o, v, w);
    for (x, v) in o[done..].iter_mut().zip(&v[done..]) {
        *x = f16r(v.mul_add(w, *x));
    }
}

/// `o = f16(o * s)` (ggml's `ggml_vec_scale_f16`).
fn scale_f16(o: &mut [f32], s: f32) {
    let done = f16_lanes::scale(o, s);
    for x in &mut o[done..] {
        *x = f16r(*x * s);
    }
}

/// One query head over `n` cached keys as llama.cpp's CPU flash attention with an f16 KV
/// cache (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`): keys in order, an online
/// softmax in f32 with `expf`, and the weighted sum of values accumulated in f16 (each
/// update `v_acc = f16(v_acc + v * w)`, a rescale `v_acc = f16(v_acc * m)`); `q` and the
/// cached K/V hold f16 values. `base(j)` is key j's offset in `kc` / `vc`.
fn attend_one(
    q: &[f32],
    n: usize,
    base: impl Fn(usize) -> usize,
    kc: &[f32],
    vc: &[f32],
    scale: f32,
    o: &mut [f32],
) {
    let hd = q.len();
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    o.fill(0.0);
    for j in 0..n {
        let at = base(j);
        let s = dot_f16(&kc[at..at + hd], q) * scale + 0.0;
        let (mut ms, mut vs) = (1f32, 1f32);
        if s > m {
            ms = (m - s).exp();
            m = s;
            scale_f16(o, ms);
        } else {
            vs = (s - m).exp();
        }
        mad_f16(o, &vc[at..at + hd], vs);
        // Not fused: llama.cpp's released x86 build computes `S = S*ms + vs` in two steps.
        sum = sum * ms + vs;
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for x in o.iter_mut() {
        *x *= inv;
    }
}

/// Rope q and k, store k/v in the cache, attend. `q`: `[T, heads, hd]`, `k`, `v`:
/// `[T, kv_heads, hd]`; `tables[r]` must already cover `past + len` positions of row r.
/// Returns `[T, heads, hd]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
    rows: &[RowSpan],
    tables: &[&BlockTable],
    block_size: usize,
    cache: &mut LayerKv,
    dims: HeadDims,
    rope: &RopeTable,
) -> Vec<f32> {
    let HeadDims {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
    } = dims;
    let total: usize = rows.iter().map(|r| r.len).sum();
    // token -> (row, absolute position)
    let mut tok_row = Vec::with_capacity(total);
    let mut tok_pos = Vec::with_capacity(total);
    for (ri, r) in rows.iter().enumerate() {
        for i in 0..r.len {
            tok_row.push(ri);
            tok_pos.push(r.past + i);
        }
    }
    // Rope and cache writes are cheap and stay on this thread; the attention loop below runs
    // on candle's own worker pool (a second pool would spin against it for the same cores).
    q.chunks_mut(nh * hd).enumerate().for_each(|(t, qt)| {
        for head in qt.chunks_mut(hd) {
            rope.apply(head, tok_pos[t]);
            // llama.cpp multiplies q with the f16 cache in f16 as well.
            for x in head.iter_mut() {
                *x = half::f16::from_f32(*x).to_f32();
            }
        }
    });
    k.chunks_mut(nkv * hd).enumerate().for_each(|(t, kt)| {
        for head in kt.chunks_mut(hd) {
            rope.apply(head, tok_pos[t]);
        }
    });
    let row_len = nkv * hd;
    // Values are rounded to f16 precision as they enter the cache, like llama.cpp's default
    // f16 KV cache: greedy outputs then track llama.cpp's closely on near-ties.
    let round = |x: &f32| half::f16::from_f32(*x).to_f32();
    for t in 0..total {
        let slot = tables[tok_row[t]].slot(tok_pos[t], block_size);
        let (dst, src) = (slot * row_len, t * row_len);
        for (d, s) in cache.k[dst..dst + row_len]
            .iter_mut()
            .zip(&k[src..src + row_len])
        {
            *d = round(s);
        }
        for (d, s) in cache.v[dst..dst + row_len]
            .iter_mut()
            .zip(&v[src..src + row_len])
        {
            *d = round(s);
        }
    }
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let (kc, vc) = (&cache.k, &cache.v);
    let mut out = vec![0f32; total * nh * hd];
    let out_ptr = SharedOut(out.as_mut_ptr());
    let attend = |idx: usize| {
        let (t, h) = (idx / nh, idx % nh);
        let kvh = h / group;
        let qv = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
        let table = tables[tok_row[t]];
        let n = tok_pos[t] + 1;
        // SAFETY: item `idx` owns output elements idx*hd..(idx+1)*hd exclusively, and `out`
        // outlives the pool call below.
        let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(idx * hd), hd) };
        attend_one(
            qv,
            n,
            |j| table.slot(j, block_size) * row_len + kvh * hd,
            kc,
            vc,
            scale,
            o,
        );
    };
    let items = total * nh;
    if items * (tok_pos.iter().max().copied().unwrap_or(0) + 1) < 4096 {
        (0..items).for_each(attend);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(items, |range| range.for_each(attend));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_f16_sums_in_ggml_order() {
        let a: Vec<f32> = (0..70).map(|i| i as f32 * 0.5 - 9.0).collect();
        let b: Vec<f32> = (0..70).map(|i| 1.0 - i as f32 * 0.03).collect();
        let naive: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
        assert!((f64::from(dot_f16(&a, &b)) - naive).abs() < 1e-3);
        // Lane l of accumulator j holds values 32i + 8j + l; a value placed elsewhere in a
        // 32-value step lands in another lane, which only the order of the final sums sees.
        let mut one = vec![0f32; 64];
        one[9] = 3.0;
        assert_eq!(dot_f16(&one, &vec![2.0; 64]), 6.0);
    }

    #[test]
    fn dot_f16_lanes_match_the_portable_order() {
        let a: Vec<f32> = (0..128).map(|i| f16r((i as f32 * 0.731).sin())).collect();
        let b: Vec<f32> = (0..128).map(|i| f16r((i as f32 * 0.377).cos())).collect();
        let mut acc = [[0f32; 8]; 4];
        for i in (0..128).step_by(32) {
            for (j, accj) in acc.iter_mut().enumerate() {
                for (l, s) in accj.iter_mut().enumerate() {
                    *s = a[i + 8 * j + l].mul_add(b[i + 8 * j + l], *s);
                }
            }
        }
        let x: [f32; 8] =
            std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
        let t: [f32; 4] = std::array::from_fn(|l| x[l] + x[l + 4]);
        assert_eq!(dot_f16(&a, &b), (t[0] + t[1]) + (t[2] + t[3]));
    }

    #[test]
    fn attend_one_is_the_softmax_average_up_to_f16() {
        let (hd, n) = (64, 37);
        let kc: Vec<f32> = (0..n * hd)
            .map(|i| f16r(((i * 7919) % 97) as f32 / 97.0 - 0.5))
            .collect();
        let vc: Vec<f32> = (0..n * hd)
            .map(|i| f16r(((i * 104_729) % 89) as f32 / 89.0 - 0.5))
            .collect();
        let q: Vec<f32> = (0..hd).map(|i| f16r((i as f32 * 0.37).sin())).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut o = vec![0f32; hd];
        attend_one(&q, n, |j| j * hd, &kc, &vc, scale, &mut o);
        let s: Vec<f64> = (0..n)
            .map(|j| {
                let k = &kc[j * hd..(j + 1) * hd];
                k.iter().zip(&q).map(|(a, b)| f64::from(a * b)).sum::<f64>() * f64::from(scale)
            })
            .collect();
        let m = s.iter().cloned().fold(f64::MIN, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for d in 0..hd {
            let want: f64 = (0..n)
                .map(|j| w[j] * f64::from(vc[j * hd + d]))
                .sum::<f64>()
                / z;
            assert!(
                (f64::from(o[d]) - want).abs() < 2e-3,
                "dim {d}: {} vs {want}",
                o[d]
            );
        }
    }

    #[test]
    fn rope_styles_rotate_pairs() {
        let t = RopeTable::new(4, 10_000.0, 4, RopeStyle::HalfSplit);
        let mut x = [1.0, 0.0, 0.0, 0.0];
        t.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        let t = RopeTable::new(4, 10_000.0, 4, RopeStyle::Interleaved);
        let mut x = [1.0, 0.0, 0.0, 0.0];
        t.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
    }
}
