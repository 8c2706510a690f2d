//! CPU matmul for Q4_K weights.
//!
//! The weights are copied into tiles of 16 rows x 256 values, 4-bit values interleaved so
//! one `vpdpbusd` yields the integer dot products of 16 rows at once (candle's repacked
//! layout), with the scales as GGUF has them (f16 `d` and `dmin`, 6-bit `sc` and `m`
//! widened to bytes: 2368 bytes a tile where candle's pre-multiplied f32 scales take 3072;
//! single-stream decode reads every weight once per token, so bytes are time). The next
//! tiles are prefetched while one is read.
//!
//! The arithmetic is llama.cpp's (its x86 build repacks Q4_K for `ggml_gemv_q4_K_8x8_q8_K`
//! and `ggml_gemm_q4_K_8x8_q8_K`): activations quantised with its rounding (`act_quant`),
//! integer sums of `sc * (w . y)` and `m * bsum`, and two f32 chains per output,
//! `acc = fma(isum, d * d_y, acc)` and `acc_min = fma(imin, dmin * d_y, acc_min)`, giving
//! `acc - acc_min`. Rows in a full group of four (llama.cpp's gemm: every row of a batch up
//! to the last multiple of four) add to the chains every 64 values, the others (its gemv)
//! every 256-value block; see `dot_scalar`.

use candle_core::quantized::k_quants::BlockQ8K;
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use std::sync::Arc;

use super::{par_chunks, par_guided, Bands, SharedMut, Unfilled};
use crate::weight_memory::{WeightMemory, WeightVec, ZeroValid};
use crate::CpuKernel;

/// Values per super-block.
const QK_K: usize = 256;
/// Bytes of one Q4_K block: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles.
const Q4K_BYTES: usize = 144;
/// Bytes of one Q8_K block: f32 d, 256 i8, 16 i16 sums of 16 values.
const Q8K_BYTES: usize = 292;
/// Offset of the sums in a Q8_K block.
const Q8K_BSUMS: usize = 260;
/// Weight rows per tile.
const TILE_N: usize = 16;
/// Activation rows per work item (candle's `MAX_MT`).
const MT: usize = 4;
/// Activation groups (of [`MT`] rows) up to which a call reads each tile row once for all
/// of them (a batched decode step) rather than in L2-sized bands.
const FEW_GROUPS: usize = 4;
/// Tiles ahead of the one being read that the kernel prefetches.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PREFETCH_TILES: usize = 2;

// Activation blocks are read as bytes: `BlockQ8K` is `#[repr(C)] { d: f32, qs: [i8; 256],
// bsums: [i16; 16] }`, the ggml layout, with no padding.
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == Q8K_BYTES);

/// 16 weight rows by one super-block of 256 values.
#[derive(Clone)]
#[repr(C, align(64))]
pub struct Tile {
    /// `[group of 8 values (32)][row (16)][4 bytes]`: byte j holds value `8g + j` in the low
    /// nibble and `8g + j + 4` in the high one (candle's `TileQ4K` order).
    qs: [u8; QK_K / 2 * TILE_N],
    /// Each row's f16 `d` and `dmin`, as bits.
    d: [u16; TILE_N],
    dmin: [u16; TILE_N],
    /// `[sub-block (8)][row (16)]` 6-bit scales and mins.
    sc: [[u8; TILE_N]; 8],
    mn: [[u8; TILE_N]; 8],
}
const TILE_BYTES: usize = std::mem::size_of::<Tile>();
// SAFETY: a tile is integer arrays only (any bytes, zeros included, are a tile) and has no
// `Drop`.
unsafe impl ZeroValid for Tile {}
const _: () = assert!(TILE_BYTES == 2368);

