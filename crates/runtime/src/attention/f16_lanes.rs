//! The vector steps of CPU attention: eight f32 lanes at a time with F16C on the x86-64-v3
//! build, and a portable stand-in that does nothing (the callers finish every lane the
//! vector code leaves).

/// The x86-64-v3 build (`.cargo/config.toml`): eight lanes at a time with F16C.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod lanes {
    use std::arch::x86_64::*;

    /// Round eight f32 to f16 precision (to nearest, ties to even, like `f16r`).
    #[inline]
    unsafe fn round(v: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
    }

    /// Lanes `0..done` of `o` (`done` a multiple of 64, returned) carried on over `keys`
    /// as an f16 running sum of values: per key, `o = f16(o * ms[j])` unless `ms[j]` is
    /// 1.0, then `o = f16(value(j) * vs[j] + o)`. 64 lanes at a time stay in eight
    /// registers across the keys.
    #[inline]
    pub fn weigh_values<'v>(
        o: &mut [f32],
        keys: std::ops::Range<usize>,
        value: &impl Fn(usize) -> &'v [u16],
        value_ahead: &impl Fn(usize) -> Option<&'v [u16]>,
        ms: &[f32],
        vs: &[f32],
    ) -> usize {
        let done = o.len() / 64 * 64;
        for c in (0..done).step_by(64) {
            // SAFETY: the target features are enabled for the whole build (cfg above);
            // every value row is `o.len()` long (checked), so lanes c..c+64 exist.
            unsafe {
                let mut acc: [__m256; 8] =
                    std::array::from_fn(|i| _mm256_loadu_ps(o.as_ptr().add(c + 8 * i)));
                for j in keys.clone() {
                    if let Some(next) = value_ahead(j) {
                        prefetch(&next[c..c + 64]);
                    }
                    let v = value(j);
                    assert!(v.len() == o.len());
                    if ms[j] != 1.0 {
                        let m = _mm256_set1_ps(ms[j]);
                        for a in &mut acc {
                            *a = round(_mm256_mul_ps(*a, m));
                        }
                    }
                    let w = _mm256_set1_ps(vs[j]);
                    for (i, a) in acc.iter_mut().enumerate() {
                        let x = load_f16(v.as_ptr().add(c + 8 * i));
                        *a = round(_mm256_fmadd_ps(x, w, *a));
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add(c + 8 * i), *a);
                }
            }
        }
        done
    }

    /// Eight f16 (bits) at `p` as f32.
    #[inline]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// Ask for the cache lines of `x` (a hint; no effect on results).
    #[inline]
    pub fn prefetch(x: &[u16]) {
        for line in (0..x.len()).step_by(32) {
            // SAFETY: a prefetch of an address inside `x` (it cannot fault either way).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(x.as_ptr().add(line) as *const i8) };
        }
    }

    /// `dot_f16` for lengths that are a multiple of 32 (the same lanes, steps and final
    /// sums), else `None`.
    #[inline]
    pub fn dot(a: &[u16], b: &[f32]) -> Option<f32> {
        if a.len() != b.len() || !a.len().is_multiple_of(32) {
            return None;
        }
        // SAFETY: the target features are enabled for the whole build; the lengths are
        // checked above.
        unsafe {
            let t = four_sums(a, b);
            let t = _mm_hadd_ps(t, t);
            Some(_mm_cvtss_f32(_mm_hadd_ps(t, t)))
        }
    }

    /// `dot` of four rows `a` with one `b`, each the same sum as alone: the last two
    /// `hadd` steps of four rows share two `hadd`s across them (`[a01, a23, b01, b23]`, then
    /// `a01 + a23` in lane 0, ...), where one row at a time waited on its own chain.
    #[inline]
    pub fn dot4(a: [&[u16]; 4], b: &[f32]) -> Option<[f32; 4]> {
        if a.iter().any(|a| a.len() != b.len()) || !b.len().is_multiple_of(32) {
            return None;
        }
        // SAFETY: as in `dot`, for each of the four rows. A loop, not `array::map`: its
        // closure was not inlined (a call per row, the sums passed through memory).
        unsafe {
            let mut t = [_mm_setzero_ps(); 4];
            for (t, a) in t.iter_mut().zip(a) {
                *t = four_sums(a, b);
            }
            let sums = _mm_hadd_ps(_mm_hadd_ps(t[0], t[1]), _mm_hadd_ps(t[2], t[3]));
            let mut out = [0f32; 4];
            _mm_storeu_ps(out.as_mut_ptr(), sums);
            Some(out)
        }
    }

    /// The products of `a` and `b` in ggml's four accumulators of eight lanes, reduced to
    /// four lanes (`(acc0 + acc2) + (acc1 + acc3)`, then lane l plus lane l + 4).
    ///
    /// # Safety
    /// `a` and `b` of one length, a multiple of 32.
    #[inline]
    unsafe fn four_sums(a: &[u16], b: &[f32]) -> __m128 {
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..a.len()).step_by(32) {
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = load_f16(a.as_ptr().add(i + 8 * j));
                let y = _mm256_loadu_ps(b.as_ptr().add(i + 8 * j));
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
        }
        let x = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
        _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x))
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
mod lanes {
    pub fn dot(_: &[u16], _: &[f32]) -> Option<f32> {
        None
    }
    pub fn dot4(_: [&[u16]; 4], _: &[f32]) -> Option<[f32; 4]> {
        None
    }
    pub fn weigh_values<'v>(
        _: &mut [f32],
        _: std::ops::Range<usize>,
        _: &impl Fn(usize) -> &'v [u16],
        _: &impl Fn(usize) -> Option<&'v [u16]>,
        _: &[f32],
        _: &[f32],
    ) -> usize {
        0
    }
    pub fn prefetch(_: &[u16]) {}
}

pub use lanes::*;
