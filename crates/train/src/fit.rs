//! `train-router fit`: R2R's classifier trained on labelled features with candle's
//! autograd and AdamW — BCE with `pos_weight` for the class imbalance, a held-out split by
//! prompt (positions of one answer never straddle the split), early stopping on held-out
//! AUC, everything seeded — and the routing threshold chosen on the held-out split.

use crate::label::{read_meta, shard_count};
use crate::metrics::{at_threshold, auc, choose_threshold, AtThreshold, ThresholdTarget};
use crate::net::{Head, NetSpec, TrainNet};
use crate::shard::{self, Features};
use crate::{Result, TrainError};
use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `tokenrouter train-router fit`
#[derive(clap::Args, Clone, Debug)]
pub struct FitArgs {
    /// A directory written by `train-router label`.
    #[arg(long)]
    pub data: PathBuf,
    /// Where router.safetensors and router.json go.
    #[arg(long)]
    pub out: PathBuf,
    /// Choose the threshold routing this share of held-out positions.
    #[arg(long, conflicts_with = "target_recall")]
    pub target_share: Option<f64>,
    /// Choose the largest threshold with at least this held-out recall (R2R: 0.95).
    #[arg(long)]
    pub target_recall: Option<f64>,
    /// The router to train: r2r (hidden state, token embedding, top-k logits), citer (MLP
    /// with BatchNorm on the hidden state) or collm (linear deferral on the hidden state).
    #[arg(long, value_enum, default_value = "r2r")]
    pub head: Head,
    /// Width of the residual MLP (r2r).
    #[arg(long, default_value_t = 256)]
    pub width: usize,
    #[arg(long, default_value_t = 3)]
    pub blocks: usize,
    #[arg(long, default_value_t = 4)]
    pub expansion: usize,
    #[arg(long, default_value_t = 0.1)]
    pub dropout: f32,
    /// Feed the raw hidden state, embedding and top logits (no LayerNorm / softmax).
    #[arg(long)]
    pub raw_inputs: bool,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 5e-4)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    #[arg(long, default_value_t = 30)]
    pub epochs: usize,
    /// Epochs without a better held-out AUC before stopping.
    #[arg(long, default_value_t = 5)]
    pub patience: usize,
    /// Share of prompts held out.
    #[arg(long, default_value_t = 0.1)]
    pub holdout: f64,
    /// pos_weight = negatives / positives x this.
    #[arg(long, default_value_t = 1.0)]
    pub recall_factor: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// What a positive is: disagree (the small model's token differs from the large
    /// model's) or divergent (a difference `train-router diverge` judged to matter).
    #[arg(long, value_enum, default_value = "disagree")]
    pub labels: LabelKind,
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LabelKind {
    Disagree,
    Divergent,
}

impl FitArgs {
    /// Defaults for a directory pair (tests, callers that are not the CLI).
    pub fn new(data: impl Into<PathBuf>, out: impl Into<PathBuf>) -> Self {
        FitArgs {
            data: data.into(),
            out: out.into(),
            target_share: None,
            target_recall: None,
            head: Head::R2r,
            width: 256,
            blocks: 3,
            expansion: 4,
            dropout: 0.1,
            raw_inputs: false,
            lr: 1e-3,
            weight_decay: 5e-4,
            batch: 256,
            epochs: 30,
            patience: 5,
            holdout: 0.1,
            recall_factor: 1.0,
            seed: 0,
            labels: LabelKind::Disagree,
            no_progress: true,
        }
    }
}

/// What fitting produced.
#[derive(Debug, serde::Serialize)]
pub struct FitReport {
    pub head: Head,
    /// The threshold as the method reads it (CITER: route below it; others: at or above).
    pub method_threshold: f64,
    pub train_positions: usize,
    pub heldout_positions: usize,
    pub train_positive_rate: f64,
    pub pos_weight: f64,
    pub parameters: usize,
    pub epochs_run: usize,
    pub best_epoch: usize,
    pub heldout_auc: f64,
    pub at_threshold: AtThreshold,
    /// Other operating points on the held-out positions, one per share in
    /// [`CURVE_SHARES`], each threshold as the method reads it: what to send as
    /// `"routing": {"threshold": t}` (or sweep in `eval`) for about that share.
    pub curve: Vec<AtThreshold>,
    pub target: String,
    pub seconds: f64,
    pub seed: u64,
    pub labels: LabelKind,
    /// Disagreements the labels left unrouted (judged not to matter).
    pub neutral_disagreements: usize,
}

