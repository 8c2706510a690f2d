//! The parts of one step between admission and routing: the rows the batch runs, the
//! forward pass with what the policy needs from it (entropy, top logits), sampling (on the
//! device for plain greedy batches; on a GPU each row it can, the rest on the host), and
//! the step's record (metrics, the latency log the online tuner reads).

use super::after_step::StepSeen;
use super::masks::{self, RowMask};
use super::{shared, StepSample, SubServer};
use tokenrouter_runtime::sampling::race::{self, DrawRow};
use tokenrouter_runtime::{Row, RuntimeError, Sampled, Sampling, StepOptions, StepOutput};

/// What the forward pass and sampling produced for the running batch.
pub(super) struct Stepped {
    output: StepOutput,
    /// Host logits per row (absent when sampled on the device).
    logits: Option<Vec<Vec<f32>>>,
    entropy: Option<Vec<f32>>,
    top: Option<Vec<Vec<f32>>>,
    /// Per row: its constraint left one token (or only the end) to pick.
    forced: Vec<bool>,
    /// Per row: the tokens it may write.
    allowed: Vec<Option<RowMask>>,
    pub sampled: Vec<Sampled>,
}

impl Stepped {
    pub fn seen(&self) -> StepSeen<'_> {
        StepSeen {
            logits: self.logits.as_deref(),
            entropy: self.entropy.as_deref(),
            top_logits: self.top.as_deref(),
            hidden: self.output.hidden.as_ref(),
            forced: &self.forced,
            allowed: &self.allowed,
        }
    }
}

impl SubServer {
    /// One row per running request: what its KV here has not seen yet (all of it on first
    /// contact). Also whether any row is a prefill.
    pub(super) fn build_rows(&mut self) -> (Vec<Row>, bool) {
        let mut rows = Vec::with_capacity(self.running.len());
        let mut prefill = false;
        for r in &mut self.running {
            let mut cached = match self.runner.seq_len(r.rid) {
                Some(n) => n,
                None => {
                    // First contact: a prompt (and answer so far) that starts like an earlier
                    // request's reuses its cached blocks.
                    prefill = true;
                    if let Some(salt) = &r.cache_salt {
                        self.runner.salt_sequence(r.rid, salt);
                    }
                    if self.runner.prefix_caching() {
                        let hit = self.runner.attach_prefix(r.rid, &r.tokens_from(0));
                        if r.output.is_empty() {
                            r.report_cached_prompt(hit);
                        }
                        hit
                    } else {
                        0
                    }
                }
            };
            prefill |= cached == 0;
            if cached >= r.total_len() {
                // Everything is cached (the sender dropped the token after ours): recompute
                // the last position to get its logits (or more, when that block is shared).
                cached = self.runner.truncate(r.rid, r.total_len() - 1);
            }
            rows.push(Row::new(r.rid, r.tokens_from(cached)));
        }
        (rows, prefill)
    }

