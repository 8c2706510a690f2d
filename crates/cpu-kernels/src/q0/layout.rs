//! How `q0` stores its weights, and where the kernels find a block of a row.
//!
//! Q8_0 weights stay as the GGUF file has them (rows of 34-byte blocks): their values load
//! straight into a register, and the model's output matrix shares its bytes with candle's
//! copy. Q5_0 weights are regrouped at load: a decode step's single-row kernel, which
//! multiplies eight weight rows by one activation row, spent more instructions unpacking
//! each 22-byte block than it does on the dot product (compute-bound at 15.4 GB/s on a
//! Zen 3 whose cores read 25). In the grouped layout, for eight rows and one block:
//!
//! - the eight f16 scales side by side (16 bytes): one conversion and one multiply make
//!   all eight `d_w * d_x`, where each row took a load, a broadcast, a conversion, a
//!   multiply and another broadcast;
//! - the eight rows' fifth bits (4 bytes each) permuted so that bit `4t + c` of the file's
//!   `qh` is bit `t` of byte `c`: a 32-bit broadcast puts byte `c` of them in every byte
//!   `j` with `j % 4 == c`, and testing bit `j / 4` there (one `and` and one compare per
//!   register) spreads value `j`'s fifth bit without a byte shuffle;
//! - the eight rows' 16 nibble bytes as stored.
//!
//! The same bytes in another order: the same integers and float steps, so every kernel
//! stays bit for bit what llama.cpp computes, and the weight takes no more memory. A group
//! is one stream in memory (176 bytes a block), where eight rows side by side were eight.

use super::{Format, Q5_BYTES, Q8_BYTES, QK, TILE};

/// Bytes of one block of a group of eight Q5_0 rows.
pub(super) const GROUP_BLOCK: usize = TILE * Q5_BYTES;
/// Where a group block's parts start: scales, fifth bits, nibbles.
const QH_AT: usize = 2 * TILE;
const QS_AT: usize = QH_AT + 4 * TILE;
const _: () = assert!(QS_AT + 16 * TILE == GROUP_BLOCK);

/// Bytes of an `[n, k / 32]`-block weight as `q0` stores it (Q5_0 groups padded with zero
/// rows to a multiple of eight).
pub(super) fn stored_len(format: Format, n: usize, kb: usize) -> usize {
    match format {
        Format::Q8_0 => n * kb * Q8_BYTES,
        Format::Q5_0 => n.div_ceil(TILE) * kb * GROUP_BLOCK,
    }
}

/// The file's `qh` of one block as the grouped layout stores it (see the module note):
/// byte c gathers bits c, c + 4, .., c + 28 (by shifts and masks; a loop over the 32 bits
/// made loading the 0.5B a second slower).
fn permute_qh(qh: u32) -> [u8; 4] {
    std::array::from_fn(|c| {
        let x = qh >> c & 0x1111_1111;
        let x = (x | x >> 3) & 0x0303_0303;
        let x = (x | x >> 6) & 0x000f_000f;
        ((x | x >> 12) & 0xff) as u8
    })
}

/// The inverse of [`permute_qh`].
fn unpermute_qh(p: [u8; 4]) -> u32 {
    (0..QK).fold(0, |qh, j| qh | (u32::from(p[j % 4] >> (j / 4) & 1) << j))
}