/// Which kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Portable loop with llama.cpp's arithmetic (`mul_add` for its fused steps).
    Scalar,
    /// 256-bit kernel (AVX2 + FMA + F16C): `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// As [`Kernel::Avx2`] with the `vpdpbusd` of AVX-VNNI.
    AvxVnni,
    /// 512-bit kernel (AVX512F + BW + VNNI).
    Avx512Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn detect() -> Self {
        [Kernel::Avx512Vnni, Kernel::AvxVnni, Kernel::Avx2]
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Kernel::Scalar)
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::AvxVnni => Kernel::Avx2.available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// A Q4_K weight `[n, k]` on the CPU, multiplied by our kernels. It holds only the repacked
/// tiles: the caller may drop the original weight (the model does).
#[derive(Clone)]
pub struct Q4kMatmul {
    tiles: Arc<WeightVec<Tile>>,
    n: usize,
    k: usize,
    kernel: Kernel,
    memory: WeightMemory,
}

impl std::fmt::Debug for Q4kMatmul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q4kMatmul([{}, {}], {:?})", self.n, self.k, self.kernel)
    }
}

impl Q4kMatmul {
    /// Takes over `w` when it is a Q4_K matrix on the CPU of whole 16-row tiles; `None`
    /// leaves it to candle. `choice` (`KernelOptions::cpu_qk`) may turn this path off or
    /// force a kernel (A/B measurements). Without a SIMD kernel for this CPU candle keeps
    /// the weight.
    pub fn new(w: &QMatMul, choice: CpuKernel, memory: WeightMemory) -> Option<Self> {
        let kernel = choice.pick(Kernel::Scalar, Kernel::Avx2, Kernel::detect(), false)?;
        Self::with_kernel_in(w, kernel, memory)
    }

    /// As [`Q4kMatmul::new`] with a chosen kernel (`None` if this CPU cannot run it).
    pub fn with_kernel(w: &QMatMul, kernel: Kernel) -> Option<Self> {
        Self::with_kernel_in(w, kernel, WeightMemory::default())
    }

    fn with_kernel_in(w: &QMatMul, kernel: Kernel, memory: WeightMemory) -> Option<Self> {
        let (t, n, k) = super::cpu_matrix(w, GgmlDType::Q4K, QK_K, Q4K_BYTES)?;
        if !kernel.available() || !n.is_multiple_of(TILE_N) {
            return None;
        }
        let tiles = pack(&t.data().ok()?, n, k, memory);
        Some(Self {
            tiles: Arc::new(tiles),
            n,
            k,
            kernel,
            memory,
        })
    }

    #[cfg(test)]
    pub(crate) fn weight_is_mapped(&self) -> bool {
        self.tiles.is_mapped()
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// `parts` stacked into one weight (see `CpuMatmul::fuse`): the tiles of each part
    /// after the other's (tiles are whole 16-row groups), one kernel and width.
    pub fn fuse(parts: &[&Q4kMatmul]) -> Option<Self> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.kernel != first.kernel || p.k != first.k)
        {
            return None;
        }
        let tiles: Vec<&[Tile]> = parts.iter().map(|p| &p.tiles[..]).collect();
        Some(Self {
            tiles: Arc::new(WeightVec::concat(&tiles, first.memory)),
            n: parts.iter().map(|p| p.n).sum(),
            k: first.k,
            kernel: first.kernel,
            memory: first.memory,
        })
    }

    /// `x @ w^T` for `x` of shape `[.., k]`: `[.., n]`, its rows grouped into sequences by
    /// `seqs` (see [`super::SeqRows`]).
    pub fn forward(&self, x: &Tensor, seqs: super::SeqRows) -> candle_core::Result<Tensor> {
        super::on_cpu_f32("q4_k matmul", x, |x| {
            let m = x.elem_count() / self.k.max(1);
            // llama.cpp's gemm takes a sequence's rows up to its last multiple of four.
            let in_gemm = super::seq_positions(m, seqs)
                .into_iter()
                .map(|(i, len)| i < len - len % MT)
                .collect();
            x.contiguous()?
                .apply_op1_no_bwd(&Call { mm: self, in_gemm })
        })
    }
}

/// One product: the weight, and per activation row whether it rounds like llama.cpp's gemm.
struct Call<'a> {
    mm: &'a Q4kMatmul,
    in_gemm: Vec<bool>,
}