impl FitReport {
    pub fn summary(&self) -> String {
        format!(
            "trained on {} positions ({:.2}% positive{}), held out {}; {} parameters, {} epochs (best {}), {:.1} s; held-out AUC {:.4}; threshold {:.4} ({}): precision {:.3}, recall {:.3}, routes {:.2}% of positions",
            self.train_positions,
            100.0 * self.train_positive_rate,
            match self.labels {
                LabelKind::Disagree => String::new(),
                LabelKind::Divergent => format!(
                    "; divergent labels: {} disagreements judged neutral",
                    self.neutral_disagreements
                ),
            },
            self.heldout_positions,
            self.parameters,
            self.epochs_run,
            self.best_epoch,
            self.seconds,
            self.heldout_auc,
            self.at_threshold.threshold,
            self.target,
            self.at_threshold.precision,
            self.at_threshold.recall,
            100.0 * self.at_threshold.share
        ) + &format!(
            "\nscheduler_class: {}_slm, scheduler_kwargs: {{model_path: router.safetensors, threshold: {:.6}}}",
            match self.head {
                Head::R2r => "r2r",
                Head::Citer => "citer",
                Head::Collm => "collm",
            },
            self.method_threshold
        ) + &self
            .curve
            .iter()
            .map(|p| {
                format!(
                    "\nheld-out: threshold {:.6} routes {:.1}% (precision {:.3}, recall {:.3})",
                    p.threshold,
                    100.0 * p.share,
                    p.precision,
                    p.recall
                )
            })
            .collect::<String>()
    }
}

/// The held-out shares `fit` reports an operating point for.
pub const CURVE_SHARES: [f64; 7] = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6];

/// Every shard of a label directory (all must be present).
pub fn load_dir(dir: &Path) -> Result<Features> {
    let shards = shard_count(&read_meta(dir)?);
    let mut all: Option<Features> = None;
    for s in 0..shards {
        let p = shard::shard_path(dir, s);
        if !shard::exists(&p) {
            return Err(TrainError::file(
                &p,
                "missing: labelling did not finish (run the same `train-router label` again to resume)",
            ));
        }
        let f = shard::read(&p)?;
        match &mut all {
            None => all = Some(f),
            Some(a) => a.extend(&f)?,
        }
    }
    all.ok_or_else(|| TrainError::file(dir, "holds no shards"))
}

/// Clear the label of every disagreement `train-router diverge` judged not to matter.
/// Returns how many were cleared; unjudged ones stay positive.
pub fn apply_divergence(dir: &Path, f: &mut Features) -> Result<usize> {
    let shards = shard_count(&read_meta(dir)?);
    let mut neutral = std::collections::HashSet::new();
    for s in 0..shards {
        let p = crate::diverge::divergence_path(dir, s);
        let text = std::fs::read_to_string(&p).map_err(|e| {
            TrainError::file(
                &p,
                format!("{e}: --labels divergent needs `tokenrouter train-router diverge` run on this directory first"),
            )
        })?;
        let d: crate::diverge::ShardDivergence =
            serde_json::from_str(&text).map_err(|e| TrainError::file(&p, e))?;
        for pt in d.points {
            if pt.divergent == Some(false) {
                neutral.insert((pt.prompt, pt.position));
            }
        }
    }
    let mut cleared = 0;
    for r in 0..f.len() {
        if f.label[r] != 0 && neutral.contains(&(f.prompt[r], f.position[r])) {
            f.label[r] = 0;
            cleared += 1;
        }
    }
    Ok(cleared)
}

/// Whether a prompt is held out (a seeded hash of its index).
fn held_out(prompt: u32, seed: u64, share: f64) -> bool {
    let mut x = (prompt as u64) ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    ((x % 1_000_000) as f64) < share * 1_000_000.0
}

