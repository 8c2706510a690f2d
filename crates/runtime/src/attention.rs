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
mod tiled;

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
            let key = |j: usize| &kc[base(j)..base(j) + hd];
            let mut j = keys.start;
            while j < keys.end {
                // Four keys at a time where the lanes allow (the same sums as one at a time).
                let four = (j + 4 <= keys.end)
                    .then(|| f16_lanes::dot4(std::array::from_fn(|i| key(j + i)), qh))
                    .flatten();
                let step = if four.is_some() { 4 } else { 1 };
                for j in j..j + step {
                    if let Some(at) = ahead(j).filter(|_| h == 0) {
                        f16_lanes::prefetch(&kc[at..at + hd]);
                    }
                }
                match four {
                    Some(d) => {
                        for (i, d) in d.into_iter().enumerate() {
                            vs[h * n + j + i] = d * scale + 0.0;
                        }
                    }
                    None => vs[h * n + j] = dot_f16(key(j), qh) * scale + 0.0,
                }
                j += step;
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
        // The running sum in a local: through `sum` it went to memory and back every key.
        let mut total = 0f32;
        for (s, r) in vs.iter_mut().zip(ms.iter_mut()) {
            // Not fused: llama.cpp's released x86 build computes `S = S*ms + vs` in two
            // steps. Where the maximum holds, `ms` is 1 and `S * 1` is `S`: the add alone
            // keeps the running sum's chain short (one operation a key, not two).
            if *s > m {
                *r = (m - *s).exp();
                m = *s;
                *s = 1.0;
                total = total * *r + 1.0;
            } else {
                *s = (*s - m).exp();
                total += *s;
            }
        }
        *sum = total;
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
    // Prompt rows of a tile or more attend as llama.cpp's tiled path (f32 queries); the
    // others one key at a time, where llama.cpp multiplies q with the f16 cache in f16.
    let tiled_row = |r: usize| rows[r].len >= tiled::Q_TILE;
    // Rope and cache writes are cheap and stay on this thread; the attention loop below runs
    // on candle's own worker pool (a second pool would spin against it for the same cores).
    q.chunks_mut(nh * hd).enumerate().for_each(|(t, qt)| {
        for head in qt.chunks_mut(hd) {
            rope.apply(head, tok_pos[t]);
            if !tiled_row(tok_row[t]) {
                for x in head.iter_mut() {
                    *x = half::f16::from_f32(*x).to_f32();
                }
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
    // A work item of a short row: `per` consecutive query heads of one token sharing a KV
    // head (they pass over its cached rows together); as many per item as still leaves
    // every thread an item.
    let short_tokens: Vec<usize> = (0..total).filter(|&t| !tiled_row(tok_row[t])).collect();
    // The pool's own count (its workers and this thread): `get_num_threads` reads
    // /proc/cpuinfo on every call, a measurable share of a decode step.
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    let per = (1..=group)
        .rev()
        .find(|p| group % p == 0 && short_tokens.len() * nh / p >= threads)
        .unwrap_or(1);
    let attend = |item: usize| {
        let (t, h) = (short_tokens[item * per / nh], item * per % nh);
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
    // A work item of a long row: a tile of its tokens, one KV head's query heads; the
    // latest tiles (the most keys) first, so the last items to start are short.
    let mut tiles: Vec<(usize, usize, usize)> = Vec::new();
    for (ri, r) in rows.iter().enumerate().filter(|(ri, _)| tiled_row(*ri)) {
        for first in (0..r.len).step_by(tiled::Q_TILE) {
            tiles.extend((0..nkv).map(|kvh| (ri, first, kvh)));
        }
    }
    tiles.sort_by_key(|&(ri, first, _)| std::cmp::Reverse(rows[ri].past + first));
    let attend_tile = |&(ri, first, kvh): &(usize, usize, usize)| {
        let r = rows[ri];
        let n = tiled::Q_TILE.min(r.len - first);
        let table = tables[ri];
        let token = |t: usize| r.start + first + t;
        tiled::attend_tile(
            n,
            r.past + first,
            group,
            hd,
            |t, h| &q[(token(t) * nh + kvh * group + h) * hd..][..hd],
            |j| table.slot(j, block_size) * row_len + kvh * hd,
            kc,
            vc,
            scale,
            |t, h, o| {
                let at = (token(t) * nh + kvh * group + h) * hd;
                // SAFETY: each tile item writes only its own tokens' heads of its KV
                // head, and `out` (`total * nh * hd` values) outlives the pool call.
                unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(at), hd) }
                    .copy_from_slice(o);
            },
        );
    };
    let short_items = short_tokens.len() * nh / per;
    let item = |i: usize| match tiles.get(i) {
        Some(tile) => attend_tile(tile),
        None => attend(i - tiles.len()),
    };
    let items = tiles.len() + short_items;
    if total * nh * (tok_pos.iter().max().copied().unwrap_or(0) + 1) < SERIAL_HEAD_KEYS {
        (0..items).for_each(item);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(items, |range| range.for_each(item));
    }
    out
}

/// Below this many (query head, cached key) pairs a step's attention runs on the calling
/// thread. A head-key costs ~30 ns; handing work to the pool costs a few microseconds, so the
/// pool pays from a few hundred pairs on (one decode token of 12 heads at 64 context: 768).
const SERIAL_HEAD_KEYS: usize = 512;

#[cfg(test)]
mod tests;
