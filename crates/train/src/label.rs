//! `train-router label`: the pair labels its own disagreements (R2R's steps 0 and 1).
//! Step 0: the large model writes a greedy answer to every prompt (batched through its
//! runner). Step 1: the small model is teacher-forced on prompt + answer, and at every
//! answer position we keep its final-norm hidden state, the input embedding of its greedy
//! token, its top-k logits, its greedy token and the large model's token; the label is
//! whether the two tokens differ. Prompts are processed in shards written whole, so an
//! interrupted run resumes at the first missing shard.

use crate::prompts::{encode, read_prompts};
use crate::shard::{self, Features};
use crate::{Result, TrainError};
use half::f16;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenrouter_engine::{load_config_models, EngineConfig};
use tokenrouter_runtime::{Row, Runner, SeqId, StepOptions};

/// `tokenrouter train-router label`
#[derive(clap::Args, Clone, Debug)]
pub struct LabelArgs {
    /// The pair's YAML (the first model is the small one, the second the large one).
    #[arg(long)]
    pub config: PathBuf,
    /// Prompt JSONL: {"prompt": ...}, {"messages": [...]} or {"text": ...} per line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Output directory (created; an existing one is resumed).
    #[arg(long)]
    pub out: PathBuf,
    /// Treat `prompt` fields as raw text (no chat template).
    #[arg(long)]
    pub raw: bool,
    /// Longest large-model answer, in tokens.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Prompts longer than this (tokens) are skipped.
    #[arg(long, default_value_t = 1024)]
    pub max_prompt_tokens: usize,
    /// Answers the large model writes at once.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Prompts per shard (the unit of resumption).
    #[arg(long, default_value_t = 32)]
    pub shard_size: usize,
    /// Top logits kept per position (R2R reads 100).
    #[arg(long, default_value_t = 100)]
    pub top_k: usize,
    /// Use only the first N prompts. A later run with a larger N (or none) in the same
    /// --out extends the labels when N is a multiple of --shard-size.
    #[arg(long)]
    pub limit: Option<usize>,
    #[arg(long)]
    pub no_progress: bool,
}

/// What a labelling run produced (all shards, including resumed ones).
#[derive(Debug, Default, serde::Serialize)]
pub struct LabelStats {
    pub prompts: usize,
    pub skipped_prompts: usize,
    pub positions: usize,
    pub mismatches: usize,
    pub answer_tokens_mean: f64,
    /// Seconds spent this run in each step (0 for shards that were already there).
    pub large_answer_s: f64,
    pub small_features_s: f64,
    pub shards_resumed: usize,
}

impl LabelStats {
    pub fn mismatch_rate(&self) -> f64 {
        self.mismatches as f64 / self.positions.max(1) as f64
    }

    pub fn summary(&self) -> String {
        format!(
            "labelled {} positions from {} prompts ({} skipped as too long; {} shards resumed): {} mismatches ({:.2}%); mean answer {:.0} tokens; large answers {:.1} s, small features {:.1} s this run",
            self.positions,
            self.prompts,
            self.skipped_prompts,
            self.shards_resumed,
            self.mismatches,
            100.0 * self.mismatch_rate(),
            self.answer_tokens_mean,
            self.large_answer_s,
            self.small_features_s
        )
    }
}

/// Label metadata: what the shards were made from (checked when resuming).
pub const META_FILE: &str = "labels.json";