/// f32 tensors of some rows: (hidden, embedding, top logits, labels).
pub fn batch(f: &Features, rows: &[usize]) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let take = |src: &[half::f16], w: usize| -> Result<Tensor> {
        let mut v = Vec::with_capacity(rows.len() * w);
        for &r in rows {
            v.extend(src[r * w..(r + 1) * w].iter().map(|x| x.to_f32()));
        }
        Ok(Tensor::from_vec(v, (rows.len(), w), &Device::Cpu)?)
    };
    let y: Vec<f32> = rows.iter().map(|&r| f.label[r] as f32).collect();
    Ok((
        take(&f.hidden, f.hidden_size)?,
        take(&f.embed, f.embed_size)?,
        take(&f.top, f.top_k)?,
        Tensor::from_vec(y, rows.len(), &Device::Cpu)?,
    ))
}

/// Mean BCE-with-logits with class weights:
/// w1·y·softplus(-x) + w0·(1-y)·softplus(x), with softplus(x) = relu(x) + ln(1 + e^-|x|).
fn weighted_bce(x: &Tensor, y: &Tensor, w1: f64, w0: f64) -> candle_core::Result<Tensor> {
    let softplus = |v: &Tensor| -> candle_core::Result<Tensor> {
        v.relu()? + v.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?
    };
    let pos = (y * softplus(&x.neg()?)?)?.affine(w1, 0.0)?;
    let neg = (y.affine(-1.0, 1.0)? * softplus(x)?)?.affine(w0, 0.0)?;
    (pos + neg)?.mean_all()
}

/// The routing score of a network output: P(route) (CITER's P(fine) turned around).
fn route_scores(head: Head, p: Vec<f32>) -> Vec<f32> {
    if head.scores_keeping() {
        p.into_iter().map(|p| 1.0 - p).collect()
    } else {
        p
    }
}