impl CustomOp1 for Call<'_> {
    fn name(&self) -> &'static str {
        "q4_k-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let mm = self.mm;
        let (x, shape) = super::matmul_io("q4_k matmul", storage, layout, mm.k, mm.n)?;
        let out = matmul(mm.kernel, &mm.tiles, mm.n, mm.k, x, &self.in_gemm)?;
        Ok((CpuStorage::F32(out), shape))
    }
}

/// ggml's 6-bit scale and min of sub-block `j` from a block's 12 scale bytes.
fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K weight bytes (`n` rows of `k / 256` blocks) as tiles, `[n / 16][k / 256]`.
fn pack(w: &[u8], n: usize, k: usize, memory: WeightMemory) -> WeightVec<Tile> {
    let kb = k / QK_K;
    let mut tiles = WeightVec::<Tile>::zeroed(n / TILE_N * kb, memory);
    let ptr = SharedMut(tiles.as_mut_ptr());
    par_chunks(tiles.len(), tiles.len() * 64, |range| {
        for t in range {
            // SAFETY: each index is packed by one work item; `tiles` outlives the call.
            let tile = unsafe { &mut *ptr.get().add(t) };
            let (nt, b) = (t / kb, t % kb);
            for r in 0..TILE_N {
                let at = ((nt * TILE_N + r) * kb + b) * Q4K_BYTES;
                let blk = &w[at..at + Q4K_BYTES];
                tile.d[r] = u16::from_le_bytes([blk[0], blk[1]]);
                tile.dmin[r] = u16::from_le_bytes([blk[2], blk[3]]);
                for sub in 0..8 {
                    (tile.sc[sub][r], tile.mn[sub][r]) = scale_min(sub, &blk[4..16]);
                }
                // 32-byte chunk c holds values c*64.. in its low nibbles, c*64+32.. in its
                // high ones.
                let qs = &blk[16..];
                let val = |v: usize| {
                    let byte = qs[v / 64 * 32 + v % 32];
                    if v % 64 < 32 {
                        byte & 0x0f
                    } else {
                        byte >> 4
                    }
                };
                for g in 0..QK_K / 8 {
                    for j in 0..4 {
                        tile.qs[(g * TILE_N + r) * 4 + j] =
                            val(8 * g + j) | (val(8 * g + j + 4) << 4);
                    }
                }
            }
        }
    });
    tiles
}

fn as_bytes(b: &[BlockQ8K]) -> &[u8] {
    // SAFETY: `BlockQ8K` is `repr(C)`, 292 bytes without padding (asserted above), and
    // every block was initialised (zeroed, then written by `from_float`).
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, std::mem::size_of_val(b)) }
}

