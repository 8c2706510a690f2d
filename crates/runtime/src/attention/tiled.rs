//! Prompt attention as llama.cpp's CPU flash attention runs it once a batch holds at least
//! 64 query rows (`ggml_compute_forward_flash_attn_ext_tiled`): f32 queries, the cached K
//! and V converted from f16 a tile of 64 keys at a time, scores and weighted values as f32
//! matrix products, and an online softmax per tile with ggml's vector `expf`. Against the
//! one-key-at-a-time loop (`attend_group`) the products run eight keys or dimensions per
//! instruction, which is where a 512-token prompt spent a tenth of its time.

/// Query rows per tile (`GGML_FA_TILE_Q`); rows at or past it take this path.
pub const Q_TILE: usize = 64;
/// Keys per tile (`GGML_FA_TILE_KV`): tiles start at multiples of it in key position.
const KV_TILE: usize = 64;

/// `c[m × n] += a[m × kd] · b[kd × n]` (rows contiguous): every output a chain of fused
/// multiply-adds in `kd` order, as ggml's `simd_gemm` leaves each of its lanes.
fn gemm(c: &mut [f32], a: &[f32], b: &[f32], m: usize, kd: usize, n: usize) {
    assert!(c.len() >= m * n && a.len() >= m * kd && b.len() >= kd * n);
    let done = lanes::gemm(c, a, b, m, kd, n);
    for i in 0..m {
        for j in done..n {
            let mut acc = c[i * n + j];
            for x in 0..kd {
                acc = a[i * kd + x].mul_add(b[x * n + j], acc);
            }
            c[i * n + j] = acc;
        }
    }
}

/// ggml's `ggml_vec_soft_max_f32` (AVX2) over a multiple of eight values: each becomes
/// `v_expf(x - max)`; each eight's sum, `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`
/// in f32, is added up in f64.
fn soft_max(row: &mut [f32], max: f32) -> f64 {
    if let Some(sum) = lanes::soft_max(row, max) {
        return sum;
    }
    let mut sum = 0f64;
    for v in row.chunks_exact_mut(8) {
        for x in v.iter_mut() {
            *x = crate::ggml_ops::v_expf(*x - max);
        }
        let t: [f32; 4] = std::array::from_fn(|l| v[l + 4] + v[l]);
        sum += f64::from((t[0] + t[2]) + (t[1] + t[3]));
    }
    sum
}

/// One tile of prompt rows, the `g` query heads of one KV head, over the cached keys
/// `0..=first_pos + rows - 1`, each row `t` (position `first_pos + t`) seeing keys up to its
/// own position. `q(t, h)`: head h's f32 query of row t; `base(j)`: key j's offset in `kc` /
/// `vc`; `write(t, h, out)` receives each head's output.
#[allow(clippy::too_many_arguments)]
pub fn attend_tile<'q>(
    rows: usize,
    first_pos: usize,
    g: usize,
    hd: usize,
    q: impl Fn(usize, usize) -> &'q [f32],
    base: impl Fn(usize) -> usize,
    kc: &[u16],
    vc: &[u16],
    scale: f32,
    mut write: impl FnMut(usize, usize, &[f32]),
) {
    let n_keys = first_pos + rows;
    // Per head h, rows `h * rows ..`: queries, running maxima, sums, weighted values.
    let mut qs = vec![0f32; g * rows * hd];
    for h in 0..g {
        for t in 0..rows {
            qs[(h * rows + t) * hd..][..hd].copy_from_slice(q(t, h));
        }
    }
    let mut max = vec![f32::NEG_INFINITY; g * rows];
    let mut sum = vec![0f32; g * rows];
    let mut acc = vec![0f32; g * rows * hd];
    let mut k_t = vec![0f32; hd * KV_TILE];
    let mut v32 = vec![0f32; KV_TILE * hd];
    let mut kq = vec![0f32; rows * KV_TILE];
    let to_f32 = |b: u16| half::f16::from_bits(b).to_f32();
    for start in (0..n_keys).step_by(KV_TILE) {
        let keys = KV_TILE.min(n_keys - start);
        // K transposed (a key per column), V a key per row; zero past the last key (only
        // the last tile can be short; full tiles overwrite every entry).
        if keys < KV_TILE {
            k_t.fill(0.0);
            v32.fill(0.0);
        }
        for tk in 0..keys {
            let at = base(start + tk);
            for (d, &b) in kc[at..at + hd].iter().enumerate() {
                k_t[d * KV_TILE + tk] = to_f32(b);
            }
            for (x, &b) in v32[tk * hd..(tk + 1) * hd].iter_mut().zip(&vc[at..at + hd]) {
                *x = to_f32(b);
            }
        }
        for h in 0..g {
            let heads = h * rows..(h + 1) * rows;
            kq.fill(0.0);
            gemm(&mut kq, &qs[heads.start * hd..], &k_t, rows, hd, KV_TILE);
            for (t, row) in kq.chunks_exact_mut(KV_TILE).enumerate() {
                let (m, s) = (&mut max[heads.start + t], &mut sum[heads.start + t]);
                // Keys past the tile or past the row's own position are masked out.
                let visible = (first_pos + t + 1).saturating_sub(start).min(keys);
                for x in &mut row[..visible] {
                    *x *= scale;
                }
                row[visible..].fill(f32::NEG_INFINITY);
                let tile_max = row
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &x| if m > x { m } else { x });
                if tile_max == f32::NEG_INFINITY {
                    row.fill(0.0);
                    continue;
                }
                let new = m.max(tile_max);
                if new > *m {
                    let ms = (*m - new).exp();
                    for x in &mut acc[(heads.start + t) * hd..][..hd] {
                        *x *= ms;
                    }
                    *s *= ms;
                }
                *m = new;
                *s = (f64::from(*s) + soft_max(row, new)) as f32;
            }
            gemm(
                &mut acc[heads.start * hd..heads.end * hd],
                &kq,
                &v32,
                rows,
                KV_TILE,
                hd,
            );
        }
    }
    let mut out = vec![0f32; hd];
    for h in 0..g {
        for t in 0..rows {
            let i = h * rows + t;
            let inv = if sum[i] == 0.0 { 0.0 } else { 1.0 / sum[i] };
            for (o, &a) in out.iter_mut().zip(&acc[i * hd..(i + 1) * hd]) {
                *o = a * inv;
            }
            write(t, h, &out);
        }
    }
}