    /// The forward pass and sampling. `poison_first` (fault injection) makes the first
    /// row's logits NaN.
    pub(super) fn forward_and_sample(
        &mut self,
        rows: &[Row],
        poison_first: bool,
    ) -> Result<Stepped, RuntimeError> {
        let limit = self.sample_limit;
        let model = self.runner.model();
        let gpu = !model.device().is_cpu();
        let kernels = *model.kernels();
        // With `sampling: host`, an all-greedy batch takes candle's argmax ops on the GPU;
        // otherwise the sampling kernel picks it (0.17-0.3 ms a step faster on an H100).
        let on_device = gpu
            && kernels.sampling == Sampling::Host
            && self.needs.no_logits
            && self.running.iter().all(|r| {
                r.top_logprobs == 0
                    && r.sampler.config.is_plain_greedy()
                    && ((r.grammar.is_none() && !r.sampler.config.restricts_tokens())
                        || kernels.device_masks)
            });
        let (want_entropy, want_top) = (self.needs.entropy, self.needs.top_logits);
        let opts = StepOptions {
            want_hidden: self.needs.hidden,
            all_logits: false,
        };
        let output = self.runner.step(rows, opts)?;
        // A GPU runs the step while the host works out the constrained rows' token masks.
        let masking = std::time::Instant::now();
        let allowed = self.allowed_tokens();
        if allowed.iter().any(Option::is_some) {
            self.shared
                .metrics
                .token_masks
                .with_label_values(&[self.name()])
                .observe(masking.elapsed().as_secs_f64());
        }
        let forced: Vec<bool> = self
            .running
            .iter()
            .zip(&allowed)
            .map(|(r, allowed)| {
                allowed.as_ref().is_some_and(RowMask::allows_one)
                    || r.grammar.as_ref().is_some_and(|g| g.must_end())
            })
            .collect();
        // A constrained row's entropy is over the tokens its constraint allows: how unsure
        // the model is among what it may write (a forced token: 0), not among all it might.
        let mut mask = None;
        let entropy = if want_entropy {
            mask = masks::upload(&allowed, limit, &output.logits)?;
            Some(match &mask {
                Some(mask) => output.entropy_rows_allowed(limit, mask)?,
                None => output.entropy_rows(limit)?,
            })
        } else {
            None
        };
        let top = if want_top > 0 {
            let name = &self.shared.names[self.idx];
            output
                .top_logits_rows(limit, want_top)
                .map_err(|e| {
                    tracing::warn!(model = %name, error = %e, "top logits on the device failed; reading them from host logits");
                })
                .ok()
        } else {
            None
        };
        // Without the top logits the policy reads them from the host logits.
        let top_missing = want_top > 0 && top.is_none();
        if on_device && !top_missing {
            if mask.is_none() {
                mask = masks::upload(&allowed, limit, &output.logits)?;
            }
            let sampled = output
                .greedy_rows_allowed(limit, mask.as_ref())?
                .into_iter()
                .map(|(token, logprob)| Sampled {
                    token,
                    logprob,
                    top: Vec::new(),
                })
                .collect();
            return Ok(Stepped {
                output,
                logits: None,
                entropy,
                top,
                forced,
                allowed,
                sampled,
            });
        }
        // A GPU draws each row it can where the logits are, penalties and bias as sparse
        // adjustments, each row the same way whatever else is in the batch (a seeded
        // request's tokens never depend on its neighbours); the host samples the rest.
        let draws = if kernels.sampling.on_device(gpu) {
            self.device_draws(&allowed, kernels.device_masks)
        } else {
            vec![None; self.running.len()]
        };
        let mut drawn = Vec::new();
        if draws.iter().any(Option::is_some) {
            if mask.is_none() {
                mask = masks::upload(&allowed, limit, &output.logits)?;
            }
            let each: Vec<DrawRow> = draws
                .iter()
                .map(|d| d.clone().unwrap_or_else(DrawRow::greedy))
                .collect();
            drawn = output.sample_rows(limit, &each, mask.as_ref())?;
        }
        let on_host = !self.needs.no_logits || top_missing || draws.iter().any(Option::is_none);
        let logits = if on_host {
            let mut logits = output.logits_rows()?;
            if poison_first {
                if let Some(first) = logits.first_mut() {
                    first.iter_mut().for_each(|x| *x = f32::NAN);
                }
            }
            Some(logits)
        } else {
            None
        };
        let mut host = match &logits {
            Some(logits) => self.sample_on_host(logits, &allowed, &draws),
            None => Vec::new(),
        }
        .into_iter();
        let mut drawn = drawn.into_iter();
        let sampled = draws
            .iter()
            .map(|d| match d {
                Some(_) => drawn.next(),
                None => host.next(),
            })
            .collect::<Option<Vec<Sampled>>>()
            .ok_or_else(|| RuntimeError::InvalidStep("a row was left unsampled".into()))?;
        Ok(Stepped {
            output,
            logits,
            entropy,
            top,
            forced,
            allowed,
            sampled,
        })
    }

