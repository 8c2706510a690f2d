//! The integer part of the AVX2 Q6_K kernel for eight activation rows (a batch of eight
//! decode rows), written out in `asm!`.
//!
//! Why by hand: for eight rows the compiler kept the eight i32 sums, the unpacked chunk, its
//! scales and the masks in the 16 registers only by spilling some of the sums, a store and a
//! reload per chunk each. Here one weight block against the eight rows is a straight run on
//! registers (eight sums, two masks, the block's scales, the chunk, its high bits, its
//! scales and one product: 15). The integers are the intrinsics kernel's (llama.cpp's):
//! per 32-value chunk `vpmaddubsw` of the stored values with the activations, `vpmaddwd`
//! with the chunk's two 16-value scales, added to the row's lanes.

use std::arch::asm;
use std::arch::x86_64::*;

/// Per chunk c, the `vpshufb` indices that spread scales 2c (lanes 0-7) and 2c + 1 (8-15).
static SCALE_IDX: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut c = 0;
    while c < 8 {
        let mut i = 0;
        while i < 16 {
            t[c][i] = (2 * c + i / 8) as u8;
            i += 1;
        }
        c += 1;
    }
    t
};

/// Chunk `$c` of the block: its low four bits from `$lo` (bytes into the block, shifted
/// right by `$lo_sr`), its two high bits from `$hi` (shifted by `$hi_shift`), against row
/// `i`'s activations `4 + 32 * $c` bytes into its Q8_K block.
macro_rules! chunk {
    ($c:literal, $lo:literal, $lo_sr:literal, $hi:literal, $hi_shift:literal) => {
        concat!(
            "vmovdqu {v}, ymmword ptr [{blk} + ",
            $lo,
            "]\n",
            $lo_sr,
            "vmovdqu {hi}, ymmword ptr [{blk} + ",
            $hi,
            "]\n",
            $hi_shift,
            "vpand {v}, {v}, {m4}\n",
            "vpand {hi}, {hi}, {m30}\n",
            "vpor {v}, {v}, {hi}\n",
            "vpshufb {sc:x}, {scales:x}, xmmword ptr [{idx} + 16 * ",
            $c,
            "]\n",
            "vpmovsxbw {sc}, {sc:x}\n",
            row!($c, "y0", "s0"),
            row!($c, "y1", "s1"),
            row!($c, "y2", "s2"),
            row!($c, "y3", "s3"),
            row!($c, "y4", "s4"),
            row!($c, "y5", "s5"),
            row!($c, "y6", "s6"),
            row!($c, "y7", "s7"),
        )
    };
}

macro_rules! row {
    ($c:literal, $y:literal, $s:literal) => {
        concat!(
            "vpmaddubsw {t}, {v}, ymmword ptr [{",
            $y,
            "} + 4 + 32 * ",
            $c,
            "]\n",
            "vpmaddwd {t}, {t}, {sc}\n",
            "vpaddd {",
            $s,
            "}, {",
            $s,
            "}, {t}\n",
        )
    };
}

/// One Q6_K block (`blk`, its scales as 16 i8 in `scales`) against the Q8_K blocks `y` of
/// eight activation rows: each row's eight i32 lanes before `q8sclsub` (lane l: positions
/// 4l..4l+4 of every chunk, times their scales), as the intrinsics kernel's `sumi`.
///
/// # Safety
/// AVX2; `blk` readable for a whole Q6_K block, each `y[i]` for a whole Q8_K block.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn block_sums(
    blk: *const u8,
    scales: __m128i,
    y: [*const u8; 8],
) -> [__m256i; 8] {
    let mut s = [_mm256_setzero_si256(); 8];
    let scales = _mm256_castsi128_si256(scales);
    // SAFETY: the caller's bounds; the block reads memory and touches only its operands.
    asm!(
        // Values 0..128 (ql bytes 0..64, qh bytes 128..160), then 128..256 (64..128, 160..192).
        chunk!(0, 0, "", 128, "vpsllw {hi}, {hi}, 4\n"),
        chunk!(1, 32, "", 128, "vpsllw {hi}, {hi}, 2\n"),
        chunk!(2, 0, "vpsrlw {v}, {v}, 4\n", 128, ""),
        chunk!(3, 32, "vpsrlw {v}, {v}, 4\n", 128, "vpsrlw {hi}, {hi}, 2\n"),
        chunk!(4, 64, "", 160, "vpsllw {hi}, {hi}, 4\n"),
        chunk!(5, 96, "", 160, "vpsllw {hi}, {hi}, 2\n"),
        chunk!(6, 64, "vpsrlw {v}, {v}, 4\n", 160, ""),
        chunk!(7, 96, "vpsrlw {v}, {v}, 4\n", 160, "vpsrlw {hi}, {hi}, 2\n"),
        blk = in(reg) blk,
        idx = in(reg) SCALE_IDX.as_ptr(),
        y0 = in(reg) y[0],
        y1 = in(reg) y[1],
        y2 = in(reg) y[2],
        y3 = in(reg) y[3],
        y4 = in(reg) y[4],
        y5 = in(reg) y[5],
        y6 = in(reg) y[6],
        y7 = in(reg) y[7],
        scales = in(ymm_reg) scales,
        m4 = in(ymm_reg) _mm256_set1_epi8(0x0f),
        m30 = in(ymm_reg) _mm256_set1_epi8(0x30),
        s0 = inout(ymm_reg) s[0],
        s1 = inout(ymm_reg) s[1],
        s2 = inout(ymm_reg) s[2],
        s3 = inout(ymm_reg) s[3],
        s4 = inout(ymm_reg) s[4],
        s5 = inout(ymm_reg) s[5],
        s6 = inout(ymm_reg) s[6],
        s7 = inout(ymm_reg) s[7],
        v = out(ymm_reg) _,
        hi = out(ymm_reg) _,
        sc = out(ymm_reg) _,
        t = out(ymm_reg) _,
        options(nostack, readonly, preserves_flags),
    );
    s
}
