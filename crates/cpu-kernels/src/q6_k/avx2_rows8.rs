//! The AVX2 Q6_K kernel's block for eight activation rows (a batch of eight decode rows),
//! its integers and each row's f32 step, written out in `asm!`.
//!
//! Why by hand: for eight rows the compiler kept the eight i32 sums, the unpacked chunk, its
//! scales and the masks in the 16 registers only by spilling some of the sums, a store and a
//! reload per chunk each. Here one weight block against the eight rows is a straight run on
//! registers (eight sums, two masks, the block's scales, the chunk, its high bits, its
//! scales and one product: 15). The integers are the intrinsics kernel's (llama.cpp's):
//! per 32-value chunk `vpmaddubsw` of the stored values with the activations, `vpmaddwd`
//! with the chunk's two 16-value scales, added to the row's lanes; then per row the
//! `q8sclsub` correction and `acc = fma(d_y * d_w, lanes, acc)`, as `add_block` does.

use std::arch::asm;
use std::arch::x86_64::*;

// The offsets the `asm!` spells out.
const _: () = assert!(super::Q6K_SCALES == 192 && super::Q8K_BSUMS == 260);

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
    ($how:ident, $c:literal, $lo:literal, $lo_sr:literal, $hi:literal, $hi_shift:literal) => {
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
            row!($how, $c, "y0", "s0"),
            row!($how, $c, "y1", "s1"),
            row!($how, $c, "y2", "s2"),
            row!($how, $c, "y3", "s3"),
            row!($how, $c, "y4", "s4"),
            row!($how, $c, "y5", "s5"),
            row!($how, $c, "y6", "s6"),
            row!($how, $c, "y7", "s7"),
        )
    };
}

macro_rules! row {
    (first, $c:literal, $y:literal, $s:literal) => {
        concat!(
            "vpmaddubsw {t}, {v}, ymmword ptr [{",
            $y,
            "} + 4]\n",
            "vpmaddwd {",
            $s,
            "}, {t}, {sc}\n",
        )
    };
    (add, $c:literal, $y:literal, $s:literal) => {
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

/// Row `$y`'s step after the block's chunks (its lanes in `$s`, the block's scales times 32
/// as i16 in `sc`, `d_w` broadcast in `v`): `lanes - madd(bsums, 32 * scales)` (llama.cpp's
/// `q8sclsub`) as f32, then `acc = fma(d_y * d_w, lanes, acc)` at `$at` bytes into `acc`.
macro_rules! step {
    ($y:literal, $s:literal, $at:literal) => {
        concat!(
            "vpmaddwd {t}, {sc}, ymmword ptr [{",
            $y,
            "} + 260]\n",
            "vpsubd {",
            $s,
            "}, {",
            $s,
            "}, {t}\n",
            "vcvtdq2ps {",
            $s,
            "}, {",
            $s,
            "}\n",
            "vbroadcastss {t}, dword ptr [{",
            $y,
            "}]\n",
            "vmulps {t}, {t}, {v}\n",
            "vfmadd213ps {",
            $s,
            "}, {t}, ymmword ptr [{acc} + ",
            $at,
            "]\n",
            "vmovups ymmword ptr [{acc} + ",
            $at,
            "], {",
            $s,
            "}\n",
        )
    };
}

/// One Q6_K block (`blk`) of one weight row against the Q8_K blocks `y` of eight activation
/// rows, added to the rows' f32 lanes (`acc[a]` for row a, `ROW_STRIDE` bytes apart): the
/// intrinsics kernel's `sumi` (lane l: positions 4l..4l+4 of every chunk, times their
/// scales) and its `add_block` step, the same integers and floats.
///
/// Why the step in here too: after the chunks ran at their pace, the eight rows' steps as
/// intrinsics (sums and accumulators through stack slots around the `asm!`, a call's
/// `array::map`) took a third of the kernel's time (`speed_tile_kernel`: 1.72-1.84 cycles
/// a (row, chunk) against the chunks' own 1.17 in a register-only loop).
///
/// # Safety
/// AVX2 and FMA; `blk` readable for a whole Q6_K block, each `y[i]` for a whole Q8_K block,
/// `acc` readable and writable for eight vectors `ROW_STRIDE` bytes apart.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn block_step(blk: *const u8, y: [*const u8; 8], dw: f32, acc: *mut __m256) {
    let dw = [dw];
    // SAFETY: the caller's bounds; the block reads memory, writes `acc` and touches only
    // its operands.
    asm!(
        "vmovdqu {scales:x}, xmmword ptr [{blk} + 192]",
        // Values 0..128 (ql bytes 0..64, qh bytes 128..160), then 128..256 (64..128, 160..192).
        chunk!(first, 0, 0, "", 128, "vpsllw {hi}, {hi}, 4\n"),
        chunk!(add, 1, 32, "", 128, "vpsllw {hi}, {hi}, 2\n"),
        chunk!(add, 2, 0, "vpsrlw {v}, {v}, 4\n", 128, ""),
        chunk!(add, 3, 32, "vpsrlw {v}, {v}, 4\n", 128, "vpsrlw {hi}, {hi}, 2\n"),
        chunk!(add, 4, 64, "", 160, "vpsllw {hi}, {hi}, 4\n"),
        chunk!(add, 5, 96, "", 160, "vpsllw {hi}, {hi}, 2\n"),
        chunk!(add, 6, 64, "vpsrlw {v}, {v}, 4\n", 160, ""),
        chunk!(add, 7, 96, "vpsrlw {v}, {v}, 4\n", 160, "vpsrlw {hi}, {hi}, 2\n"),
        // The scales times 32 (|32 * sc| <= 4096 fits i16): `madd(bsums, 32 * sc)` is
        // `32 * madd(bsums, sc)`, the same i32 (|bsum| <= 2032, no overflow either way).
        "vpmovsxbw {sc}, {scales:x}",
        "vpsllw {sc}, {sc}, 5",
        "vbroadcastss {v}, dword ptr [{dw}]",
        step!("y0", "s0", 0),
        step!("y1", "s1", 256),
        step!("y2", "s2", 512),
        step!("y3", "s3", 768),
        step!("y4", "s4", 1024),
        step!("y5", "s5", 1280),
        step!("y6", "s6", 1536),
        step!("y7", "s7", 1792),
        blk = in(reg) blk,
        idx = in(reg) SCALE_IDX.as_ptr(),
        dw = in(reg) dw.as_ptr(),
        acc = in(reg) acc,
        y0 = in(reg) y[0],
        y1 = in(reg) y[1],
        y2 = in(reg) y[2],
        y3 = in(reg) y[3],
        y4 = in(reg) y[4],
        y5 = in(reg) y[5],
        y6 = in(reg) y[6],
        y7 = in(reg) y[7],
        scales = out(ymm_reg) _,
        m4 = in(ymm_reg) _mm256_set1_epi8(0x0f),
        m30 = in(ymm_reg) _mm256_set1_epi8(0x30),
        s0 = out(ymm_reg) _,
        s1 = out(ymm_reg) _,
        s2 = out(ymm_reg) _,
        s3 = out(ymm_reg) _,
        s4 = out(ymm_reg) _,
        s5 = out(ymm_reg) _,
        s6 = out(ymm_reg) _,
        s7 = out(ymm_reg) _,
        v = out(ymm_reg) _,
        hi = out(ymm_reg) _,
        sc = out(ymm_reg) _,
        t = out(ymm_reg) _,
        options(nostack, preserves_flags),
    );
}

/// Bytes between one activation row's accumulator for a weight row and the next row's.
pub(super) const ROW_STRIDE: usize = 256;
