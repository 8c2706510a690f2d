//! Sampling where the logits are (a GPU): one token per row without sorting the vocabulary
//! or copying it to the host, so a sampled request (temperature > 0, OpenAI's default) runs
//! as fast as a greedy one.
//!
//! In scaled logits `s_i = (l_i - max) / T` the kept set is `s >= t` for one threshold `t`:
//! the host sampler's 30-nat floor (or its top-k), min-p (`ln min_p`) and top-p (the
//! smallest top mass reaching `top_p`) each give a lower bound; top-k and top-p are found by
//! a few 16-way searches, each one pass over the row. The token is then drawn by a Gumbel
//! race, the argmax of `s_i - ln(-ln u_i)` over the kept set, which picks `i` with
//! probability `e^{s_i} / Σ_kept e^{s_j}`: the host's distribution. `u_i` is a hash of the
//! row's key (drawn from the request's own RNG) and `i`, so a row's pick depends only on its
//! logits, parameters and key, never on what else is in the batch.
//!
//! This file is the reference the CUDA kernel (kernels/sample.cuh) follows step for step;
//! on a CPU it is what `StepOutput::sample_rows` runs. It is not the host sampler's
//! algorithm ([`super::Sampler`] sorts its candidates): the same distribution, other draws.

/// One row's draw: the request's sampling parameters and this step's key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowDraw {
    /// `<= 0`: greedy (the argmax among the allowed ids).
    pub temperature: f32,
    /// 0: no top-k.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// Seeds this row's uniforms (from the request's RNG; unused when greedy).
    pub key: u64,
}

impl RowDraw {
    /// A sampled draw with key 0 (set the key per step).
    pub fn sampled(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> Self {
        Self {
            temperature,
            top_k,
            top_p,
            min_p,
            key: 0,
        }
    }

    /// Greedy: the argmax among the allowed ids.
    pub const GREEDY: RowDraw = RowDraw {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        key: 0,
    };
}

/// Most top alternatives a row draws with (one pass over the row each on a GPU); a
/// request asking for more is sampled on the host.
pub const TOP_MAX: usize = 32;

/// Tokens more than 30 nats below the best are left out (as the host sampler does: each
/// carries under 1e-13 of the best one's probability).
pub const FLOOR: f32 = -30.0;
/// Where the top-k search starts: `e^-88` is below f32's smallest normal.
pub const LOWEST: f32 = -88.0;
/// Thresholds tried by one pass of a search (16 = the lower bound and 15 more).
const WAYS: usize = 16;
/// Passes of a search: the threshold is found to within `range / 16^7` (5e-7 of a nat
/// over the top-k range), so only ids that close to the cut are kept beyond it.
const PASSES: usize = 7;

/// `u_i` in (0, 1): 23 bits of splitmix64's finaliser over the key and the id (exact in
/// f32, never 0 or 1, so `-ln(-ln u)` is finite).
pub fn uniform(key: u64, id: u32) -> f32 {
    let mut z = key ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 41) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// The Gumbel noise `-ln(-ln u)` of id `id` under `key`.
pub fn gumbel(key: u64, id: u32) -> f32 {
    -(-uniform(key, id).ln()).ln()
}

/// A change penalties or bias make to one id's logit, in vLLM's and llama.cpp's order:
/// `x + bias`, then divided by `rep` when positive and multiplied by it otherwise (the
/// repetition penalty; 1 = none), then `- sub` (frequency and presence penalties).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjust {
    pub id: u32,
    pub sub: f32,
    pub rep: f32,
    pub bias: f32,
}

impl Adjust {
    pub fn apply(&self, x: f32) -> f32 {
        let mut x = x + self.bias;
        if self.rep != 1.0 {
            x = if x > 0.0 { x / self.rep } else { x * self.rep };
        }
        x - self.sub
    }
}

/// Everything one row's draw needs: the draw, its logit adjustments (at most one per id)
/// and how many top alternatives to report.
#[derive(Clone, Debug, PartialEq)]
pub struct DrawRow {
    pub draw: RowDraw,
    pub adjust: Vec<Adjust>,
    pub top: usize,
}

impl DrawRow {
    /// A greedy row with nothing else asked (a row the host samples, drawn but unused).
    pub fn greedy() -> Self {
        Self {
            draw: RowDraw::GREEDY,
            adjust: Vec::new(),
            top: 0,
        }
    }
}

