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
mod weight_memory;

pub use choice::CpuKernel;
pub use q0::Q0Matmul;
pub use q4_k::Q4kMatmul;
pub use q6_k::Q6kMatmul;
pub use weight_memory::WeightMemory;

/// One of our CPU kernels for a quantized weight.
#[derive(Clone, Debug)]
pub enum CpuMatmul {
    Q0(Q0Matmul),
    Q4K(Q4kMatmul),
    Q6K(Q6kMatmul),
}

impl CpuMatmul {
    /// Takes over `w` when one of our kernels handles its type on this CPU (and the
    /// choices for Q5_0/Q8_0 (`q5`) and Q4_K/Q6_K (`qk`) weights leave it on), holding its
    /// own copy in `memory`.
    pub fn new(w: &QMatMul, q5: CpuKernel, qk: CpuKernel, memory: WeightMemory) -> Option<Self> {
        if let Some(q) = Q0Matmul::new(w, q5, memory) {
            return Some(Self::Q0(q));
        }
        if let Some(q) = Q4kMatmul::new(w, qk, memory) {
            return Some(Self::Q4K(q));
        }
        Q6kMatmul::new(w, qk, memory).map(Self::Q6K)
    }

    /// One matmul for several weights that multiply the same input, their rows stacked
    /// (`[a | b | ..]`, output columns in that order), when all are of one type, width and
    /// kernel; `None` otherwise. Every output is computed as in its own matmul (each weight
    /// row's arithmetic is independent of its neighbours), so results are the same bit for
    /// bit; a decode step then makes one parallel pass and quantises the input once where
    /// it made two or three (q/k/v, gate/up).
    pub fn fuse(parts: &[&CpuMatmul]) -> Option<Self> {
        /// Every part as this variant's kernel, or `None` if one is another type.
        fn all<'a, T>(
            parts: &[&'a CpuMatmul],
            as_t: fn(&'a CpuMatmul) -> Option<&'a T>,
        ) -> Option<Vec<&'a T>> {
            parts.iter().map(|p| as_t(p)).collect()
        }
        match parts.first()? {
            Self::Q0(_) => {
                let qs = all(parts, |p| if let Self::Q0(q) = p { Some(q) } else { None })?;
                Q0Matmul::fuse(&qs).map(Self::Q0)
            }
            Self::Q4K(_) => {
                let qs = all(parts, |p| if let Self::Q4K(q) = p { Some(q) } else { None })?;
                Q4kMatmul::fuse(&qs).map(Self::Q4K)
            }
            Self::Q6K(_) => {
                let qs = all(parts, |p| if let Self::Q6K(q) = p { Some(q) } else { None })?;
                Q6kMatmul::fuse(&qs).map(Self::Q6K)
            }
        }
    }