/// Probabilities of some rows (no dropout).
pub fn predict(net: &TrainNet, f: &Features, rows: &[usize]) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(1024) {
        let (h, e, t, _) = batch(f, chunk)?;
        let logit = net.forward(&h, &e, &t, None)?;
        out.extend(candle_nn::ops::sigmoid(&logit)?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// Train on `f` and write the router; see the module docs.
pub fn fit(a: &FitArgs, f: &Features) -> Result<(TrainNet, FitReport)> {
    if a.batch == 0 || a.epochs == 0 {
        return Err(TrainError::Input(
            "--batch and --epochs must be at least 1".into(),
        ));
    }
    if !(0.0 < a.holdout && a.holdout < 1.0) {
        return Err(TrainError::Input(format!(
            "--holdout {} is not in (0, 1)",
            a.holdout
        )));
    }
    let (train, held): (Vec<usize>, Vec<usize>) =
        (0..f.len()).partition(|&i| !held_out(f.prompt[i], a.seed, a.holdout));
    let labels_of =
        |rows: &[usize]| -> Vec<bool> { rows.iter().map(|&r| f.label[r] != 0).collect() };
    let (train_y, held_y) = (labels_of(&train), labels_of(&held));
    let train_pos = train_y.iter().filter(|&&l| l).count();
    let held_pos = held_y.iter().filter(|&&l| l).count();
    if train_pos == 0 || train_pos == train.len() || held_pos == 0 || held_pos == held.len() {
        return Err(TrainError::Input(format!(
            "too little data: {} training positions ({train_pos} positive), {} held out ({held_pos} positive); both splits need both classes — label more prompts",
            train.len(),
            held.len()
        )));
    }
    let pos_weight = (train.len() - train_pos) as f64 / train_pos as f64 * a.recall_factor;
    let spec = NetSpec {
        head: a.head,
        hidden_size: f.hidden_size,
        embed_size: f.embed_size,
        top_k: f.top_k,
        width: a.width,
        blocks: a.blocks,
        expansion: a.expansion,
        dropout: a.dropout,
        normalize_input: !a.raw_inputs,
    };
    let net = TrainNet::init(spec, a.seed)?;
    let mut opt = AdamW::new(
        net.vars(),
        ParamsAdamW {
            lr: a.lr,
            weight_decay: a.weight_decay,
            ..Default::default()
        },
    )?;
    let mut rng = ChaCha8Rng::seed_from_u64(a.seed ^ 0x5EED);
    let bar = if a.no_progress {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(a.epochs as u64)
    };
    let started = Instant::now();
    let mut best = (f64::NEG_INFINITY, 0usize, net.snapshot()?);
    let mut order = train.clone();
    let mut epochs_run = 0;
    for epoch in 1..=a.epochs {
        order.shuffle(&mut rng);
        let mut loss_sum = 0.0;
        for rows in order.chunks(a.batch) {
            let (h, e, t, y) = batch(f, rows)?;
            let x = net.forward(&h, &e, &t, Some(&mut rng))?;
            // CITER predicts that the token is fine: its target is the other class, and
            // the rare class (a disagreement) is still the one weighted up.
            let loss = if a.head.scores_keeping() {
                weighted_bce(&x, &y.affine(-1.0, 1.0)?, 1.0, pos_weight)?
            } else {
                weighted_bce(&x, &y, pos_weight, 1.0)?
            };
            opt.backward_step(&loss)?;
            loss_sum += loss.to_scalar::<f32>()? as f64 * rows.len() as f64;
        }
        epochs_run = epoch;
        let scores = route_scores(a.head, predict(&net, f, &held)?);
        let held_auc = auc(&scores, &held_y).unwrap_or(0.5);
        bar.set_message(format!(
            "epoch {epoch}: train loss {:.4}, held-out AUC {held_auc:.4}",
            loss_sum / order.len() as f64
        ));
        bar.inc(1);
        tracing::info!(epoch, held_auc, "epoch");
        if held_auc > best.0 {
            best = (held_auc, epoch, net.snapshot()?);
        } else if epoch - best.1 >= a.patience {
            break;
        }
    }
    bar.finish_and_clear();
    net.restore(&best.2)?;
    let scores = route_scores(a.head, predict(&net, f, &held)?);
    let target = match (a.target_share, a.target_recall) {
        (Some(s), _) => ThresholdTarget::Share(s),
        (None, Some(r)) => ThresholdTarget::Recall(r),
        (None, None) => ThresholdTarget::Recall(0.95),
    };
    let threshold = choose_threshold(&scores, &held_y, target);
    let for_method = |t: f64| {
        if a.head.scores_keeping() {
            // Route iff 1 - p >= t, i.e. p <= 1 - t; CITER routes iff p < threshold.
            1.0 - t + 1e-7
        } else {
            t
        }
    };
    let curve = CURVE_SHARES
        .iter()
        .map(|&share| {
            let t = choose_threshold(&scores, &held_y, ThresholdTarget::Share(share));
            AtThreshold {
                threshold: for_method(t),
                ..at_threshold(&scores, &held_y, t)
            }
        })
        .collect();
    let report = FitReport {
        head: a.head,
        method_threshold: for_method(threshold),
        curve,
        train_positions: train.len(),
        heldout_positions: held.len(),
        train_positive_rate: train_pos as f64 / train.len() as f64,
        pos_weight,
        parameters: net.parameters(),
        epochs_run,
        best_epoch: best.1,
        heldout_auc: best.0,
        at_threshold: at_threshold(&scores, &held_y, threshold),
        target: match target {
            ThresholdTarget::Share(s) => format!("held-out share {s}"),
            ThresholdTarget::Recall(r) => format!("held-out recall {r}"),
        },
        seconds: started.elapsed().as_secs_f64(),
        seed: a.seed,
        labels: a.labels,
        neutral_disagreements: 0,
    };
    Ok((net, report))
}

/// `fit` on a label directory, writing the router into `a.out`.
pub fn run(a: &FitArgs) -> Result<FitReport> {
    let mut f = load_dir(&a.data)?;
    let neutral = match a.labels {
        LabelKind::Disagree => 0,
        LabelKind::Divergent => apply_divergence(&a.data, &mut f)?,
    };
    let (net, mut report) = fit(a, &f)?;
    report.neutral_disagreements = neutral;
    let training = serde_json::to_value(&report).unwrap_or_default();
    net.save(&a.out, report.method_threshold, training)?;
    Ok(report)
}
