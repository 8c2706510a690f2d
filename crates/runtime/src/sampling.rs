//! Turning one row of logits into a token: greedy, temperature, top-k, top-p, min-p,
//! repetition / presence / frequency penalties, logit bias, and logprobs. Each request
//! owns its seeded RNG, so its samples never depend on what else shares the batch.

use rand::{Rng, SeedableRng};
// `rand::rngs::StdRng` is this generator (rand 0.9); naming it gives access to the stream
// position, so a request's sampler can continue in another process (remote sub-servers).
use rand_chacha::ChaCha12Rng;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

pub use tokenrouter_api::SamplingParams;

pub mod dry;
mod llama;
pub mod race;
mod unsorted;
pub use dry::DryBreakers;
pub use race::RowDraw;

/// A sampled token with its log-probability and the top alternatives, all natural-log
/// probabilities of the raw (unpenalised, temperature-free) distribution.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Per-request sampling state: the RNG and token counts for penalties.
#[derive(Clone, Debug)]
pub struct Sampler {
    pub config: SamplingParams,
    rng: ChaCha12Rng,
    counts: HashMap<u32, u32>,
    /// The penalties and bias in force, one entry per id, kept up to date as tokens are
    /// observed (not rebuilt every step: with a repetition penalty that walked each
    /// request's prompt and output into a hash map, then sorted it, every step).
    adjust: Vec<race::Adjust>,
    /// Where each id's entry is in `adjust`.
    adjust_at: HashMap<u32, usize>,
    /// llama.cpp's penalty window (`config.penalty_last_n`): the last tokens of the prompt
    /// and output, oldest first, whose counts all three penalties read. Empty without one.
    window: VecDeque<u32>,
    /// DRY's window (llama.cpp's chain with DRY on): the last tokens of the prompt and
    /// output, oldest first. Empty without DRY.
    history: VecDeque<u32>,
    /// DRY's sequence breakers in this vocabulary (set by the engine).
    breakers: Arc<DryBreakers>,
}

/// `e^x`, accurate to ~2e-7 relative, written so loops over a row auto-vectorise (a row
/// is ~150k logits for Qwen vocabularies; libm's `exp` made sampling cost milliseconds).
#[inline(always)]
fn fast_exp(x: f32) -> f32 {
    let t = x.clamp(-87.0, 88.0) * std::f32::consts::LOG2_E;
    let n = t.floor();
    let f = t - n;
    // 2^f on [0, 1): Taylor series of e^(f ln 2) to degree 8.
    let p = 1.0
        + f * (std::f32::consts::LN_2
            + f * (0.240_226_5
                + f * (0.055_504_11
                    + f * (0.009_618_129
                        + f * (0.001_333_355
                            + f * (0.000_154_035_3
                                + f * (0.000_015_252_73 + f * 0.000_001_321_55)))))));
    f32::from_bits(((n as i32 + 127) << 23) as u32) * p
}

/// Largest value and its first index (NaNs never win; `(0, -inf)` when nothing exceeds
/// -inf). Two passes that vectorise: the maximum in eight lanes, then the first index
/// holding it. One compare-and-keep loop over a Qwen row (~150k logits) waited on its own
/// chain of compares: ~0.1 ms a row, a batch of eight rows a step on one thread.
pub fn argmax(values: &[f32]) -> (u32, f32) {
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    let mut lanes = [f32::NEG_INFINITY; 8];
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = lanes
        .into_iter()
        .chain(rest.iter().copied())
        .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
    if max == f32::NEG_INFINITY {
        return (0, max);
    }
    // `max` is a value of the row, so `position` finds it (the first of -0.0 and 0.0 when
    // both tie for largest, itself returned as the loop did).
    let i = values.iter().position(|&v| v == max).unwrap_or(0);
    (i as u32, values[i])
}

/// `(max, sum of e^(x - max), sum of e^(x - max) * (x - max))` over a row, in 8 lanes.
fn exp_sums(values: &[f32]) -> (f32, f64, f64) {
    let max = values.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    // f32 lanes within blocks of 1024 (vectorised), f64 across blocks (accurate).
    let (mut sum, mut wsum) = (0f64, 0f64);
    for block in values.chunks(1024) {
        let (mut s, mut w) = ([0f32; 8], [0f32; 8]);
        let chunks = block.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            for i in 0..8 {
                let d = c[i] - max;
                let e = fast_exp(d);
                s[i] += e;
                w[i] += e * d;
            }
        }
        for &v in rest {
            let d = v - max;
            let e = fast_exp(d);
            s[0] += e;
            w[0] += e * d;
        }
        sum += s.iter().map(|&x| x as f64).sum::<f64>();
        wsum += w.iter().map(|&x| x as f64).sum::<f64>();
    }
    (max, sum, wsum)
}