    /// Per running request, its draw on the device this step, or `None` where the host
    /// samples it: more top logprobs than the device reports, a token mask the device does
    /// not take, a failed constraint, or llama.cpp's chain where it differs from the
    /// device's order.
    fn device_draws(
        &mut self,
        allowed: &[Option<RowMask>],
        device_masks: bool,
    ) -> Vec<Option<DrawRow>> {
        self.running
            .iter_mut()
            .zip(allowed)
            .map(|(r, allowed)| {
                let host = r.top_logprobs > race::TOP_MAX
                    || r.fault.is_some()
                    || r.sampler.needs_host()
                    || (allowed.is_some() && !device_masks);
                (!host).then(|| DrawRow {
                    draw: r.sampler.device_draw(),
                    adjust: r.sampler.adjustments().to_vec(),
                    top: r.top_logprobs,
                })
            })
            .collect()
    }

    /// Each constrained or restricted request's tokens allowed next (`None` for the others,
    /// and for one whose constraint failed: it fails alone, after the step).
    fn allowed_tokens(&mut self) -> Vec<Option<RowMask>> {
        let grammars = self.running.iter_mut().map(|r| match r.grammar.as_mut() {
            Some(g) if r.fault.is_none() => Some((g.as_mut(), &mut r.fault)),
            _ => None,
        });
        let grammars = masks::compute(grammars.collect());
        self.running
            .iter()
            .zip(grammars)
            .map(|(r, grammar)| {
                let only = r.sampler.config.allowed_token_ids.as_deref();
                masks::narrow(grammar, only, &r.banned_now(), self.sample_limit)
            })
            .collect()
    }

    /// Each request without a device draw: its own sampler over its row (a copy masked by
    /// its constraint, if it has one: the policy sees the model's own distribution), in
    /// order. A row with NaN logits, or whose constraint failed, is not sampled (it fails
    /// alone, after the step).
    fn sample_on_host(
        &mut self,
        logits: &[Vec<f32>],
        allowed: &[Option<RowMask>],
        draws: &[Option<DrawRow>],
    ) -> Vec<Sampled> {
        let limit = self.sample_limit;
        self.running
            .iter_mut()
            .zip(logits)
            .zip(allowed)
            .zip(draws)
            .filter(|(_, draw)| draw.is_none())
            .map(|(((r, l), allowed), _)| {
                let unsampled = Sampled {
                    token: 0,
                    logprob: f32::NAN,
                    top: Vec::new(),
                };
                if l[..limit.min(l.len())].iter().any(|x| x.is_nan()) || r.fault.is_some() {
                    return unsampled;
                }
                match allowed {
                    None => r.sampler.sample(l, limit, r.top_logprobs),
                    Some(allowed) => {
                        let mut masked = l.clone();
                        allowed.apply(&mut masked);
                        r.sampler
                            .sample_constrained(l, &masked, limit, r.top_logprobs)
                    }
                }
            })
            .collect()
    }

    /// Metrics and the latency log of a finished step.
    pub(super) fn record_step(&self, batch: usize, prefill: bool, elapsed: f64, busy: f64) {
        let m = &self.shared.metrics;
        m.step_latency
            .with_label_values(&[self.name()])
            .observe(elapsed);
        m.batch_size
            .with_label_values(&[self.name()])
            .observe(batch as f64);
        if let Ok(mut log) = self.shared.latency_log.lock() {
            // Drained by the online tuner; without one (or if it falls behind) only the
            // latest samples are kept, so the log never grows without bound.
            if log.len() >= shared::MAX_LATENCY_SAMPLES {
                log.drain(..shared::MAX_LATENCY_SAMPLES / 2);
            }
            log.push(StepSample {
                model: self.idx,
                batch,
                prefill,
                seconds: elapsed,
                busy,
            });
        }
    }
}