/// The token of one row (its first `allowed.len()` or all logits; `allowed` flags the ids
/// that may be picked, 1 = may), chosen over the raw logits after `adjust`, with its
/// log-probability under the raw row. A row holding a NaN gives `(0, NaN)`: it fails
/// alone, as on the host.
pub fn pick(raw: &[f32], adjust: &[Adjust], allowed: Option<&[u8]>, draw: &RowDraw) -> (u32, f32) {
    let ok = |i: usize| allowed.is_none_or(|a| a.get(i).is_some_and(|&f| f != 0));
    if raw.iter().any(|v| v.is_nan()) {
        return (0, f32::NAN);
    }
    let lse = super::log_sum_exp(raw);
    let adjusted;
    let row = if adjust.is_empty() {
        raw
    } else {
        let mut copy = raw.to_vec();
        for a in adjust {
            if let Some(x) = copy.get_mut(a.id as usize) {
                *x = a.apply(*x);
            }
        }
        adjusted = copy;
        &adjusted[..]
    };
    // The best allowed id (the first of equals).
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if ok(i) && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    let token = match best {
        Some((i, max)) if draw.temperature > 0.0 && max > f32::NEG_INFINITY => {
            let inv_t = 1.0 / draw.temperature;
            let scaled: Vec<f32> = row
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    if ok(i) {
                        (v - max) * inv_t
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            race(&scaled, threshold(&scaled, draw), draw.key).unwrap_or(i)
        }
        Some((i, _)) => i,
        None => 0,
    };
    (token as u32, raw.get(token).map_or(f32::NAN, |&v| v - lse))
}

/// [`pick`] with the row's top alternatives (as the host reports them: raw
/// log-probabilities, best first, ties to the lower id, none at -inf).
pub fn pick_row(raw: &[f32], row: &DrawRow, allowed: Option<&[u8]>) -> super::Sampled {
    let (token, logprob) = pick(raw, &row.adjust, allowed, &row.draw);
    let (logprob, top) = if logprob.is_nan() {
        (logprob, Vec::new())
    } else {
        super::logprob_and_top(raw, super::log_sum_exp(raw), token, row.top)
    };
    super::Sampled {
        token,
        logprob,
        top,
    }
}

/// The lower bound of the kept set over scaled logits (the best is 0).
pub fn threshold(scaled: &[f32], draw: &RowDraw) -> f32 {
    let base = if draw.top_k > 0 {
        search(scaled, LOWEST, draw.top_k as f32, |_| 1.0, None)
    } else {
        FLOOR
    };
    let mut t = base;
    if draw.min_p > 0.0 {
        t = t.max(draw.min_p.ln());
    }
    if draw.top_p < 1.0 {
        // The target is top_p of the mass at the base (the first pass's lower bound).
        t = t.max(search(scaled, base, 0.0, f32::exp, Some(draw.top_p)));
    }
    t
}

/// The largest threshold `t >= lo` (to within the last pass's step) whose weight above,
/// `F(t) = Σ_{s >= t} weight(s)`, reaches `target` (or `share * F(lo)` when `share` is
/// given); `lo` itself when `F(lo)` is already short of it. `F` falls as `t` rises and is 0
/// above the best (0), so the answer lies in `[lo, 1/1024)`.
fn search(
    scaled: &[f32],
    mut lo: f32,
    mut target: f32,
    weight: impl Fn(f32) -> f32,
    share: Option<f32>,
) -> f32 {
    let mut hi = 1.0 / 1024.0;
    for pass in 0..PASSES {
        let step = (hi - lo) / WAYS as f32;
        let cut = |j: usize| lo + j as f32 * step;
        let mut above = [0f32; WAYS];
        for &s in scaled {
            if s >= lo {
                let w = weight(s);
                for (j, a) in above.iter_mut().enumerate() {
                    if s >= cut(j) {
                        *a += w;
                    }
                }
            }
        }
        if pass == 0 {
            if let Some(share) = share {
                target = share * above[0];
            }
            if above[0] < target {
                return lo;
            }
        }
        // `above` falls with j and above[0] >= target: the last j still reaching it.
        let j = (0..WAYS).rev().find(|&j| above[j] >= target).unwrap_or(0);
        (lo, hi) = (cut(j), if j + 1 < WAYS { cut(j + 1) } else { hi });
    }
    lo
}

/// The argmax of `s_i + gumbel(key, i)` over `s_i >= t` (the first of equals).
pub fn race(scaled: &[f32], t: f32, key: u64) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &s) in scaled.iter().enumerate() {
        if s >= t && s > f32::NEG_INFINITY {
            let v = s + gumbel(key, i as u32);
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests;