/// The x86-64-v3 build (`.cargo/config.toml`): eight lanes per instruction.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod lanes {
    use std::arch::x86_64::*;

    /// Columns `0..done` of `gemm` (`done` the multiple of eight below `n`, returned): six
    /// rows by sixteen columns of accumulators in registers (ggml's AVX2 `GEMM_RM` x
    /// `GEMM_RN`), then single rows, then eight columns.
    pub fn gemm(c: &mut [f32], a: &[f32], b: &[f32], m: usize, kd: usize, n: usize) -> usize {
        let done = n / 8 * 8;
        let mut i = 0;
        while i < m {
            let rm = if i + 6 <= m { 6 } else { 1 };
            let mut j = 0;
            while j < done {
                let rn = if j + 16 <= done { 2 } else { 1 };
                // SAFETY: the caller checked the lengths of c, a and b for m rows, kd
                // inner values and n columns; rows i..i + rm and columns j..j + 8 * rn
                // lie inside them. Features enabled for the whole build (cfg above).
                unsafe {
                    let (c, a, b) = (
                        c.as_mut_ptr().add(i * n + j),
                        a.as_ptr().add(i * kd),
                        b.as_ptr().add(j),
                    );
                    match (rm, rn) {
                        (6, 2) => block::<6, 2>(c, a, b, kd, n),
                        (6, _) => block::<6, 1>(c, a, b, kd, n),
                        (_, 2) => block::<1, 2>(c, a, b, kd, n),
                        _ => block::<1, 1>(c, a, b, kd, n),
                    }
                }
                j += 8 * rn;
            }
            i += rm;
        }
        done
    }

    #[inline(always)]
    unsafe fn block<const RM: usize, const RN: usize>(
        c: *mut f32,
        a: *const f32,
        b: *const f32,
        kd: usize,
        n: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); RN]; RM];
        for (r, row) in acc.iter_mut().enumerate() {
            for (s, v) in row.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(c.add(r * n + 8 * s));
            }
        }
        for x in 0..kd {
            let mut bv = [_mm256_setzero_ps(); RN];
            for (s, v) in bv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(b.add(x * n + 8 * s));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let p = _mm256_set1_ps(*a.add(r * kd + x));
                for (v, bs) in row.iter_mut().zip(&bv) {
                    *v = _mm256_fmadd_ps(*bs, p, *v);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (s, v) in row.iter().enumerate() {
                _mm256_storeu_ps(c.add(r * n + 8 * s), *v);
            }
        }
    }

    /// `soft_max` eight lanes at a time; `None` when the row is not a multiple of eight.
    pub fn soft_max(row: &mut [f32], max: f32) -> Option<f64> {
        if !row.len().is_multiple_of(8) {
            return None;
        }
        let mut sum = 0f64;
        for v in row.chunks_exact_mut(8) {
            // SAFETY: eight values per chunk; features enabled for the build.
            unsafe {
                let val = crate::ggml_ops::lanes::v_expf(_mm256_sub_ps(
                    _mm256_loadu_ps(v.as_ptr()),
                    _mm256_set1_ps(max),
                ));
                _mm256_storeu_ps(v.as_mut_ptr(), val);
                let s = _mm_add_ps(_mm256_extractf128_ps::<1>(val), _mm256_castps256_ps128(val));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                sum += f64::from(_mm_cvtss_f32(s));
            }
        }
        Some(sum)
    }
}

/// Builds without AVX2 and FMA: the callers' scalar loops do all the work.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
mod lanes {
    pub fn gemm(_: &mut [f32], _: &[f32], _: &[f32], _: usize, _: usize, _: usize) -> usize {
        0
    }

    pub fn soft_max(_: &mut [f32], _: f32) -> Option<f64> {
        None
    }
}

#[cfg(test)]
mod tests;
