//! CPU element-wise ops with llama.cpp's arithmetic (its x86 AVX2 build): RMSNorm and
//! SwiGLU. A quantized model's next-token choice on near-ties follows ulp-level differences
//! (they flip activation quantisation steps downstream), and llama.cpp is the reference our
//! CPU numerics are checked against, so the CPU path does these ops the way it does: the
//! RMSNorm sum of squares in f64 and a multiply by the reciprocal root, SiLU through ggml's
//! vectorised `expf` approximation (`ggml_v_expf`: eight lanes at a time on the x86-64-v3
//! build, `lanes`, one at a time otherwise and for a tail).

/// `x * (1 / sqrt(mean(x^2) + eps)) * w` per row of `x` (`[rows, n]` flattened), as
/// ggml's `rms_norm` (+ `mul`): squares summed in f64, the mean rounded to f32.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    let mut y = vec![0f32; x.len()];
    par_fill(&mut y, n, |at, yr| {
        let xr = &x[at..at + yr.len()];
        let sum: f64 = xr.iter().map(|&v| f64::from(v * v)).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    });
    y
}

/// Fills `out` in pieces of `piece` values (the last may be shorter), `f(offset, piece)`,
/// on candle's pool when there is enough of it: one thread alone on a 512-token prompt's
/// activations left the other cores idle.
fn par_fill(out: &mut [f32], piece: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let pieces = out.len().div_ceil(piece.max(1));
    if out.len() < PARALLEL_VALUES || pieces < 2 {
        for (i, o) in out.chunks_mut(piece.max(1)).enumerate() {
            f(i * piece, o);
        }
        return;
    }
    let (len, base) = (out.len(), crate::attention::SharedOut(out.as_mut_ptr()));
    candle_core::utils::barrier_pool().execute_chunked(pieces, |range| {
        for i in range {
            let at = i * piece;
            // SAFETY: pieces are disjoint and `out` outlives the pool call.
            let o =
                unsafe { std::slice::from_raw_parts_mut(base.get().add(at), piece.min(len - at)) };
            f(at, o);
        }
    });
}

/// Values below which `par_fill` stays on the calling thread (a pool call costs a few
/// microseconds; a decode step's rows are done sooner; the 0.5B's SwiGLU for eight decode
/// rows, 38912 values, took ~24 us alone while the other core waited).
const PARALLEL_VALUES: usize = 1 << 15;

/// ggml's AVX2 `ggml_v_expf` for one lane (same constants, same fused multiply-adds).
pub fn v_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // 0x1.715476p+0
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),                  // 0x1.7f7d1cp-20
        (-n).mul_add(f32::from_bits(0x3f31_7200), x), // 0x1.62e4p-1
    );
    let e = z.to_bits().wrapping_shl(23);
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let c = n.abs() > 126.0;
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010) // 0x1.0e4020p-7
        .mul_add(b, f32::from_bits(0x3d2b_9f17)) // 0x1.573e2ep-5
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)), // 0x1.555e66p-3, 0x1.fffdb6p-2
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6) * b); // 0x1.ffffecp-1
    if !c {
        return j.mul_add(k, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// `silu(gate) * up` as ggml's `swiglu` (AVX2: `x / (1 + v_expf(-x))`, then the product).
pub fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; gate.len().min(up.len())];
    par_fill(&mut y, 4096, |at, out| {
        let (gate, up) = (&gate[at..at + out.len()], &up[at..at + out.len()]);
        let done = lanes::swiglu(out, gate, up);
        for ((o, &x), &g) in out.iter_mut().zip(gate).zip(up).skip(done) {
            *o = x / (1.0 + v_expf(0.0 - x)) * g;
        }
    });
    y
}

/// The x86-64-v3 build (`.cargo/config.toml`): eight lanes per instruction, each lane the
/// scalar function's value bit for bit (the same operations in the same order). Lane by
/// lane SwiGLU took 1.4% of the 0.5B's eight-row decode (six cycles a value).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
pub(crate) mod lanes {
    use std::arch::x86_64::*;

    /// `out[i] = silu(gate[i]) * up[i]` for the first multiple of eight values (returned),
    /// as ggml's AVX2 `ggml_vec_swiglu_f32`: `x / (1 + v_expf(0 - x)) * g`.
    pub fn swiglu(out: &mut [f32], gate: &[f32], up: &[f32]) -> usize {
        let done = out.len().min(gate.len()).min(up.len()) / 8 * 8;
        for at in (0..done).step_by(8) {
            // SAFETY: at + 8 <= done, inside all three slices; features enabled for the
            // whole build (cfg above).
            unsafe {
                let x = _mm256_loadu_ps(gate.as_ptr().add(at));
                let e = v_expf(_mm256_sub_ps(_mm256_setzero_ps(), x));
                let silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
                let y = _mm256_mul_ps(silu, _mm256_loadu_ps(up.as_ptr().add(at)));
                _mm256_storeu_ps(out.as_mut_ptr().add(at), y);
            }
        }
        done
    }