/// `out[m, n] = x[m, k] @ w^T` for a Q4_K weight packed as `tiles`; `in_gemm[r]`: row r
/// rounds like llama.cpp's gemm (every 64 values), else like its gemv (every block).
fn matmul(
    kernel: Kernel,
    tiles: &[Tile],
    n: usize,
    k: usize,
    x: &[f32],
    in_gemm: &[bool],
) -> candle_core::Result<Vec<f32>> {
    if k == 0 || !k.is_multiple_of(QK_K) || !n.is_multiple_of(TILE_N) {
        candle_core::bail!("q4_k matmul: [{n}, {k}] is not made of 16 x 256 tiles");
    }
    let kb = k / QK_K;
    let m = x.len() / k;
    if tiles.len() != n / TILE_N * kb || x.len() != m * k || in_gemm.len() != m {
        candle_core::bail!("q4_k matmul: sizes do not match for [{n}, {k}]");
    }
    if !kernel.available() {
        candle_core::bail!("q4_k matmul: this CPU cannot run the {kernel:?} kernel");
    }
    if m == 0 || n == 0 {
        return Ok(Vec::new());
    }
    // Activations as llama.cpp quantizes them, row by row.
    let lhs = super::act_quant::quantize_rows_q8k(x, k);
    let lhs = as_bytes(&lhs);
    let row_bytes = kb * Q8K_BYTES;
    let m_units = m.div_ceil(MT);
    // Tile rows in bands that stay in L2 (`q4_k speed`, 512 rows, best of four alternating
    // runs: [8960x1536] AVX2 46.8 -> 40.4 ms, AVX-512 32.2 -> 29.4; [1536x8960] 43.3 -> 42.3).
    // A batch of a few decode rows takes each tile row through all its activation groups at
    // once instead: the groups after the first read it from L1, and the weights stream from
    // DRAM at an even pace rather than in bursts of a band (`speed_cold_step`, eight rows).
    let band_bytes = if m_units <= FEW_GROUPS {
        usize::MAX
    } else {
        kb * TILE_BYTES
    };
    let blocks = Bands::new(n / TILE_N, m_units, band_bytes);
    let mut out = Unfilled::new(m * n);
    let out_ptr = out.ptr();
    let units = n / TILE_N * m_units;
    let run = |units: std::ops::Range<usize>| {
        for unit in units {
            let (nt, group) = blocks.at(unit);
            let m0 = group * MT;
            let mt = (m - m0).min(MT);
            let acts: [&[u8]; MT] = std::array::from_fn(|i| {
                let r = m0 + i.min(mt - 1);
                &lhs[r * row_bytes..(r + 1) * row_bytes]
            });
            let gemm = &in_gemm[m0..m0 + mt];
            let res = dot_tiles(kernel, &tiles[nt * kb..(nt + 1) * kb], &acts[..mt], gemm);
            for (i, row) in res.iter().take(mt).enumerate() {
                // SAFETY: the unit alone writes rows m0..m0+mt of columns nt*16..nt*16+16,
                // and `out` outlives the call.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        row.as_ptr(),
                        out_ptr.get().add((m0 + i) * n + nt * TILE_N),
                        TILE_N,
                    )
                };
            }
        }
    };
    let cost = m * n * kb * 8;
    if m > 1 && m_units <= FEW_GROUPS {
        // A decode batch: a tile row's groups (consecutive units) on one thread, from L1.
        par_guided(units, m_units, cost, run);
    } else {
        par_chunks(units, cost, run);
    }
    // SAFETY: the units partition the (tile row, activation group) grid and each writes
    // its rows' 16 columns: every element of the [m, n] output (n is whole tiles).
    Ok(unsafe { out.filled() })
}

