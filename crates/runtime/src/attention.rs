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

/// Output pointer shared by pool workers that write disjoint slices (attention here, the
/// element-wise ops in `ggml_ops`).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: every user has its workers write disjoint ranges (`paged_attention`,
// `ggml_ops::par_fill`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub(crate) fn get(self) -> *mut f32 {
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
#[inline]
fn dot_f16(a: &[u16], b: &[f32]) -> f32 {
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
                *s = from_bits(a[e]).mul_add(b[e], *s);
            }
        }
    }
    let x: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = std::array::from_fn(|l| x[l] + x[l + 4]);
    let mut sum = f64::from((t[0] + t[1]) + (t[2] + t[3]));
    for e in np..n {
        sum += f64::from(from_bits(a[e]) * b[e]);
    }
    sum as f32
}

/// The f32 value of f16 bits (a cache entry).
#[inline]
fn from_bits(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// `round(f16)` of an f32.
#[inline]
fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

mod f16_lanes;

/// How many keys ahead `attend_group` fetches cached rows.
const PREFETCH_KEYS: usize = 8;

/// Keys per block: one block's cached K (or V) rows of one head, 16 KB at head size 128,
/// stay in L1 while every query head of the group passes over them.
const KEY_BLOCK: usize = 32;

/// The query heads `q` (`g` heads of `hd` values, all reading one KV head) of one token over
/// `n` cached keys, into `o` (`g * hd`), each head as llama.cpp's CPU flash attention with
/// an f16 KV cache (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`): keys in order, an
/// online softmax in f32 with `expf`, and the weighted sum of values accumulated in f16
/// (each update `v_acc = f16(v_acc + v * w)`, a rescale `v_acc = f16(v_acc * m)` when the
/// maximum grows); `q` and the cached K/V hold f16 values. `base(j)` is key j's offset in
/// `kc` / `vc`.
///
/// llama.cpp takes one head and one key at a time through all three steps. The same
/// arithmetic runs here in three passes: all scores, the softmax weights (the only
/// sequential scalar chain), then the weighted values with the accumulator in registers
/// across a block of keys; and the heads of a group take each block of cached rows in turn
/// while it is in L1 (head by head, each head streamed the whole cache from L3). Every
/// output lane sees the same operations in the same order.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    q: &[f32],
    hd: usize,
    n: usize,
    base: impl Fn(usize) -> usize,
    kc: &[u16],
    vc: &[u16],
    scale: f32,
    o: &mut [f32],
) {
    let g = q.len() / hd;
    // Every pass and head reads key j's offset: look each up once (a paged cache's lookup
    // divides by the block size, and a division per head and pass cost more than the
    // arithmetic it fed).
    let offsets: Vec<usize> = (0..n).map(base).collect();
    let base = |j: usize| offsets[j];
    // Cached rows are short strided runs scattered over the cache's blocks, too irregular
    // for the hardware prefetcher: the first head's pass fetches a few keys ahead.
    let ahead = |j: usize| (j + PREFETCH_KEYS < n).then(|| base(j + PREFETCH_KEYS));
    // Scores, `vs[h * n + j]`, then turned into weights in place.
    let mut vs = vec![0f32; g * n];
    for start in (0..n).step_by(KEY_BLOCK) {
        let keys = start..n.min(start + KEY_BLOCK);
        for (h, qh) in q.chunks_exact(hd).enumerate() {
            for j in keys.clone() {
                if let Some(at) = ahead(j).filter(|_| h == 0) {
                    f16_lanes::prefetch(&kc[at..at + hd]);
                }
                let at = base(j);
                vs[h * n + j] = dot_f16(&kc[at..at + hd], qh) * scale + 0.0;
            }
        }
    }
    // `ms[h * n + j]`: the rescale before key j's value is added to head h (1.0, an
    // identity on f16 values, where the maximum did not grow); `vs`: the weights.
    let mut ms = vec![1f32; g * n];
    let mut sums = vec![0f32; g];
    for ((vs, ms), sum) in vs
        .chunks_mut(n.max(1))
        .zip(ms.chunks_mut(n.max(1)))
        .zip(&mut sums)
    {
        let mut m = f32::NEG_INFINITY;
        for (s, r) in vs.iter_mut().zip(ms.iter_mut()) {
            if *s > m {
                *r = (m - *s).exp();
                m = *s;
                *s = 1.0;
            } else {
                *s = (*s - m).exp();
            }
            // Not fused: llama.cpp's released x86 build computes `S = S*ms + vs` in two
            // steps.
            *sum = *sum * *r + *s;
        }
    }
    let value = |j: usize| {
        let at = base(j);
        &vc[at..at + hd]
    };
    let value_ahead = |j: usize| ahead(j).map(|at| &vc[at..at + hd]);
    o.fill(0.0);
    for start in (0..n).step_by(KEY_BLOCK) {
        let keys = start..n.min(start + KEY_BLOCK);
        for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
            let (ms, vs) = (&ms[h * n..(h + 1) * n], &vs[h * n..(h + 1) * n]);
            let ahead = |j: usize| value_ahead(j).filter(|_| h == 0);
            let done = f16_lanes::weigh_values(oh, keys.clone(), &value, &ahead, ms, vs);
            let rest = &mut oh[done..];
            for j in keys.clone() {
                if ms[j] != 1.0 {
                    for x in rest.iter_mut() {
                        *x = f16r(*x * ms[j]);
                    }
                }
                for (x, &v) in rest.iter_mut().zip(&value(j)[done..]) {
                    *x = f16r(from_bits(v).mul_add(vs[j], *x));
                }
            }
        }
    }
    for (oh, sum) in o.chunks_exact_mut(hd).zip(sums) {
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        for x in oh.iter_mut() {
            *x *= inv;
        }
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
    // Values are stored as f16 as they enter the cache, like llama.cpp's default f16 KV
    // cache: greedy outputs then track llama.cpp's closely on near-ties.
    let to_f16 = |x: &f32| half::f16::from_f32(*x).to_bits();
    for t in 0..total {
        let slot = tables[tok_row[t]].slot(tok_pos[t], block_size);
        let (dst, src) = (slot * row_len, t * row_len);
        for (d, s) in cache.k[dst..dst + row_len]
            .iter_mut()
            .zip(&k[src..src + row_len])
        {
            *d = to_f16(s);
        }
        for (d, s) in cache.v[dst..dst + row_len]
            .iter_mut()
            .zip(&v[src..src + row_len])
        {
            *d = to_f16(s);
        }
    }
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let (kc, vc) = (&cache.k, &cache.v);
    let mut out = vec![0f32; total * nh * hd];
    let out_ptr = SharedOut(out.as_mut_ptr());
    // A work item: `per` consecutive query heads of one token sharing a KV head (they
    // pass over its cached rows together); as many per item as still leaves every thread
    // an item.
    let threads = candle_core::utils::get_num_threads();
    let per = (1..=group)
        .rev()
        .find(|p| group % p == 0 && total * nh / p >= threads)
        .unwrap_or(1);
    let attend = |item: usize| {
        let (t, h) = (item * per / nh, item * per % nh);
        let kvh = h / group;
        let heads = (t * nh + h) * hd..(t * nh + h + per) * hd;
        let table = tables[tok_row[t]];
        // SAFETY: item `item` owns the output elements of its heads exclusively, and `out`
        // outlives the pool call below.
        let o =
            unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(heads.start), heads.len()) };
        attend_group(
            &q[heads],
            hd,
            tok_pos[t] + 1,
            |j| table.slot(j, block_size) * row_len + kvh * hd,
            kc,
            vc,
            scale,
            o,
        );
    };
    let items = total * nh / per;
    if total * nh * (tok_pos.iter().max().copied().unwrap_or(0) + 1) < 4096 {
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
        assert!((f64::from(dot_f16(&bits(&a), &b)) - naive).abs() < 1e-3);
        // Lane l of accumulator j holds values 32i + 8j + l; a value placed elsewhere in a
        // 32-value step lands in another lane, which only the order of the final sums sees.
        let mut one = vec![0f32; 64];
        one[9] = 3.0;
        assert_eq!(dot_f16(&bits(&one), &vec![2.0; 64]), 6.0);
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
        assert_eq!(dot_f16(&bits(&a), &b), (t[0] + t[1]) + (t[2] + t[3]));
    }

    /// llama.cpp's loop as written: one key at a time through score, softmax step and
    /// value update (scalar, `f16r` after every update).
    fn attend_stepwise(q: &[f32], kc: &[f32], vc: &[f32], scale: f32) -> Vec<f32> {
        let hd = q.len();
        let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
        let mut o = vec![0f32; hd];
        for (k, v) in kc.chunks_exact(hd).zip(vc.chunks_exact(hd)) {
            let s = dot_f16(&bits(k), q) * scale + 0.0;
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > m {
                ms = (m - s).exp();
                m = s;
                o.iter_mut().for_each(|x| *x = f16r(*x * ms));
            } else {
                vs = (s - m).exp();
            }
            for (x, v) in o.iter_mut().zip(v) {
                *x = f16r(v.mul_add(vs, *x));
            }
            sum = sum * ms + vs;
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        o.iter().map(|x| x * inv).collect()
    }

    #[test]
    fn attend_group_equals_the_stepwise_loop_bit_for_bit() {
        // Head sizes with and without a 64-lane remainder; keys whose scores rise now and
        // then (rescales mid-sequence) and repeat (equal scores).
        for (hd, n) in [(64, 1), (64, 37), (128, 300), (80, 19), (96, 64), (32, 9)] {
            let kc: Vec<f32> = (0..n * hd)
                .map(|i| f16r(((i * 7919) % 97) as f32 / 40.0 - 1.2 + (i / hd % 7) as f32 * 0.1))
                .collect();
            let vc = cache_values(n * hd, 104_729, 89, 0);
            let q: Vec<f32> = (0..hd)
                .map(|i| f16r((i as f32 * 0.37).sin() * 2.0))
                .collect();
            let scale = 1.0 / (hd as f32).sqrt();
            // Three query heads over the same keys (a grouped-query group), as the second
            // head alone would see them.
            let q3: Vec<f32> = [q.clone(), q.iter().map(|x| -x).collect(), q.clone()].concat();
            let mut o = vec![f32::NAN; 3 * hd];
            attend_group(
                &q3,
                hd,
                n,
                |j| j * hd,
                &bits(&kc),
                &bits(&vc),
                scale,
                &mut o,
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (h, oh) in o.chunks_exact(hd).enumerate() {
                let want = attend_stepwise(&q3[h * hd..(h + 1) * hd], &kc, &vc, scale);
                assert_eq!(bits(oh), bits(&want), "hd {hd}, n {n}, head {h}");
            }
        }
    }

    #[test]
    fn attend_group_is_the_softmax_average_up_to_f16() {
        let (hd, n) = (64, 37);
        let kc = cache_values(n * hd, 7919, 97, 0);
        let vc = cache_values(n * hd, 104_729, 89, 0);
        let q: Vec<f32> = (0..hd).map(|i| f16r((i as f32 * 0.37).sin())).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut o = vec![0f32; hd];
        attend_group(&q, hd, n, |j| j * hd, &bits(&kc), &bits(&vc), scale, &mut o);
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

    /// f16-exact values as the cache holds them.
    fn bits(x: &[f32]) -> Vec<u16> {
        let b: Vec<u16> = x
            .iter()
            .map(|v| half::f16::from_f32(*v).to_bits())
            .collect();
        assert!(
            b.iter().zip(x).all(|(b, x)| from_bits(*b) == *x),
            "not f16-exact"
        );
        b
    }

    /// `len` f16-exact cached values in -0.5..0.5: `(i + offset) * mul % modulus`, scaled.
    fn cache_values(len: usize, mul: usize, modulus: usize, offset: usize) -> Vec<f32> {
        (0..len)
            .map(|i| f16r((((i + offset) * mul) % modulus) as f32 / modulus as f32 - 0.5))
            .collect()
    }

    #[test]
    #[ignore]
    fn attend_speed() {
        // 28 layers' caches of two KV heads, as the 1.5B at 1k context (57 MB, past L3).
        let (hd, n, layers, row) = (128, 1024, 28, 256);
        let kc: Vec<Vec<u16>> = (0..layers)
            .map(|l| bits(&cache_values(n * row, 7919, 97, l)))
            .collect();
        let vc: Vec<Vec<u16>> = (0..layers)
            .map(|l| bits(&cache_values(n * row, 104_729, 89, l)))
            .collect();
        let q: Vec<f32> = (0..hd).map(|i| f16r((i as f32 * 0.37).sin())).collect();
        let q6 = q.repeat(6);
        let mut o = vec![0f32; 6 * hd];
        for _ in 0..3 {
            let t = std::time::Instant::now();
            for (kc, vc) in kc.iter().zip(&vc) {
                for kvh in 0..2 {
                    attend_group(&q6, hd, n, |j| j * row + kvh * hd, kc, vc, 0.088, &mut o);
                }
            }
            let visits = (layers * 12 * n) as f64;
            println!(
                "attend hd {hd} n {n}: {:.1} ns/key",
                t.elapsed().as_nanos() as f64 / visits
            );
        }
    }
}
