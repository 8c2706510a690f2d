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
    pub fn new(head_dim: usize, theta: f64, max_pos: usize, style: RopeStyle) -> Self {
        let half = head_dim / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64))
            .collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
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
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0 * c[i] - x1 * s[i];
                    b[i] = x0 * s[i] + x1 * c[i];
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..h {
                    let (x0, x1) = (x[2 * i], x[2 * i + 1]);
                    x[2 * i] = x0 * c[i] - x1 * s[i];
                    x[2 * i + 1] = x0 * s[i] + x1 * c[i];
                }
            }
        }
    }
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

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without fast-math.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
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
        let mut scores = Vec::with_capacity(n);
        let mut max = f32::NEG_INFINITY;
        for j in 0..n {
            let base = table.slot(j, block_size) * row_len + kvh * hd;
            let s = dot(qv, &kc[base..base + hd]) * scale;
            max = max.max(s);
            scores.push(s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        // SAFETY: item `idx` owns output elements idx*hd..(idx+1)*hd exclusively, and `out`
        // outlives the pool call below.
        let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(idx * hd), hd) };
        for (j, p) in scores.iter().enumerate() {
            let base = table.slot(j, block_size) * row_len + kvh * hd;
            let w = p * inv;
            for (oi, vi) in o.iter_mut().zip(&vc[base..base + hd]) {
                *oi += w * vi;
            }
        }
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

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..19).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..19).map(|i| 1.0 - i as f32 * 0.1).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }
}