/// log of the sum of exponentials of a row.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let (max, sum, _) = exp_sums(logits);
    (max as f64 + sum.ln()) as f32
}

/// Log-softmax of a row.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let lse = log_sum_exp(logits);
    logits.iter().map(|&l| l - lse).collect()
}

/// Up to this many top values are kept in one pass over the row (`top_k_indices`).
const TOP_K_STREAMED: usize = 64;

/// Indices of the k largest values, best first (ties: lower id first).
pub fn top_k_indices(values: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| {
        values[*b as usize]
            .partial_cmp(&values[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    if k <= TOP_K_STREAMED {
        return top_k_streamed(values, k, cmp);
    }
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx
}

/// `top_k_indices` for small k in one pass: the best k so far, kept sorted by `cmp`. A
/// later index displaces the worst kept one only if its value is strictly greater (`cmp`
/// ranks equal values, and NaN against anything, by index, and the later index loses), so
/// the result is the same as sorting the whole row. Sorting the 152k indices of a Qwen row
/// took ~1.6 ms; this is a compare per value (scoring a 2k-token prompt with 5 alternatives
/// a token spent 3.5 s there).
fn top_k_streamed(
    values: &[f32],
    k: usize,
    cmp: impl Fn(&u32, &u32) -> std::cmp::Ordering,
) -> Vec<u32> {
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    let mut floor = f32::NAN;
    for (i, &v) in values.iter().enumerate() {
        // Not strictly above the worst kept value (or either is NaN): ranked after it.
        if best.len() == k && v.partial_cmp(&floor) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        let i = i as u32;
        let at = best.partition_point(|b| cmp(b, &i).is_lt());
        best.insert(at, i);
        best.truncate(k);
        if best.len() == k {
            floor = values[best[k - 1] as usize];
        }
    }
    best
}

/// `token`'s log-probability under the row `raw` whose log-sum-exp is `lse` (-inf for a
/// token past the row), and the `k` most likely tokens' `(id, log-probability)`, best first:
/// what a sampled token and a scored prompt token report.
pub fn logprob_and_top(raw: &[f32], lse: f32, token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let logprob = raw
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| l - lse);
    // A token with no chance (masked to -inf by an output constraint) is no alternative.
    let top = top_k_indices(raw, k)
        .into_iter()
        .map(|i| (i, raw[i as usize] - lse))
        .filter(|&(_, logprob)| logprob > f32::NEG_INFINITY)
        .collect();
    (logprob, top)
}

/// Shannon entropy (natural log) of the softmax of `logits`: with e_i = e^(l_i - max) and
/// S = sum e_i, H = ln S - sum e_i (l_i - max) / S.
pub fn entropy(logits: &[f32]) -> f32 {
    let (_, sum, wsum) = exp_sums(logits);
    (sum.ln() - wsum / sum).max(0.0) as f32
}

impl Sampler {
    /// `seed` is the request's resolved seed (`config.seed` may be unset: the engine draws
    /// one), so the sampler's stream is fixed from here on.
    pub fn new(config: SamplingParams, seed: u64, prompt: &[u32]) -> Self {
        let mut s = Self {
            config,
            rng: ChaCha12Rng::seed_from_u64(seed),
            counts: HashMap::new(),
            adjust: Vec::new(),
            adjust_at: HashMap::new(),
            window: VecDeque::new(),
            history: VecDeque::new(),
            breakers: Arc::default(),
        };
        for (tok, b) in s.config.logit_bias.clone() {
            s.entry(tok).bias += b;
        }
        match s.config.penalty_last_n {
            // vLLM: the repetition penalty covers the prompt, the others only the output.
            None if s.config.repetition_penalty != 1.0 => {
                let penalty = s.config.repetition_penalty;
                for &tok in prompt {
                    s.entry(tok).rep = penalty;
                }
            }
            None => {}
            // llama.cpp: all three cover the window, prompt tokens included.
            Some(n) => {
                for &tok in &prompt[prompt.len().saturating_sub(n)..] {
                    s.observe(tok);
                }
            }
        }
        // DRY reads its own window of the prompt (`observe` above may have begun one).
        if let Some(n) = s.dry_window() {
            s.history.clear();
            s.history
                .extend(prompt[prompt.len().saturating_sub(n)..].iter().copied());
        }
        s
    }

    /// Rebuild the penalty state from the tokens the request holds now, the RNG left where
    /// it is: after output tokens were taken back (a model refused part of a hand-off), so
    /// that the penalties never count a token the answer does not contain.
    pub fn rewind(&mut self, prompt: &[u32], output: &[u32]) {
        let mut fresh = Self::new(self.config.clone(), 0, prompt);
        fresh.rng = self.rng.clone();
        fresh.breakers = self.breakers.clone();
        for &t in output {
            fresh.observe(t);
        }
        *self = fresh;
    }

    /// `id`'s adjustment entry, added (changing nothing yet) if it has none.
    fn entry(&mut self, id: u32) -> &mut race::Adjust {
        let at = *self.adjust_at.entry(id).or_insert_with(|| {
            self.adjust.push(race::Adjust {
                id,
                sub: 0.0,
                rep: 1.0,
                bias: 0.0,
            });
            self.adjust.len() - 1
        });
        &mut self.adjust[at]
    }

    /// Sets `token`'s count to `n` and its entry to match; 0 (a token gone from the penalty
    /// window) takes its penalties away.
    fn set_count(&mut self, token: u32, n: u32) {
        if n == 0 {
            self.counts.remove(&token);
            if let Some(&at) = self.adjust_at.get(&token) {
                (self.adjust[at].sub, self.adjust[at].rep) = (0.0, 1.0);
            }
            return;
        }
        self.counts.insert(token, n);
        let c = &self.config;
        let (sub, rep) = (
            c.presence_penalty + c.frequency_penalty * n as f32,
            c.repetition_penalty,
        );
        // An entry, once made, follows the count even back to no change.
        if sub != 0.0 || self.adjust_at.contains_key(&token) {
            self.entry(token).sub = sub;
        }
        if rep != 1.0 {
            self.entry(token).rep = rep;
        }
    }

    /// Rebuild a sampler elsewhere from the request's tokens and what
    /// [`Sampler::rng_position`] reports: it then draws exactly what the original would
    /// draw next.
    pub fn restore(
        config: SamplingParams,
        seed: u64,
        prompt: &[u32],
        output: &[u32],
        rng_position: u128,
    ) -> Self {
        let mut s = Self::new(config, seed, prompt);
        s.set_rng_position(rng_position);
        for &t in output {
            s.observe(t);
        }
        s
    }

    /// Where the RNG's stream stands, in 32-bit words since the seed.
    pub fn rng_position(&self) -> u128 {
        self.rng.get_word_pos()
    }

    /// Move the RNG to a position another copy of this sampler reported.
    pub fn set_rng_position(&mut self, position: u128) {
        self.rng.set_word_pos(position);
    }

    /// The penalty counts (token, times seen in the output, or in the window where the
    /// config has one), sorted by token.
    pub fn counts(&self) -> Vec<(u32, u32)> {
        let mut v: Vec<(u32, u32)> = self.counts.iter().map(|(&t, &n)| (t, n)).collect();
        v.sort_unstable();
        v
    }

    /// How many tokens DRY scans (`usize::MAX`: all), or `None` without DRY.
    fn dry_window(&self) -> Option<usize> {
        let chain = self.config.llama.as_ref()?;
        let dry = chain.dry.as_ref().filter(|d| d.is_active())?;
        chain
            .order
            .contains(&tokenrouter_api::LlamaStage::Dry)
            .then(|| dry.penalty_last_n.unwrap_or(usize::MAX))
    }

    /// DRY's sequence breakers as token sequences of this vocabulary (the engine finds
    /// them from the request's texts; none by default).
    pub fn set_dry_breakers(&mut self, breakers: Arc<DryBreakers>) {
        self.breakers = breakers;
    }

    /// Whether this request's draws must be made here, on the host: llama.cpp's chain
    /// with a sampler or an order the device's draw does not have.
    pub fn needs_host(&self) -> bool {
        let c = &self.config;
        c.llama
            .as_ref()
            .is_some_and(|chain| chain.differs_from_vllm(c.temperature, c.top_p, c.min_p))
    }

    /// Record a token that became part of the output (from whichever model).
    pub fn observe(&mut self, token: u32) {
        if let Some(n) = self.dry_window() {
            self.history.push_back(token);
            if self.history.len() > n {
                self.history.pop_front();
            }
        }
        let count = |s: &Self, t: u32| s.counts.get(&t).copied().unwrap_or(0);
        match self.config.penalty_last_n {
            None => self.set_count(token, count(self, token) + 1),
            Some(0) => {}
            Some(n) => {
                self.window.push_back(token);
                self.set_count(token, count(self, token) + 1);
                if self.window.len() > n {
                    if let Some(old) = self.window.pop_front() {
                        self.set_count(old, count(self, old).saturating_sub(1));
                    }
                }
            }
        }
    }

    /// Sample from `logits`; ids at or above `limit` (padding) are never chosen.
    pub fn sample(&mut self, logits: &[f32], limit: usize, top_logprobs: usize) -> Sampled {
        self.sample_constrained(logits, logits, limit, top_logprobs)
    }

    /// `sample` choosing among the tokens an output constraint left in `masked` (the others
    /// -inf), the log-probabilities reported from the model's own `logits` as always
    /// (before penalties, bias, temperature and the constraint).
    pub fn sample_constrained(
        &mut self,
        logits: &[f32],
        masked: &[f32],
        limit: usize,
        top_logprobs: usize,
    ) -> Sampled {
        let limit = limit.min(logits.len()).min(masked.len()).max(1);
        let token = self.choose(&masked[..limit]);
        let raw = &logits[..limit];
        let (logprob, top) = logprob_and_top(raw, log_sum_exp(raw), token, top_logprobs);
        Sampled {
            token,
            logprob,
            top,
        }
    }

    /// This step's draw where the logits are ([`race`]); a sampled draw takes its key from
    /// the request's RNG (two words, as a host draw does). Penalties and bias go with it
    /// as [`Sampler::adjustments`].
    pub fn device_draw(&mut self) -> RowDraw {
        let c = &self.config;
        let mut draw = RowDraw {
            temperature: c.temperature,
            top_k: c.top_k.min(u32::MAX as usize) as u32,
            top_p: c.top_p,
            min_p: c.min_p,
            key: 0,
        };
        if draw.temperature > 0.0 {
            draw.key = self.rng.random::<u64>();
        }
        draw
    }

    /// The changes penalties and bias make to this step's logits, one per id (empty when
    /// none is in force): what [`Sampler::sample`] applies, as sparse entries.
    pub fn adjustments(&self) -> &[race::Adjust] {
        &self.adjust
    }

    /// The next token from `raw` after penalties, bias and temperature.
    fn choose(&mut self, raw: &[f32]) -> u32 {
        if self.needs_host() {
            return self.choose_llama(raw);
        }
        // The same sparse entries a device draw applies, so both paths penalise alike.
        let adjust = self.adjustments();
        if adjust.is_empty() && self.config.temperature <= 0.0 {
            return argmax(raw).0;
        }
        let l = self.adjusted(raw);
        if self.config.temperature <= 0.0 {
            argmax(&l).0
        } else {
            self.sample_stochastic(&l)
        }
    }

    /// `raw` with the penalties and bias in force (the sparse entries a device draw applies
    /// too, so both paths penalise alike).
    fn adjusted(&self, raw: &[f32]) -> Vec<f32> {
        let mut l = raw.to_vec();
        for a in &self.adjust {
            if let Some(x) = l.get_mut(a.id as usize) {
                *x = a.apply(*x);
            }
        }
        l
    }

    /// The next token through llama.cpp's chain (penalties and bias first, as there).
    fn choose_llama(&mut self, raw: &[f32]) -> u32 {
        let l = self.adjusted(raw);
        let Some(chain) = self.config.llama.as_ref() else {
            return argmax(&l).0;
        };
        let dry = match chain.dry.as_ref() {
            Some(d) if self.dry_window().is_some() => {
                dry::penalties(d, &self.breakers, &self.history)
            }
            _ => HashMap::new(),
        };
        llama::draw(l, &self.config, chain, &dry, &mut self.rng)
    }

    fn sample_stochastic(&mut self, l: &[f32]) -> u32 {
        let c = &self.config;
        if c.top_k == 0 {
            let u = self.rng.random::<f64>();
            return unsorted::draw(l, c.temperature, c.min_p, c.top_p, u);
        }
        let cand = top_k_indices(l, c.top_k.min(l.len()));
        let max = l[cand[0] as usize];
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|&i| (((l[i as usize] - max) / c.temperature) as f64).exp())
            .collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        // min-p: drop tokens below min_p * p(best).
        let floor = c.min_p as f64 * probs[0];
        let mut keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        // top-p: smallest prefix with mass >= top_p.
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for p in probs.iter().take(keep) {
                acc += p;
                n += 1;
                if acc >= c.top_p as f64 {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f64>() * mass;
        for (i, p) in probs[..keep].iter().enumerate() {
            r -= p;
            if r <= 0.0 {
                return cand[i];
            }
        }
        cand[keep - 1]
    }
}

#[cfg(test)]
mod tests;