/// Run labelling; see the module docs.
pub fn run(a: &LabelArgs) -> Result<LabelStats> {
    if a.shard_size == 0 || a.batch == 0 || a.max_tokens == 0 || a.top_k == 0 {
        return Err(TrainError::Input(
            "--shard-size, --batch, --max-tokens and --top-k must be at least 1".into(),
        ));
    }
    let mut prompts = read_prompts(&a.prompts, a.raw)?;
    if let Some(n) = a.limit {
        prompts.truncate(n);
    }
    if prompts.is_empty() {
        return Err(TrainError::Input("--limit 0 leaves no prompts".into()));
    }
    let prompts_sha = prompts_sha256(&a.prompts)?;
    let config = EngineConfig::from_file(&a.config)?;
    let (mut models, vocab) = load_config_models(&config)?;
    if models.len() < 2 {
        return Err(TrainError::Input(format!(
            "{}: a pair has two models; this config has {}",
            a.config.display(),
            models.len()
        )));
    }
    let large = models.remove(1);
    let small = models.remove(0);
    let (mut small_runner, small_text) = (small.model.runner, small.model.text);
    let mut large_runner = large.model.runner;
    let limit = vocab.sample_limit;
    let hidden_size = small_runner.config().hidden_size;
    let eos: Vec<u32> = small_text.eos_ids().to_vec();
    std::fs::create_dir_all(&a.out).map_err(|e| TrainError::file(&a.out, e))?;
    let meta = serde_json::json!({
        "version": 1,
        "small": {"name": small.name, "path": small.path},
        "large": {"name": large.name, "path": large.path},
        "prompts_sha256": prompts_sha,
        "prompts": prompts.len(),
        "raw": a.raw,
        "shard_size": a.shard_size,
        "max_tokens": a.max_tokens,
        "max_prompt_tokens": a.max_prompt_tokens,
        "top_k": a.top_k,
        "hidden_size": hidden_size,
        "sample_limit": limit,
    });
    check_or_write_meta(&a.out, &meta)?;

    let shards = prompts.len().div_ceil(a.shard_size);
    let bar = progress(a.no_progress, prompts.len() as u64, "labelling", "prompts");
    let mut stats = LabelStats {
        prompts: prompts.len(),
        ..Default::default()
    };
    let mut answers_count = 0usize;
    let mut next_seq: SeqId = 1;
    for s in 0..shards {
        let range = s * a.shard_size..((s + 1) * a.shard_size).min(prompts.len());
        let path = shard::shard_path(&a.out, s);
        if shard::exists(&path) {
            let f = shard::read(&path)?;
            let info = read_shard_info(&a.out, s)?;
            stats.positions += f.len();
            stats.mismatches += f.positives();
            stats.skipped_prompts += info.skipped;
            answers_count += info.answered;
            stats.shards_resumed += 1;
            bar.inc(range.len() as u64);
            continue;
        }
        let mut encoded = Vec::new();
        let mut skipped = 0;
        for i in range.clone() {
            let ids = encode(&prompts[i], &small_text)?;
            if ids.is_empty() || ids.len() > a.max_prompt_tokens {
                skipped += 1;
            } else {
                encoded.push((i, ids));
            }
        }
        let t0 = Instant::now();
        let answers = greedy_answers(
            &mut large_runner,
            &encoded,
            a.max_tokens,
            &eos,
            limit,
            a.batch,
            &mut next_seq,
        )?;
        stats.large_answer_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut f = Features::new(hidden_size, hidden_size, a.top_k);
        let mut texts = Vec::new();
        for ((i, ids), answer) in encoded.iter().zip(&answers) {
            next_seq += 1;
            small_features(
                &mut small_runner,
                next_seq,
                ids,
                answer,
                *i as u32,
                limit,
                a.top_k,
                &mut f,
            )?;
            texts.push(serde_json::json!({
                "prompt": i,
                "answer": small_text.decode(answer, false).unwrap_or_default(),
                "tokens": answer.len(),
            }));
            bar.inc(1);
        }
        bar.inc(skipped as u64);
        stats.small_features_s += t1.elapsed().as_secs_f64();
        answers_count += answers.len();
        stats.positions += f.len();
        stats.mismatches += f.positives();
        stats.skipped_prompts += skipped;
        write_shard_info(&a.out, s, skipped, answers.len(), &texts)?;
        shard::write(&path, &f)?;
    }
    bar.finish_and_clear();
    // Every answer token is one labelled position.
    stats.answer_tokens_mean = stats.positions as f64 / answers_count.max(1) as f64;
    let stats_path = a.out.join("label_stats.json");
    std::fs::write(
        &stats_path,
        serde_json::to_string_pretty(&stats).unwrap_or_default(),
    )
    .map_err(|e| TrainError::file(&stats_path, e))?;
    Ok(stats)
}

/// A progress bar (`hidden`: none) counting `what` up to `len`.
pub(crate) fn progress(hidden: bool, len: u64, doing: &str, what: &str) -> indicatif::ProgressBar {
    if hidden {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(&format!(
        "{doing} {{bar:40}} {{pos}}/{{len}} {what} [{{elapsed_precise}} < {{eta_precise}}]"
    )) {
        bar.set_style(style);
    }
    bar
}

/// The prompt file's sha256 (hex), which a label directory records.
pub fn prompts_sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| TrainError::file(path, e))?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}