/// GGUF Q5_0 rows (`n` rows of `kb` blocks) in the grouped layout.
pub(super) fn pack_q5_0(rows: &[u8], n: usize, kb: usize) -> Vec<u8> {
    assert_eq!(rows.len(), n * kb * Q5_BYTES, "q5_0 weight size");
    let mut out = vec![0u8; stored_len(Format::Q5_0, n, kb)];
    for r in 0..n {
        let (g, i) = (r / TILE, r % TILE);
        for b in 0..kb {
            let src = &rows[(r * kb + b) * Q5_BYTES..][..Q5_BYTES];
            let dst = &mut out[(g * kb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
            dst[2 * i..2 * i + 2].copy_from_slice(&src[..2]);
            let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
            dst[QH_AT + 4 * i..QH_AT + 4 * i + 4].copy_from_slice(&permute_qh(qh));
            dst[QS_AT + 16 * i..QS_AT + 16 * i + 16].copy_from_slice(&src[6..]);
        }
    }
    out
}

/// Grouped Q5_0 weights back into GGUF rows (the first `n`): what stacking weights needs.
pub(super) fn unpack_q5_0(grouped: &[u8], n: usize, kb: usize) -> Vec<u8> {
    assert_eq!(
        grouped.len(),
        stored_len(Format::Q5_0, n, kb),
        "q5_0 weight size"
    );
    let mut out = vec![0u8; n * kb * Q5_BYTES];
    for r in 0..n {
        let (g, i) = (r / TILE, r % TILE);
        for b in 0..kb {
            let src = &grouped[(g * kb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
            let dst = &mut out[(r * kb + b) * Q5_BYTES..][..Q5_BYTES];
            dst[..2].copy_from_slice(&src[2 * i..2 * i + 2]);
            let p = &src[QH_AT + 4 * i..QH_AT + 4 * i + 4];
            dst[2..6].copy_from_slice(&unpermute_qh([p[0], p[1], p[2], p[3]]).to_le_bytes());
            dst[6..].copy_from_slice(&src[QS_AT + 16 * i..QS_AT + 16 * i + 16]);
        }
    }
    out
}

/// Where eight weight rows' blocks are in the stored weight: row i's block b has its f16
/// scale at byte `scale[i] + b * stride`, its fifth bits (Q5_0: 4 bytes, permuted) at
/// `qh[i] + b * stride`, and its values (Q8_0: 32 bytes) or nibbles (Q5_0: 16 bytes) at
/// `qs[i] + b * stride`. Rows past the weight's last (a short last group) repeat it (Q8_0)
/// or are the group's zero padding (Q5_0); their results are dropped.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rows {
    pub scale: [usize; TILE],
    pub qh: [usize; TILE],
    pub qs: [usize; TILE],
    pub stride: usize,
}

impl Rows {
    /// Group `g` (rows `8g..8g + 8`) of an `[n, kb]`-block weight stored as `format`.
    pub fn group(format: Format, n: usize, kb: usize, g: usize) -> Self {
        match format {
            Format::Q8_0 => {
                let row = |i: usize| (g * TILE + i).min(n - 1) * kb * Q8_BYTES;
                Self {
                    scale: std::array::from_fn(row),
                    qh: std::array::from_fn(row),
                    qs: std::array::from_fn(|i| row(i) + 2),
                    stride: Q8_BYTES,
                }
            }
            Format::Q5_0 => {
                let base = g * kb * GROUP_BLOCK;
                Self {
                    scale: std::array::from_fn(|i| base + 2 * i),
                    qh: std::array::from_fn(|i| base + QH_AT + 4 * i),
                    qs: std::array::from_fn(|i| base + QS_AT + 16 * i),
                    stride: GROUP_BLOCK,
                }
            }
        }
    }

    /// Panics unless all `kb` blocks of every row lie inside a stored weight of `len`
    /// bytes: the SIMD kernels read them through raw pointers.
    pub fn check(&self, format: Format, len: usize, kb: usize) {
        let qs_len = match format {
            Format::Q5_0 => 16,
            Format::Q8_0 => 32,
        };
        let last = kb.saturating_sub(1) * self.stride;
        for i in 0..TILE {
            let end = (self.scale[i] + 2)
                .max(self.qh[i] + 4)
                .max(self.qs[i] + qs_len);
            assert!(kb > 0 && end + last <= len, "q0 rows outside the weight");
            // Q5_0 rows are one group: the single-row kernel reads a block's eight scales
            // side by side.
            assert!(format == Format::Q8_0 || self.scale[i] == self.scale[0] + 2 * i);
        }
    }

    /// The 32 weights of row `i`'s block `b`.
    pub fn values(&self, format: Format, w: &[u8], i: usize, b: usize) -> [i32; QK] {
        let at = b * self.stride;
        match format {
            Format::Q8_0 => {
                let qs = &w[self.qs[i] + at..][..QK];
                std::array::from_fn(|v| qs[v] as i8 as i32)
            }
            Format::Q5_0 => {
                let qs = &w[self.qs[i] + at..][..QK / 2];
                let qh = &w[self.qh[i] + at..][..4];
                std::array::from_fn(|v| {
                    let nib = if v < QK / 2 {
                        qs[v] & 0x0f
                    } else {
                        qs[v - QK / 2] >> 4
                    };
                    let bit = qh[v % 4] >> (v / 4) & 1;
                    i32::from(nib | bit << 4) - 16
                })
            }
        }
    }

    /// Row `i`'s block `b` scale.
    pub fn scale(&self, w: &[u8], i: usize, b: usize) -> f32 {
        super::f16_at(w, self.scale[i] + b * self.stride)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qh_permutation_round_trips_and_matches_the_decoder() {
        for qh in [0u32, 1, 0x8000_0001, 0xdead_beef, u32::MAX, 1 << 17] {
            let p = permute_qh(qh);
            assert_eq!(unpermute_qh(p), qh);
            // The SIMD decoder: byte j sees byte j % 4 and tests bit j / 4.
            for j in 0..QK {
                assert_eq!(p[j % 4] >> (j / 4) & 1, (qh >> j & 1) as u8, "bit {j}");
            }
        }
    }

    #[test]
    fn grouping_round_trips_with_a_short_last_group() {
        let (n, kb) = (11, 3);
        let rows: Vec<u8> = (0..n * kb * Q5_BYTES)
            .map(|i| (i * 37 % 251) as u8)
            .collect();
        let grouped = pack_q5_0(&rows, n, kb);
        assert_eq!(grouped.len(), 2 * kb * GROUP_BLOCK);
        assert_eq!(unpack_q5_0(&grouped, n, kb), rows);
        // Values read through `Rows` are the file's.
        for r in 0..n {
            let at = Rows::group(Format::Q5_0, n, kb, r / TILE);
            at.check(Format::Q5_0, grouped.len(), kb);
            for b in 0..kb {
                let blk = &rows[(r * kb + b) * Q5_BYTES..];
                let got = at.values(Format::Q5_0, &grouped, r % TILE, b);
                for (v, &got) in got.iter().enumerate() {
                    assert_eq!(got, Format::Q5_0.value(blk, v));
                }
                let (got, want) = (
                    at.scale(&grouped, r % TILE, b),
                    super::super::f16_at(blk, 0),
                );
                assert_eq!(got.to_bits(), want.to_bits());
            }
        }
    }
}
