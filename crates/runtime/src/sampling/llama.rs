//! A draw through llama.cpp's sampler chain (`tokenrouter_api::LlamaChain`): the stages in
//! the request's order over a candidate list, each as llama.cpp's sampler of that name
//! works — top-n-sigma, top-k, locally typical, top-p, min-p, XTC, the (dynamic)
//! temperature — then a draw from what is left. Penalties and bias are applied to the row
//! before (llama.cpp puts them first too); DRY's penalties come in at DRY's place.

use std::collections::HashMap;

use rand::Rng;
use rand_chacha::ChaCha12Rng;
use tokenrouter_api::{LlamaChain, LlamaStage, SamplingParams};

/// Descending by logit, ties by id (llama.cpp sorts by logit alone).
fn by_logit(a: &Cand, b: &Cand) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Cand {
    id: u32,
    logit: f32,
}

/// The candidates after each stage, and whether they are in descending order.
struct Cands {
    list: Vec<Cand>,
    sorted: bool,
}

impl Cands {
    /// Descending by logit, ties by id (llama.cpp sorts by logit alone).
    fn sort(&mut self) {
        if !self.sorted {
            self.list.sort_by(by_logit);
            self.sorted = true;
        }
    }

    /// The softmax of the candidates' logits, in their order.
    fn probs(&self) -> Vec<f64> {
        let max = self
            .list
            .iter()
            .map(|c| c.logit)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<f64> = self
            .list
            .iter()
            .map(|c| ((c.logit - max) as f64).exp())
            .collect();
        let sum: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= sum);
        p
    }

    fn max_logit(&self) -> f32 {
        self.list
            .iter()
            .map(|c| c.logit)
            .fold(f32::NEG_INFINITY, f32::max)
    }

    /// Keeps the first `n` (at least one).
    fn keep(&mut self, n: usize) {
        self.list.truncate(n.max(1));
    }

    fn top_k(&mut self, k: usize) {
        if k == 0 || k >= self.list.len() {
            return;
        }
        self.list.select_nth_unstable_by(k - 1, by_logit);
        self.list.truncate(k);
        self.sorted = false;
        self.sort();
    }

    fn top_p(&mut self, p: f32) {
        if p >= 1.0 {
            return;
        }
        if !self.sorted && self.list.len() > 1024 && self.top_p_from_prefix(p) {
            return;
        }
        self.sort();
        let mut cum = 0.0;
        let probs = self.probs();
        let n = probs
            .iter()
            .position(|&x| {
                cum += x;
                cum >= p as f64
            })
            .map_or(probs.len(), |i| i + 1);
        self.keep(n);
    }

    /// Top-p over a whole row without sorting it: the best 256, 1024, … candidates sorted
    /// until a prefix holds `p` of the whole mass (sorting 152k logits cost ~8 ms a token).
    /// False (nothing changed but the order) when no prefix short of the row does.
    fn top_p_from_prefix(&mut self, p: f32) -> bool {
        let max = self.max_logit();
        let weight = |c: &Cand| ((c.logit - max) as f64).exp();
        let total: f64 = self.list.iter().map(weight).sum();
        let mut m = 256;
        while m < self.list.len() {
            self.list.select_nth_unstable_by(m - 1, by_logit);
            self.list[..m].sort_by(by_logit);
            let mut cum = 0.0;
            let end = self.list[..m].iter().position(|c| {
                cum += weight(c) / total;
                cum >= p as f64
            });
            if let Some(i) = end {
                self.list.truncate(i + 1);
                self.sorted = true;
                return true;
            }
            m *= 4;
        }
        false
    }

    fn min_p(&mut self, p: f32) {
        if p <= 0.0 {
            return;
        }
        let max = self.max_logit();
        let floor = max + p.ln();
        self.list.retain(|c| c.logit >= floor || c.logit == max);
    }

    /// Locally typical sampling: the tokens whose surprise is nearest the entropy, until
    /// their mass passes `p`; they stay in that order.
    fn typical(&mut self, p: f32) {
        if p >= 1.0 {
            return;
        }
        let probs = self.probs();
        let entropy: f64 = probs
            .iter()
            .filter(|&&x| x > 0.0)
            .map(|&x| -x * x.ln())
            .sum();
        let mut order: Vec<usize> = (0..probs.len()).collect();
        let shift = |i: usize| (-probs[i].ln() - entropy).abs();
        order.sort_by(|&a, &b| shift(a).total_cmp(&shift(b)));
        let mut cum = 0.0;
        let n = order
            .iter()
            .position(|&i| {
                cum += probs[i];
                cum > p as f64
            })
            .map_or(order.len(), |i| i + 1);
        self.list = order[..n.max(1)].iter().map(|&i| self.list[i]).collect();
        self.sorted = false;
    }

    /// XTC: with probability `chance`, every token at or above `threshold` but the least
    /// likely of them goes (when at least two are there).
    fn xtc(&mut self, chance: f32, threshold: f32, rng: &mut ChaCha12Rng) {
        if chance <= 0.0 || threshold > 0.5 || self.list.len() < 2 {
            return;
        }
        if rng.random::<f32>() > chance {
            return;
        }
        self.sort();
        let probs = self.probs();
        let above = probs.iter().take_while(|&&x| x >= threshold as f64).count();
        if above >= 2 {
            self.list.drain(..above - 1);
        }
    }

    /// Top-n-sigma: the logits within n standard deviations of the largest.
    fn top_n_sigma(&mut self, n: f32) {
        if n <= 0.0 || self.list.is_empty() {
            return;
        }
        let len = self.list.len() as f64;
        let mean = self.list.iter().map(|c| c.logit as f64).sum::<f64>() / len;
        let var = self
            .list
            .iter()
            .map(|c| (c.logit as f64 - mean).powi(2))
            .sum::<f64>()
            / len;
        let max = self.max_logit();
        let floor = max as f64 - n as f64 * var.sqrt();
        self.list
            .retain(|c| c.logit as f64 >= floor || c.logit == max);
    }

    fn temperature(&mut self, t: f32) {
        if t <= 0.0 {
            self.sort();
            self.keep(1);
        } else {
            self.list.iter_mut().for_each(|c| c.logit /= t);
        }
    }

    /// Dynamic temperature: between `t - range` (not below 0) and `t + range` by the
    /// normalised entropy raised to `exponent`.
    fn dynamic_temperature(&mut self, t: f32, range: f32, exponent: f32) {
        if range <= 0.0 {
            return self.temperature(t);
        }
        if self.list.len() <= 1 {
            return;
        }
        let (low, high) = ((t - range).max(0.0), t + range);
        let max_entropy = (self.list.len() as f64).ln();
        let entropy: f64 = self
            .probs()
            .iter()
            .filter(|&&x| x > 0.0)
            .map(|&x| -x * x.ln())
            .sum();
        let normalised = entropy / max_entropy;
        let dynamic = low as f64 + (high - low) as f64 * normalised.powf(exponent as f64);
        self.temperature(dynamic as f32);
    }
}