    /// ggml's AVX2 `ggml_v_expf`: eight lanes of [`super::v_expf`].
    ///
    /// # Safety
    /// None beyond the build's target features (the module's cfg).
    #[inline(always)]
    pub unsafe fn v_expf(x: __m256) -> __m256 {
        let set = _mm256_set1_ps;
        let bits = |b: u32| _mm256_set1_ps(f32::from_bits(b));
        let r = bits(0x4b40_0000);
        let z = _mm256_fmadd_ps(x, bits(0x3fb8_aa3b), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(
            n,
            bits(0x35bf_be8e),
            _mm256_fnmadd_ps(n, bits(0x3f31_7200), x),
        );
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
        let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(set(1.0))));
        let abs_n = _mm256_andnot_ps(set(-0.0), n);
        let c = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, set(126.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(bits(0x3c07_2010), b, bits(0x3d2b_9f17)),
                u,
                _mm256_fmadd_ps(bits(0x3e2a_af33), b, bits(0x3eff_fedb)),
            ),
            u,
            _mm256_mul_ps(bits(0x3f7f_fff6), b),
        );
        if _mm256_movemask_ps(c) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let g = _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
            _mm256_set1_epi32(0x8200_0000u32 as i32),
        );
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, set(192.0));
        _mm256_or_ps(
            _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
            _mm256_andnot_ps(
                d,
                _mm256_or_ps(
                    _mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                    _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)),
                ),
            ),
        )
    }
}

/// Builds without AVX2 and FMA: the scalar loops do all the work.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
mod lanes {
    pub fn swiglu(_: &mut [f32], _: &[f32], _: &[f32]) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_expf_is_close_to_exp() {
        for i in -1700..1700 {
            let x = i as f32 * 0.05;
            let (a, b) = (v_expf(x), x.exp());
            assert!((a - b).abs() <= b * 2e-6, "{x}: {a} vs {b}");
        }
        assert_eq!(v_expf(-200.0), 0.0);
        assert!(v_expf(200.0).is_infinite());
    }

    #[test]
    fn large_inputs_split_over_the_pool_give_the_inline_values() {
        // Above `PARALLEL_VALUES` the work runs in pieces on the pool: every value must be
        // what the one-row (inline) computation gives, bit for bit.
        let n = 896;
        let x: Vec<f32> = (0..n * 100)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
            .collect();
        let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 13) as f32 / 8.0).collect();
        assert!(x.len() >= PARALLEL_VALUES);
        let y = rms_norm(&x, &w, 1e-6);
        for (xr, yr) in x.chunks_exact(n).zip(y.chunks_exact(n)) {
            assert_eq!(rms_norm(xr, &w, 1e-6), yr);
        }
        let up: Vec<f32> = x.iter().rev().copied().collect();
        let s = swiglu(&x, &up);
        for (i, v) in s.iter().enumerate() {
            assert_eq!(
                v.to_bits(),
                swiglu(&x[i..i + 1], &up[i..i + 1])[0].to_bits()
            );
        }
    }

    #[test]
    fn swiglu_lanes_equal_the_scalar_values() {
        // Eight at a time (ggml's AVX2 loop) and one at a time must agree bit for bit,
        // over ggml's range paths too (|x| past 126 / ln 2 and 192 / ln 2, where
        // `v_expf` scales or saturates), and for a tail past the last eight.
        let x: Vec<f32> = (0..203)
            .map(|i| match i % 7 {
                0 => -200.0 + i as f32,
                1 => 95.0 - (i as f32) * 0.1,
                2 => -0.0,
                _ => ((i * 7919) % 1013) as f32 / 31.0 - 16.0,
            })
            .collect();
        let up: Vec<f32> = x.iter().map(|v| 0.25 - v * 0.5).collect();
        let all = swiglu(&x, &up);
        for (i, v) in all.iter().enumerate() {
            let one = swiglu(&x[i..i + 1], &up[i..i + 1])[0];
            assert_eq!(v.to_bits(), one.to_bits(), "x = {}", x[i]);
        }
    }

    #[test]
    fn rms_norm_normalises_rows() {
        let x = [3.0f32, 4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let y = rms_norm(&x, &[1.0, 1.0, 1.0, 2.0], 0.0);
        assert!((y[0] - 3.0 / 2.5).abs() < 1e-6 && (y[7] - 2.0).abs() < 1e-6);
    }
}