/// One row of tiles (16 weight rows, all of k) against up to [`MT`] activation rows.
fn dot_tiles(kernel: Kernel, tiles: &[Tile], acts: &[&[u8]], gemm: &[bool]) -> [[f32; TILE_N]; MT] {
    let gemm: [bool; MT] = std::array::from_fn(|i| gemm.get(i).copied().unwrap_or(false));
    // Real checks, once for every kernel: they read `tiles.len()` blocks of every activation
    // row through raw pointers.
    assert!((1..=MT).contains(&acts.len()));
    for a in acts {
        assert!(a.len() == tiles.len() * Q8K_BYTES);
    }
    match kernel {
        Kernel::Scalar => dot_scalar(tiles, acts, gemm),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul` checked that the CPU runs the kernel, and the lengths are checked above.
        Kernel::Avx512Vnni => unsafe {
            match acts.len() {
                // One row streams the weights from memory: the 256-bit kernel keeps up with
                // it better on Zen 4 (`q4_k speed`, [151936x1536], four runs: 2.2-3.0 ms vs
                // 2.75-3.57), and every AVX-512 CPU runs it (checked once, below).
                1 if avx2_on_avx512() => avx2::dot::<1>(tiles, acts, gemm),
                1 => avx512::dot::<1>(tiles, acts, gemm),
                2 => avx512::dot::<2>(tiles, acts, gemm),
                3 => avx512::dot::<3>(tiles, acts, gemm),
                _ => avx512::dot::<4>(tiles, acts, gemm),
            }
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Kernel::Avx2 => unsafe {
            tiles256(
                avx2::dot::<1>,
                avx2::dot::<2>,
                avx2::dot::<3>,
                avx2_rows4::dot,
                tiles,
                acts,
                gemm,
            )
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Kernel::AvxVnni => unsafe {
            tiles256(
                avx_vnni::dot::<1>,
                avx_vnni::dot::<2>,
                avx_vnni::dot::<3>,
                avx_vnni::dot::<4>,
                tiles,
                acts,
                gemm,
            )
        },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the scalar kernel is available off x86_64"),
    }
}

/// Whether this AVX-512 CPU also runs the AVX2 kernel (every one made does; checked once).
#[cfg(target_arch = "x86_64")]
fn avx2_on_avx512() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| Kernel::Avx2.available())
}

/// A 256-bit kernel for 1..=4 activation rows.
#[cfg(target_arch = "x86_64")]
type Dot256 = unsafe fn(&[Tile], &[&[u8]], [bool; MT]) -> [[f32; TILE_N]; MT];

/// Dispatch on the activation row count.
///
/// # Safety
/// The CPU must run the kernels.
#[cfg(target_arch = "x86_64")]
unsafe fn tiles256(
    d1: Dot256,
    d2: Dot256,
    d3: Dot256,
    d4: Dot256,
    tiles: &[Tile],
    acts: &[&[u8]],
    gemm: [bool; MT],
) -> [[f32; TILE_N]; MT] {
    match acts.len() {
        1 => d1(tiles, acts, gemm),
        2 => d2(tiles, acts, gemm),
        3 => d3(tiles, acts, gemm),
        _ => d4(tiles, acts, gemm),
    }
}

#[inline]
fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The sum of the 32 activations of sub-block `sub` of the Q8_K block `q`, as f32.
#[inline]
fn bsum(q: &[u8], sub: usize) -> i32 {
    let at = Q8K_BSUMS + 4 * sub;
    i16::from_le_bytes([q[at], q[at + 1]]) as i32
        + i16::from_le_bytes([q[at + 2], q[at + 3]]) as i32
}

/// llama.cpp's arithmetic (its x86 repacked `ggml_gemv_q4_K_8x8_q8_K` and
/// `ggml_gemm_q4_K_8x8_q8_K`), one output at a time: integer sums of `sc * (w . y)` and `m *
/// bsum` over sub-blocks, added to f32 as `acc = fma(isum, d * d_y, acc)` and `acc_min =
/// fma(imin, dmin * d_y, acc_min)`, and `acc - acc_min` at the end. Rows llama.cpp takes
/// through its gemm (`gemm[i]`) add every 64 values, the others (its gemv) every
/// 256-value block.
fn dot_scalar(tiles: &[Tile], acts: &[&[u8]], gemm: [bool; MT]) -> [[f32; TILE_N]; MT] {
    let mut out = [[0f32; TILE_N]; MT];
    for ((act, out), gemm) in acts.iter().zip(&mut out).zip(gemm) {
        for (r, o) in out.iter_mut().enumerate() {
            let (mut acc, mut acc_min) = (0f32, 0f32);
            for (b, tile) in tiles.iter().enumerate() {
                let q = &act[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
                let (mut iblk, mut imin) = (0i32, 0i32);
                for sub in 0..8 {
                    let mut isum = 0i32;
                    for v in sub * 32..(sub + 1) * 32 {
                        let byte = tile.qs[((v / 8) * TILE_N + r) * 4 + v % 4];
                        let w = if v % 8 < 4 { byte & 0x0f } else { byte >> 4 };
                        isum += w as i32 * q[4 + v] as i8 as i32;
                    }
                    iblk += isum * tile.sc[sub][r] as i32;
                    imin += tile.mn[sub][r] as i32 * bsum(q, sub);
                    if (gemm && sub % 2 == 1) || sub == 7 {
                        let dall = f32_at(q, 0);
                        let d = half::f16::from_bits(tile.d[r]).to_f32();
                        let dmin = half::f16::from_bits(tile.dmin[r]).to_f32();
                        acc = (iblk as f32).mul_add(d * dall, acc);
                        acc_min = (imin as f32).mul_add(dmin * dall, acc_min);
                        (iblk, imin) = (0, 0);
                    }
                }
            }
            *o = acc - acc_min;
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2_rows4;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
use x86::{avx2, avx512, avx_vnni};

#[cfg(test)]
mod tests;
