//! Our own CPU matmuls for quantized weights, bit-exact with candle's `QMatMul::forward`.
//!
//! - [`q0`]: Q5_0 and Q8_0 x Q8_0 (candle 0.11 only has the scalar reference loop for Q5_0).
//! - [`q4_k`]: Q4_K x Q8_K (candle repacks these weights into 16-row tiles that hold the
//!   scales as f32, a third more bytes than the GGUF blocks; decode reads all weights once per
//!   token, so it pays that in memory bandwidth. Ours packs the same tiles with the compact
//!   scales and does the same arithmetic).
//! - [`q6_k`]: Q6_K x Q8_K with llama.cpp's per-sequence rounding: single rows (decode,
//!   where candle runs its AVX2 dot product one weight row at a time) and prefills (weights
//!   unpacked once into 16-row tiles).
//!
//! The runtime's `Linear` asks [`CpuMatmul::new`] for each weight; `None` leaves it to
//! candle. This crate depends on nothing of ours and holds most of the project's `unsafe`
//! (the SIMD kernels, each checked bit for bit against its scalar loop).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{CpuStorage, Layout, Shape, Tensor};
use std::sync::Arc;

pub mod act_quant;
mod choice;
pub mod q0;
pub mod q4_k;
pub mod q6_k;
#[cfg(test)]
mod test_util;

pub use choice::CpuKernel;
pub use q0::Q0Matmul;
pub use q4_k::Q4kMatmul;
pub use q6_k::Q6kMatmul;

/// One of our CPU kernels for a quantized weight.
#[derive(Clone, Debug)]
pub enum CpuMatmul {
    Q0(Q0Matmul),
    Q4K(Q4kMatmul),
    Q6K(Q6kMatmul),
}

impl CpuMatmul {
    /// Takes over `w` when one of our kernels handles its type on this CPU (and the
    /// choices for Q5_0/Q8_0 (`q5`) and Q4_K/Q6_K (`qk`) weights leave it on).
    pub fn new(w: &QMatMul, q5: CpuKernel, qk: CpuKernel) -> Option<Self> {
        if let Some(q) = Q0Matmul::new(w, q5) {
            return Some(Self::Q0(q));
        }
        if let Some(q) = Q4kMatmul::new(w, qk) {
            return Some(Self::Q4K(q));
        }
        Q6kMatmul::new(w, qk).map(Self::Q6K)
    }

    /// `x @ w^T` for `x` of shape `[.., k]`, its rows grouped into sequences by `seqs`.
    pub fn forward(&self, x: &Tensor, seqs: SeqRows) -> candle_core::Result<Tensor> {
        match self {
            Self::Q0(q) => q.forward(x),
            Self::Q4K(q) => q.forward(x, seqs),
            Self::Q6K(q) => q.forward(x, seqs),
        }
    }
}

/// Which activation rows of a matmul belong to one sequence: `Some(lens)` with `lens[i]`
/// consecutive rows of sequence i (summing to the row count), `None` for rows each on their
/// own. llama.cpp rounds K-quant products differently in a batch than for a single row (a
/// batch's full groups of four rows go through its Q4_K gemm, batches of eight rows and
/// more through its tiled Q6_K kernel); we apply its rule per sequence, so a sequence's
/// results are llama.cpp's for that sequence alone, whatever else shares the step.
pub type SeqRows<'a> = Option<&'a [usize]>;

/// For each of `m` rows: (its index among its sequence's rows, that sequence's row count).
/// Rows are on their own when `seqs` is `None` or does not add up to `m`.
fn seq_positions(m: usize, seqs: SeqRows) -> Vec<(usize, usize)> {
    match seqs {
        Some(lens) if lens.iter().sum::<usize>() == m => lens
            .iter()
            .flat_map(|&len| (0..len).map(move |i| (i, len)))
            .collect(),
        _ => vec![(0, 1); m],
    }
}