    /// Whether the weight sits in its own huge-page mapping.
    #[cfg(test)]
    fn weight_is_mapped(&self) -> bool {
        match self {
            Self::Q0(q) => q.weight_is_mapped(),
            Self::Q4K(q) => q.weight_is_mapped(),
            Self::Q6K(q) => q.weight_is_mapped(),
        }
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

/// `f` on `x` as our kernels take it: f32 on the CPU. Another float type goes through f32 and
/// back; an input on another device is an error naming `op` (the weight is in CPU memory).
fn on_cpu_f32(
    op: &str,
    x: &Tensor,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    if !x.device().is_cpu() {
        candle_core::bail!("{op}: the weight is in CPU memory, the input is not");
    }
    if x.dtype() != candle_core::DType::F32 {
        return f(&x.to_dtype(candle_core::DType::F32)?)?.to_dtype(x.dtype());
    }
    f(x)
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

/// A matmul's outputs in memory that is not zeroed first, written through [`Unfilled::ptr`]
/// (its work items write disjoint elements from the pool's threads): a decode batch's
/// outputs (the 0.5B's logits are 8 x 151936) were zeroed on the calling thread while the
/// other core waited, then written again.
struct Unfilled {
    values: Vec<f32>,
    len: usize,
}

impl Unfilled {
    fn new(len: usize) -> Self {
        Self {
            values: Vec::with_capacity(len),
            len,
        }
    }

    fn ptr(&mut self) -> SharedMut<f32> {
        SharedMut(self.values.as_mut_ptr())
    }

    /// The outputs.
    ///
    /// # Safety
    /// Every one of the `len` values must have been written through [`Unfilled::ptr`].
    unsafe fn filled(mut self) -> Vec<f32> {
        // SAFETY: the capacity is at least `len`, and the caller wrote all `len` values.
        unsafe { self.values.set_len(self.len) };
        self.values
    }
}

/// Run `f` over `0..n` in chunks, on candle's barrier pool when `cost` (in 32-value block
/// products, all `n` items together) is worth the hand-off.
fn par_chunks(n: usize, cost: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if cost < MIN_PARALLEL_BLOCKS {
        f(0..n);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(n, f);
    }
}

/// The smallest chunk `par_guided` hands out, in 32-value block products (tens of
/// microseconds of a batch kernel: each grab is an atomic on a line both cores use).
const MIN_CHUNK_BLOCKS: usize = 1 << 15;

/// `par_chunks` for a decode batch's matmul (a few activation rows, every item a group of
/// weight rows): guided chunks, in whole `grain`s of items from item 0 (units a thread
/// should run together, as the activation groups of one Q4_K tile row).
///
/// Each grab of one shared cursor takes a `1 / (2 * threads)` share of what is left (at
/// least `MIN_CHUNK_BLOCKS`), so each thread's weights stream from a long run early and both
/// threads finish within a small chunk of each other. candle's `execute_chunked` hands out
/// an eighth of a thread's share at a time, and the thread done first waited half a chunk on
/// average: for eight decode rows ~50 us of each big matrix, ~0.8 ms of the 0.5B's output
/// matrix (worker idle 4.9% and the calling thread's wait 1.9% of the batch step's samples).
/// Fixed small chunks instead broke the streams and split a tile row's groups between the
/// threads (the AVX-512 host: Q4_K eight rows 59.3 -> 63.4 ms). Prompts keep `par_chunks`:
/// their items are tuned to its order (`Bands`).
fn par_guided(n: usize, grain: usize, cost: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    if cost < MIN_PARALLEL_BLOCKS {
        f(0..n);
        return;
    }
    let pool = candle_core::utils::barrier_pool();
    let threads = pool.n_workers() + 1;
    let grain = grain.max(1);
    let min_items = (MIN_CHUNK_BLOCKS / (cost / n.max(1)).max(1)).max(1);
    let cursor = AtomicUsize::new(0);
    // One slot per thread, each running the cursor loop (a thread that takes a second slot
    // finds the cursor done); `execute_chunked` also runs it inline when called from a
    // worker.
    pool.execute_chunked(threads, |_| loop {
        let mut start = cursor.load(Ordering::Relaxed);
        let end = loop {
            if start >= n {
                return;
            }
            let size = ((n - start) / (2 * threads)).max(min_items);
            let end = n.min((start + size).next_multiple_of(grain));
            match cursor.compare_exchange_weak(start, end, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break end,
                Err(now) => start = now,
            }
        };
        f(start..end);
    });
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

#[cfg(test)]
mod fuse_tests {
    use super::{CpuKernel, CpuMatmul};
    use crate::test_util::{quantized, values};
    use crate::WeightMemory;
    use candle_core::quantized::GgmlDType;
    use candle_core::{Device, Tensor};

    fn flat(t: Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Stacked weights give each part's outputs bit for bit, for every weight type we take,
    /// every kernel choice, single rows, batches of separate rows and sequences (whose
    /// rounding depends on their length), with the parts' rows not aligned to the kernels'
    /// row groups (8-row groups of Q5_0/Q8_0/Q6_K straddle the boundary).
    #[test]
    fn fused_weights_equal_their_parts_bit_for_bit() {
        let kernels = [CpuKernel::Scalar, CpuKernel::Avx2, CpuKernel::Auto];
        let cases = [
            (GgmlDType::Q5_0, 64, [40, 24, 8]),
            (GgmlDType::Q5_0, 96, [20, 12, 36]),
            (GgmlDType::Q8_0, 96, [24, 8, 16]),
            (GgmlDType::Q4K, 512, [48, 16, 32]),
            (GgmlDType::Q6K, 256, [20, 12, 36]),
        ];
        for (dtype, k, ns) in cases {
            for choice in kernels {
                let parts: Vec<CpuMatmul> = ns
                    .iter()
                    .enumerate()
                    .filter_map(|(i, &n)| {
                        CpuMatmul::new(
                            &quantized(n, k, 7 + i as u64, dtype),
                            choice,
                            choice,
                            WeightMemory::default(),
                        )
                    })
                    .collect();
                if parts.len() < ns.len() {
                    continue; // this CPU does not run the kernel
                }
                let refs: Vec<&CpuMatmul> = parts.iter().collect();
                let fused = CpuMatmul::fuse(&refs).expect("parts of one type fuse");
                let seqs: [&[usize]; 4] = [&[1], &[1; 8], &[8, 1, 4, 3], &[32, 5]];
                for seqs in seqs {
                    let m: usize = seqs.iter().sum();
                    let x = Tensor::from_vec(values(m * k, 3), (m, k), &Device::Cpu).unwrap();
                    let all = flat(fused.forward(&x, Some(seqs)).unwrap());
                    let total: usize = ns.iter().sum();
                    let mut at = 0;
                    for (p, &n) in parts.iter().zip(&ns) {
                        let own = flat(p.forward(&x, Some(seqs)).unwrap());
                        for r in 0..m {
                            let got = &all[r * total + at..r * total + at + n];
                            let want = &own[r * n..(r + 1) * n];
                            let same = got
                                .iter()
                                .zip(want)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{dtype:?} {choice:?} seqs {seqs:?} row {r}");
                        }
                        at += n;
                    }
                }
            }
        }
    }

    /// Weights of 2 MiB and more get their own huge-page mapping and multiply exactly as
    /// their copies on the heap, each type, alone and stacked (the stacked copy mapped too).
    #[test]
    fn weights_on_huge_pages_multiply_as_on_the_heap() {
        let (n, k) = (4096, 1024);
        for dtype in [
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let w = quantized(n, k, 5, dtype);
            let new = |memory| CpuMatmul::new(&w, CpuKernel::Auto, CpuKernel::Auto, memory);
            let (Some(huge), Some(heap)) = (new(WeightMemory::HugePages), new(WeightMemory::Heap))
            else {
                continue; // no kernel of ours for this type on this CPU
            };
            assert!(
                huge.weight_is_mapped() && !heap.weight_is_mapped(),
                "{dtype:?}"
            );
            let stacked = CpuMatmul::fuse(&[&huge, &huge]).unwrap();
            assert!(stacked.weight_is_mapped(), "{dtype:?}");
            for m in [1, 3] {
                let x = Tensor::from_vec(values(m * k, 4), (m, k), &Device::Cpu).unwrap();
                let want = flat(heap.forward(&x, None).unwrap());
                assert_eq!(flat(huge.forward(&x, None).unwrap()), want, "{dtype:?}");
                let both = flat(stacked.forward(&x, None).unwrap());
                for r in 0..m {
                    let row = &want[r * n..(r + 1) * n];
                    assert_eq!(&both[2 * r * n..(2 * r + 1) * n], row, "{dtype:?}");
                    assert_eq!(&both[(2 * r + 1) * n..(2 * r + 2) * n], row, "{dtype:?}");
                }
            }
        }
    }

    #[test]
    fn parts_of_different_types_or_widths_do_not_fuse() {
        let q4 = CpuMatmul::new(
            &quantized(16, 256, 1, GgmlDType::Q4K),
            CpuKernel::Scalar,
            CpuKernel::Scalar,
            WeightMemory::default(),
        )
        .unwrap();
        let q6 = CpuMatmul::new(
            &quantized(16, 256, 2, GgmlDType::Q6K),
            CpuKernel::Scalar,
            CpuKernel::Scalar,
            WeightMemory::default(),
        )
        .unwrap();
        let wide = CpuMatmul::new(
            &quantized(16, 512, 3, GgmlDType::Q4K),
            CpuKernel::Scalar,
            CpuKernel::Scalar,
            WeightMemory::default(),
        )
        .unwrap();
        assert!(CpuMatmul::fuse(&[&q4, &q6]).is_none());
        assert!(CpuMatmul::fuse(&[&q4, &wide]).is_none());
        assert!(CpuMatmul::fuse(&[]).is_none());
        assert!(CpuMatmul::fuse(&[&q4, &q4]).is_some());
    }
}