/// The token the chain draws from `logits` (penalties and bias applied). `dry`: each
/// token's DRY penalty, taken off at DRY's place in the chain.
pub(super) fn draw(
    mut logits: Vec<f32>,
    config: &SamplingParams,
    chain: &LlamaChain,
    dry: &HashMap<u32, f32>,
    rng: &mut ChaCha12Rng,
) -> u32 {
    // DRY before anything that cuts: its few penalties go into the row itself, so that a
    // top-k after it can still start from the top k (a 2k-token window with repeats took
    // the whole-row path: 2.6 ms a token instead of 0.3).
    let cuts_first =
        |s: &&LlamaStage| !matches!(s, LlamaStage::TopNSigma if chain.top_n_sigma <= 0.0);
    let dry_in_row =
        !dry.is_empty() && chain.order.iter().find(cuts_first) == Some(&LlamaStage::Dry);
    if dry_in_row {
        for (&id, &p) in dry {
            if let Some(x) = logits.get_mut(id as usize) {
                *x -= p;
            }
        }
    }
    let logits = logits.as_slice();
    // Stages that change nothing before a top-k (DRY with no repeat or already in the row,
    // top-n-sigma off, as in llama.cpp's defaults) let the candidates start as the top k,
    // not the whole row.
    let idle = |s: &LlamaStage| match s {
        LlamaStage::Dry => dry.is_empty() || dry_in_row,
        LlamaStage::TopNSigma => chain.top_n_sigma <= 0.0,
        _ => false,
    };
    let first = chain.order.iter().position(|s| !idle(s));
    let starts_with_top_k = first
        .filter(|&i| chain.order[i] == LlamaStage::TopK && config.top_k > 0)
        .is_some();
    let finite = |id: u32| Some(logits[id as usize]).filter(|l| l.is_finite());
    let mut c = Cands {
        list: if starts_with_top_k {
            super::top_k_indices(logits, config.top_k)
                .into_iter()
                .filter_map(|id| finite(id).map(|logit| Cand { id, logit }))
                .collect()
        } else {
            (0..logits.len() as u32)
                .filter_map(|id| finite(id).map(|logit| Cand { id, logit }))
                .collect()
        },
        sorted: starts_with_top_k,
    };
    if c.list.is_empty() {
        return super::argmax(logits).0;
    }
    let skip = if starts_with_top_k {
        first.map_or(0, |i| i + 1)
    } else {
        0
    };
    for stage in &chain.order[skip..] {
        match stage {
            LlamaStage::Dry => {
                if !dry.is_empty() && !dry_in_row {
                    for cand in &mut c.list {
                        if let Some(p) = dry.get(&cand.id) {
                            cand.logit -= p;
                        }
                    }
                    c.sorted = false;
                }
            }
            LlamaStage::TopNSigma => c.top_n_sigma(chain.top_n_sigma),
            LlamaStage::TopK => c.top_k(config.top_k),
            LlamaStage::TypicalP => c.typical(chain.typical_p),
            LlamaStage::TopP => c.top_p(config.top_p),
            LlamaStage::MinP => c.min_p(config.min_p),
            LlamaStage::Xtc => c.xtc(chain.xtc_probability, chain.xtc_threshold, rng),
            LlamaStage::Temperature => c.dynamic_temperature(
                config.temperature,
                chain.dynatemp_range,
                chain.dynatemp_exponent,
            ),
        }
    }
    // A temperature at or below 0 picks the most likely token left, listed or not.
    if config.temperature <= 0.0 && chain.dynatemp_range <= 0.0 {
        c.temperature(0.0);
    }
    if c.list.len() == 1 {
        return c.list[0].id;
    }
    let probs = c.probs();
    let mut r = rng.random::<f64>();
    for (cand, p) in c.list.iter().zip(&probs) {
        r -= p;
        if r <= 0.0 {
            return cand.id;
        }
    }
    c.list[c.list.len() - 1].id
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// The candidates llama.cpp's tests start from: logit = ln(p).
    fn cands(probs: &[f32]) -> Cands {
        Cands {
            list: probs
                .iter()
                .enumerate()
                .map(|(id, p)| Cand {
                    id: id as u32,
                    logit: p.ln(),
                })
                .collect(),
            sorted: false,
        }
    }

    /// The kept candidates' probabilities by id (0 for the ones gone), llama.cpp's check.
    fn by_id(c: &Cands, n: usize) -> Vec<f64> {
        let mut out = vec![0.0; n];
        for (cand, p) in c.list.iter().zip(c.probs()) {
            out[cand.id as usize] = p;
        }
        out
    }

    fn close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    const ROW: [f32; 4] = [0.1, 0.2, 0.3, 0.4];

    /// llama.cpp's `test-sampling.cpp` expectations, each stage alone.
    #[test]
    fn stages_match_llama_cpp_tests() {
        let mut c = cands(&ROW);
        c.top_k(3);
        close(&by_id(&c, 4), &[0.0, 0.22222, 0.33333, 0.44444]);
        let mut c = cands(&ROW);
        c.top_p(0.7);
        close(&by_id(&c, 4), &[0.0, 0.0, 0.428571, 0.571429]);
        let mut c = cands(&ROW);
        c.top_p(0.8);
        close(&by_id(&c, 4), &[0.0, 0.22222, 0.33333, 0.44444]);
        for (p, kept) in [
            (0.24, 4),
            (0.26, 3),
            (0.49, 3),
            (0.51, 2),
            (0.74, 2),
            (0.76, 1),
        ] {
            let mut c = cands(&ROW);
            c.min_p(p);
            assert_eq!(c.list.len(), kept, "min_p {p}");
        }
        // XTC (chance 0.99 and a seed that draws under it): all but the least likely of
        // the tokens at or above the threshold go.
        for (threshold, kept) in [
            (0.09, vec![0.1]),
            (0.19, vec![0.2, 0.1]),
            (0.39, ROW.to_vec()),
        ] {
            let mut c = cands(&[0.4, 0.3, 0.2, 0.1]);
            c.xtc(1.0, threshold, &mut ChaCha12Rng::seed_from_u64(0));
            let got: Vec<f32> = c.list.iter().map(|x| x.logit.exp()).collect();
            let mut want = kept.clone();
            want.sort_by(|a, b| b.total_cmp(a));
            assert_eq!(got.len(), want.len(), "threshold {threshold}");
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-6);
            }
        }
        let mut c = cands(&[0.97, 0.01, 0.01, 0.01]);
        c.typical(0.5);
        close(&by_id(&c, 4), &[1.0, 0.0, 0.0, 0.0]);
        let mut c = cands(&[0.4, 0.2, 0.2, 0.2]);
        c.typical(0.5);
        close(&by_id(&c, 4), &[0.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0]);
        let mut c = cands(&ROW);
        c.top_n_sigma(1.0);
        close(&by_id(&c, 4), &[0.0, 0.0, 0.428571, 0.571429]);
        for n in [0.0, 3.0] {
            let mut c = cands(&ROW);
            c.top_n_sigma(n);
            close(&by_id(&c, 4), &[0.1, 0.2, 0.3, 0.4]);
        }
        // Temperature 1 and a dynamic range of 0 change nothing; 0 keeps the best.
        let mut c = cands(&ROW);
        c.dynamic_temperature(1.0, 0.0, 1.0);
        close(&by_id(&c, 4), &[0.1, 0.2, 0.3, 0.4]);
        let mut c = cands(&ROW);
        c.dynamic_temperature(0.0, 0.0, 1.0);
        close(&by_id(&c, 4), &[0.0, 0.0, 0.0, 1.0]);
    }

    /// Starting from the top k (llama.cpp's defaults: nothing before it cuts) draws what
    /// the whole row would: the same seeds, the same tokens.
    #[test]
    fn a_chain_starting_at_top_k_draws_as_from_the_whole_row() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 7919) % 503) as f32 / 50.0).collect();
        let config = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            ..SamplingParams::default()
        };
        let shortcut = LlamaChain::default();
        // Typical-p at 1 first (a stage that cuts nothing but is not skipped): the whole
        // row goes in.
        let whole_row = LlamaChain {
            order: vec![
                LlamaStage::TypicalP,
                LlamaStage::TopK,
                LlamaStage::Dry,
                LlamaStage::TopNSigma,
                LlamaStage::TopP,
                LlamaStage::MinP,
                LlamaStage::Xtc,
                LlamaStage::Temperature,
            ],
            ..LlamaChain::default()
        };
        for seed in 0..200 {
            let mut a = ChaCha12Rng::seed_from_u64(seed);
            let mut b = ChaCha12Rng::seed_from_u64(seed);
            let none = HashMap::new();
            assert_eq!(
                draw(logits.clone(), &config, &shortcut, &none, &mut a),
                draw(logits.clone(), &config, &whole_row, &none, &mut b)
            );
        }
    }

    /// Top-p on a whole row through growing sorted prefixes keeps what the full sort keeps.
    #[test]
    fn top_p_from_a_prefix_keeps_what_the_full_sort_keeps() {
        let row: Vec<f32> = (0..20_000u64)
            .map(|i| ((i * 2_654_435_761) % 10_007) as f32 / 900.0)
            .collect();
        for p in [0.05, 0.5, 0.9, 0.99] {
            let mut prefix = cands(&[]);
            prefix.list = row
                .iter()
                .enumerate()
                .map(|(id, &logit)| Cand {
                    id: id as u32,
                    logit,
                })
                .collect();
            let mut full = Cands {
                list: prefix.list.clone(),
                sorted: false,
            };
            full.sort();
            full.top_p(p);
            prefix.top_p(p);
            assert!(
                prefix.list.len() > 1 && prefix.list.len() < row.len(),
                "p {p}"
            );
            assert_eq!(prefix.list, full.list, "p {p}");
        }
    }

    #[test]
    fn xtc_draws_its_chance() {
        // At chance 0 nothing goes; at 0.5 about half the steps cut.
        let mut rng = ChaCha12Rng::seed_from_u64(7);
        let mut c = cands(&[0.4, 0.3, 0.2, 0.1]);
        c.xtc(0.0, 0.1, &mut rng);
        assert_eq!(c.list.len(), 4);
        let cuts = (0..1000)
            .filter(|_| {
                let mut c = cands(&[0.4, 0.3, 0.2, 0.1]);
                c.xtc(0.5, 0.1, &mut rng);
                c.list.len() == 1
            })
            .count();
        assert!((430..570).contains(&cuts), "{cuts}");
    }

    #[test]
    fn dynamic_temperature_follows_the_entropy() {
        // A flat row has normalised entropy 1: the top of the range (flatter still).
        let mut flat = cands(&[0.25; 4]);
        flat.dynamic_temperature(1.0, 0.5, 1.0);
        close(&by_id(&flat, 4), &[0.25; 4]);
        // A peaked row gets a lower temperature than 1.5: more peaked than at 1.5.
        let peaked = [0.7, 0.1, 0.1, 0.1];
        let mut c = cands(&peaked);
        c.dynamic_temperature(1.0, 0.5, 1.0);
        let mut at_high = cands(&peaked);
        at_high.temperature(1.5);
        assert!(by_id(&c, 4)[0] > by_id(&at_high, 4)[0]);
        let mut at_low = cands(&peaked);
        at_low.temperature(0.5);
        assert!(by_id(&c, 4)[0] < by_id(&at_low, 4)[0]);
    }

    #[test]
    fn the_temperature_comes_after_the_cuts() {
        // Logits 0, -1, -3: min-p 0.1 keeps ids 0 and 1 at llama.cpp's place (e^-1 >=
        // 0.1, e^-3 < 0.1), whatever the temperature after it; scaled first by 4 (vLLM's
        // order) id 2 would stay (e^-0.75 >= 0.1).
        let logits = [0.0, -1.0, -3.0];
        let config = SamplingParams {
            temperature: 4.0,
            min_p: 0.1,
            ..SamplingParams::default()
        };
        let chain = LlamaChain::default();
        let mut rng = ChaCha12Rng::seed_from_u64(1);
        let drawn: Vec<u32> = (0..400)
            .map(|_| draw(logits.to_vec(), &config, &chain, &HashMap::new(), &mut rng))
            .collect();
        assert!(drawn.iter().all(|&t| t < 2));
        assert!(drawn.contains(&0) && drawn.contains(&1));
        // Greedy with a DRY penalty on the best: the next best.
        let greedy = SamplingParams {
            temperature: 0.0,
            ..config.clone()
        };
        let dry = HashMap::from([(0, 1.5)]);
        assert_eq!(draw(logits.to_vec(), &greedy, &chain, &dry, &mut rng), 1);
        // Masked ids (-inf) are never candidates.
        let masked = [f32::NEG_INFINITY, -1.0, -3.0];
        assert!((0..50).all(|_| draw(masked.to_vec(), &config, &chain, &dry, &mut rng) != 0));
    }
}