/// `w` as a `[n, k]` matrix of `dtype` blocks (`block` values in `block_bytes` each, stored
/// without padding) in CPU memory, `n, k > 0`: what every kernel here needs to read it.
fn cpu_matrix(
    w: &QMatMul,
    dtype: GgmlDType,
    block: usize,
    block_bytes: usize,
) -> Option<(&Arc<QTensor>, usize, usize)> {
    let QMatMul::QTensor(t) = w else {
        return None;
    };
    if t.dtype() != dtype || !t.device().is_cpu() {
        return None;
    }
    let (n, k) = t.shape().dims2().ok()?;
    if n == 0
        || k == 0
        || !k.is_multiple_of(block)
        || t.storage_size_in_bytes() != n * k / block * block_bytes
    {
        return None;
    }
    Some((t, n, k))
}

/// The contiguous f32 input of a matmul op `[.., k]` and its output shape `[.., n]`.
fn matmul_io<'a>(
    op: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
    k: usize,
    n: usize,
) -> candle_core::Result<(&'a [f32], Shape)> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{op}: input is not contiguous {layout:?}");
    };
    let x = &storage.as_slice::<f32>()?[start..end];
    let mut dims = layout.dims().to_vec();
    match dims.last_mut() {
        Some(last) if *last == k => *last = n,
        _ => candle_core::bail!("{op}: input {dims:?} does not end in {k}"),
    }
    Ok((x, Shape::from(dims)))
}

/// Below this many 32-value block products the pool's hand-off costs more than it saves.
const MIN_PARALLEL_BLOCKS: usize = 4096;

/// Output pointer shared by pool workers that write disjoint elements.
struct SharedMut<T>(*mut T);
impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}
// SAFETY: every user writes only elements no other work item writes (see the callers).
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Run `f` over `0..n` in chunks, on candle's barrier pool when `cost` (in 32-value block
/// products) is worth the hand-off.
fn par_chunks(n: usize, cost: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if cost < MIN_PARALLEL_BLOCKS {
        f(0..n);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(n, f);
    }
}

/// The order of a matmul's work items, each a group of weight rows against a group of
/// activation rows: the weight groups in bands small enough to stay in a core's L2 cache,
/// and within a band every activation group against every weight group of the band. Weight
/// group after weight group (candle's order) streams all the activations once per group,
/// from L3 once they outgrow L2 (a 512-token prompt's activations for the 1.5B's down
/// projection are 5 MB).
pub(crate) struct Bands {
    weight_groups: usize,
    act_groups: usize,
    band: usize,
}

impl Bands {
    /// Bytes of weights a band may hold (half a Zen 4 L2).
    const BAND_BYTES: usize = 512 << 10;

    pub(crate) fn new(weight_groups: usize, act_groups: usize, group_bytes: usize) -> Self {
        let band = (Self::BAND_BYTES / group_bytes.max(1)).clamp(1, weight_groups.max(1));
        Self {
            weight_groups,
            act_groups,
            band,
        }
    }

    /// Work item `unit` (of `weight_groups * act_groups`) as (weight group, activation group).
    pub(crate) fn at(&self, unit: usize) -> (usize, usize) {
        let first = unit / (self.band * self.act_groups) * self.band;
        let width = self.band.min(self.weight_groups - first);
        let rest = unit - first * self.act_groups;
        (first + rest % width, rest / width)
    }
}

#[cfg(test)]
mod bands_tests {
    #[test]
    fn bands_visit_every_item_once() {
        for (tile_rows, groups, row_bytes) in [
            (96, 128, 83 << 10),
            (560, 128, 14 << 10),
            (7, 3, 1 << 20),
            (1, 1, 1),
        ] {
            let b = super::Bands::new(tile_rows, groups, row_bytes);
            let mut seen = vec![false; tile_rows * groups];
            for unit in 0..tile_rows * groups {
                let (t, g) = b.at(unit);
                assert!(t < tile_rows && g < groups && !seen[t * groups + g]);
                seen[t * groups + g] = true;
            }
        }
    }
}