/// A label directory's metadata (`labels.json`).
pub fn read_meta(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join(META_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        TrainError::file(
            &path,
            format!("not a label directory (run `tokenrouter train-router label`): {e}"),
        )
    })?;
    serde_json::from_str(&text).map_err(|e| TrainError::file(&path, e))
}

/// How many shards a label directory's metadata promises.
pub fn shard_count(meta: &serde_json::Value) -> usize {
    let get = |k: &str| meta.get(k).and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    get("prompts").div_ceil(get("shard_size").max(1))
}

fn check_or_write_meta(dir: &Path, meta: &serde_json::Value) -> Result<()> {
    let path = dir.join(META_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return write_meta(&path, meta);
    };
    let old: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| TrainError::file(&path, e))?;
    if &old == meta {
        return Ok(());
    }
    match grows(&old, meta) {
        Growth::Whole => write_meta(&path, meta),
        Growth::Partial(n) => Err(TrainError::file(
            &path,
            format!("this directory holds labels of the first {n} prompts, which end inside a shard; a larger --limit extends only labels that end on a shard boundary (a multiple of --shard-size); use a new --out"),
        )),
        Growth::No => Err(TrainError::file(
            &path,
            "this directory holds labels of other inputs (pair, prompts or options differ); use a new --out",
        )),
    }
}

/// Whether `new` labels more of the same prompt file than `old` did (a larger `--limit`).
enum Growth {
    /// Yes, and `old` ends on a shard boundary: its shards stay valid and are kept.
    Whole,
    /// Yes, but `old`'s last shard is partial: it would have to hold other prompts now.
    Partial(u64),
    No,
}

fn grows(old: &serde_json::Value, new: &serde_json::Value) -> Growth {
    let count = |v: &serde_json::Value| v.get("prompts").and_then(|p| p.as_u64());
    let (Some(old_n), Some(new_n)) = (count(old), count(new)) else {
        return Growth::No;
    };
    let mut same = old.clone();
    if let Some(obj) = same.as_object_mut() {
        obj.insert("prompts".into(), new_n.into());
    }
    if &same != new || old_n >= new_n {
        return Growth::No;
    }
    let shard_size = new.get("shard_size").and_then(|v| v.as_u64()).unwrap_or(1);
    if old_n % shard_size.max(1) == 0 {
        Growth::Whole
    } else {
        Growth::Partial(old_n)
    }
}

fn write_meta(path: &Path, meta: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(meta).unwrap_or_default())
        .map_err(|e| TrainError::file(path, e))
}

struct ShardInfo {
    skipped: usize,
    answered: usize,
}

fn info_path(dir: &Path, s: usize) -> PathBuf {
    dir.join(format!("answers-{s:05}.json"))
}

fn write_shard_info(
    dir: &Path,
    s: usize,
    skipped: usize,
    answered: usize,
    answers: &[serde_json::Value],
) -> Result<()> {
    let path = info_path(dir, s);
    let v = serde_json::json!({"skipped": skipped, "answered": answered, "answers": answers});
    std::fs::write(&path, v.to_string()).map_err(|e| TrainError::file(&path, e))
}

fn read_shard_info(dir: &Path, s: usize) -> Result<ShardInfo> {
    let path = info_path(dir, s);
    let text = std::fs::read_to_string(&path).map_err(|e| TrainError::file(&path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| TrainError::file(&path, e))?;
    let get = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0) as usize;
    Ok(ShardInfo {
        skipped: get("skipped"),
        answered: get("answered"),
    })
}

/// Greedy answers of `runner` to the prompts, `batch` at a time (one prefill step, then
/// one decode step per token for the rows still writing). An answer ends with an end
/// token (kept) or at `max_tokens`.
pub fn greedy_answers(
    runner: &mut Runner,
    prompts: &[(usize, Vec<u32>)],
    max_tokens: usize,
    eos: &[u32],
    limit: usize,
    batch: usize,
    next_seq: &mut SeqId,
) -> Result<Vec<Vec<u32>>> {
    let mut answers = Vec::with_capacity(prompts.len());
    for group in prompts.chunks(batch.max(1)) {
        let seqs: Vec<SeqId> = group
            .iter()
            .map(|_| {
                *next_seq += 1;
                *next_seq
            })
            .collect();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); group.len()];
        let mut rows: Vec<Row> = group
            .iter()
            .zip(&seqs)
            .map(|((_, p), &s)| Row::new(s, p.clone()))
            .collect();
        let mut active: Vec<usize> = (0..group.len()).collect();
        let result = (|| -> Result<()> {
            while !active.is_empty() {
                let step = runner.step(&rows, StepOptions::default())?;
                let picks = step.greedy_rows(limit)?;
                let mut still = Vec::new();
                for (&r, (tok, _)) in active.iter().zip(picks) {
                    out[r].push(tok);
                    if !eos.contains(&tok) && out[r].len() < max_tokens {
                        still.push(r);
                    }
                }
                active = still;
                rows = active
                    .iter()
                    .map(|&r| Row::new(seqs[r], vec![*out[r].last().unwrap_or(&0)]))
                    .collect();
            }
            Ok(())
        })();
        for &s in &seqs {
            runner.free(s);
        }
        result?;
        answers.extend(out);
    }
    Ok(answers)
}

/// Answer positions fed to the small model per teacher-forcing step (bounds the logits
/// held at once to this many rows of the vocabulary).
const TEACHER_CHUNK: usize = 128;

/// Teacher-force the small model on prompt + answer and append one feature row per answer
/// position: row j holds what the small model saw when it predicted answer token j.
#[allow(clippy::too_many_arguments)]
pub fn small_features(
    runner: &mut Runner,
    seq: SeqId,
    prompt: &[u32],
    answer: &[u32],
    prompt_index: u32,
    limit: usize,
    top_k: usize,
    f: &mut Features,
) -> Result<()> {
    if answer.is_empty() {
        return Ok(());
    }
    let result = (|| -> Result<()> {
        // The prompt's last position predicts answer token 0; answer token j (j < n-1)
        // predicts answer token j+1.
        let mut pos = 0usize;
        let mut feed = |rows: Vec<u32>, all: bool, pos: &mut usize| -> Result<()> {
            let out = runner.step(
                &[Row::new(seq, rows)],
                StepOptions {
                    want_hidden: true,
                    all_logits: all,
                },
            )?;
            let picks = out.greedy_rows(limit)?;
            let tops = out.top_logits_rows(limit, top_k)?;
            let hidden = out
                .hidden
                .as_ref()
                .ok_or_else(|| TrainError::Input("the model gave no hidden states".into()))?
                .to_dtype(candle_core::DType::F32)?
                .to_vec2::<f32>()?;
            if hidden.len() != picks.len() || tops.len() != picks.len() {
                return Err(TrainError::Input(format!(
                    "the model gave {} hidden rows for {} logit rows",
                    hidden.len(),
                    picks.len()
                )));
            }
            let small: Vec<u32> = picks.iter().map(|p| p.0).collect();
            let embed = runner
                .model()
                .embed_tokens(&small)?
                .to_dtype(candle_core::DType::F32)?
                .to_vec2::<f32>()?;
            for i in 0..small.len() {
                let top = &tops[i];
                if top.len() != top_k {
                    return Err(TrainError::Input(format!(
                        "the model has {} logits, fewer than --top-k {top_k}",
                        top.len()
                    )));
                }
                f.hidden.extend(hidden[i].iter().map(|&v| f16::from_f32(v)));
                f.embed.extend(embed[i].iter().map(|&v| f16::from_f32(v)));
                f.top.extend(top.iter().map(|&v| f16::from_f32(v)));
                f.small_token.push(small[i]);
                let large = answer[*pos];
                f.large_token.push(large);
                f.label.push((small[i] != large) as u8);
                f.prompt.push(prompt_index);
                f.position.push(*pos as u32);
                *pos += 1;
            }
            Ok(())
        };
        feed(prompt.to_vec(), false, &mut pos)?;
        for chunk in answer[..answer.len() - 1].chunks(TEACHER_CHUNK) {
            feed(chunk.to_vec(), true, &mut pos)?;
        }
        Ok(())
    })();
    runner.free(seq);
    result
}
