//! `train-router diverge`: which disagreements matter (R2R's steps 2 and 3). Labelling
//! counts every position where the small model's token differs from the large model's as
//! one to route, but many differences change nothing (another spelling, another word for
//! the same thing). Here the large model continues from each disagreement with the small
//! model's token to the end of the next line (step 2); its own answer is the continuation
//! of its token. A judge then says whether the two continuations differ in what they mean
//! or do (step 3, `judge.rs`); `fit --labels divergent` routes only those positions.
//!
//! Results go next to the shards, one `divergence-NNNNN.json` per shard written whole, so
//! an interrupted run resumes; a later run with another judge re-judges the stored
//! continuations without the model.

use crate::judge::{self, JudgeKind, Verifier};
use crate::label::{progress, prompts_sha256, read_meta, shard_count};
use crate::prompts::{encode, read_prompts};
use crate::shard::{self, Features};
use crate::{Result, TrainError};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenrouter_engine::{load_config_models, EngineConfig};
use tokenrouter_runtime::{Row, Runner, SeqId, StepOptions, TextModel};

/// `tokenrouter train-router diverge`
#[derive(clap::Args, Clone, Debug)]
pub struct DivergeArgs {
    /// The pair's YAML (as given to `label`).
    #[arg(long)]
    pub config: PathBuf,
    /// The prompt JSONL given to `label`.
    #[arg(long)]
    pub prompts: PathBuf,
    /// A directory written by `train-router label`.
    #[arg(long)]
    pub data: PathBuf,
    /// A continuation runs to the end of this many lines (1: the line of the
    /// disagreement; 2: and the next one, as R2R's one further sentence).
    #[arg(long, default_value_t = 2)]
    pub lines: usize,
    /// Longest continuation, in tokens (from the disagreeing token on).
    #[arg(long, default_value_t = 48)]
    pub max_continuation: usize,
    /// Lines of the answer before the disagreement shown to the judge.
    #[arg(long, default_value_t = 8)]
    pub context_lines: usize,
    /// Answers continued at once.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// code: divergent when the code the continuations write differs (comments, docstrings,
    /// spacing and prose outside code blocks do not count; one may stop short of the
    /// other); exact: unless both write the same text; model: an LLM behind an
    /// OpenAI-compatible endpoint judges (R2R's step 3).
    #[arg(long, value_enum, default_value = "code")]
    pub judge: JudgeKind,
    #[command(flatten)]
    pub verifier: Verifier,
    #[arg(long)]
    pub no_progress: bool,
}

/// Options that shape the continuations (a directory keeps one set).
pub const DIVERGENCE_META: &str = "divergence.json";

/// One disagreement, its two continuations and the judge's verdict.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Point {
    pub prompt: u32,
    pub position: u32,
    pub small_token: u32,
    pub large_token: u32,
    /// The answer's last `context_lines` lines before the disagreement.
    pub context: String,
    /// The disagreeing token's text and the continuation from it (by the large model).
    pub small_text: String,
    pub branch: String,
    /// The large model's token and its own answer from there.
    pub large_text: String,
    pub reference: String,
    /// The disagreement is inside code: a fenced block, or an answer with no fences.
    pub in_code: bool,
    /// That code before the disagreement (from the fence line's end, or the answer's
    /// start), where the code judge reads which strings and comments are open.
    pub code_before: String,
    /// False when the answer stopped (at `--max-tokens`) before the span closed: not judged.
    pub complete: bool,
    /// The verdict: `Some(true)` routes the position; `None`: not judged or no verdict read.
    pub divergent: Option<bool>,
}

/// A shard's continuations and the judge that labelled them.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ShardDivergence {
    pub judge: String,
    pub points: Vec<Point>,
}

/// What a run produced over every shard.
#[derive(Debug, Default, serde::Serialize)]
pub struct DivergeStats {
    pub disagreements: usize,
    pub divergent: usize,
    pub neutral: usize,
    /// Cut by the answer's end, or the judge gave no verdict: kept as divergent.
    pub unjudged: usize,
    pub continued_s: f64,
    pub judged_s: f64,
    pub shards_resumed: usize,
}

impl DivergeStats {
    pub fn summary(&self, judge: JudgeKind) -> String {
        format!(
            "{} disagreements: {} divergent, {} neutral ({:.1}% of them), {} not judged (kept divergent) by the {} judge; continuations {:.1} s, judging {:.1} s this run ({} shards resumed)",
            self.disagreements,
            self.divergent,
            self.neutral,
            100.0 * self.neutral as f64 / self.disagreements.max(1) as f64,
            self.unjudged,
            judge.name(),
            self.continued_s,
            self.judged_s,
            self.shards_resumed
        )
    }

    fn count(&mut self, points: &[Point]) {
        self.disagreements += points.len();
        for p in points {
            match p.divergent {
                Some(true) => self.divergent += 1,
                Some(false) => self.neutral += 1,
                None => self.unjudged += 1,
            }
        }
    }
}

pub fn divergence_path(dir: &Path, shard: usize) -> PathBuf {
    dir.join(format!("divergence-{shard:05}.json"))
}

/// Run steps 2 and 3 over every shard of `a.data`.
pub fn run(a: &DivergeArgs) -> Result<DivergeStats> {
    if a.lines == 0 || a.max_continuation == 0 || a.batch == 0 {
        return Err(TrainError::Input(
            "--lines, --max-continuation and --batch must be at least 1".into(),
        ));
    }
    if a.judge == JudgeKind::Model {
        a.verifier.check()?;
    }
    let meta = read_meta(&a.data)?;
    let get = |k: &str| meta.get(k).and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    let prompts_sha = prompts_sha256(&a.prompts)?;
    if meta.get("prompts_sha256").and_then(|v| v.as_str()) != Some(prompts_sha.as_str()) {
        return Err(TrainError::file(
            &a.prompts,
            "not the prompt file these labels were made from",
        ));
    }
    let shards = shard_count(&meta);
    let raw = meta.get("raw").and_then(|v| v.as_bool()).unwrap_or(false);
    check_or_write_divergence_meta(a)?;
    for s in 0..shards {
        if !shard::exists(&shard::shard_path(&a.data, s)) {
            return Err(TrainError::file(
                shard::shard_path(&a.data, s),
                "missing: labelling did not finish (run the same `train-router label` again to resume)",
            ));
        }
    }

    let mut prompts = read_prompts(&a.prompts, raw)?;
    prompts.truncate(get("prompts"));
    let mut stats = DivergeStats::default();
    let mut model: Option<(Runner, TextModel, usize)> = None;
    let bar = progress(
        a.no_progress,
        shards as u64,
        "continuing and judging",
        "shards",
    );
    let mut next_seq: SeqId = 1;
    for s in 0..shards {
        let path = divergence_path(&a.data, s);
        let mut done = match std::fs::read_to_string(&path) {
            Ok(text) => Some(
                serde_json::from_str::<ShardDivergence>(&text)
                    .map_err(|e| TrainError::file(&path, e))?,
            ),
            Err(_) => None,
        };
        let judge = a.judge.label(&a.verifier);
        if let Some(d) = &done {
            if d.judge == judge {
                stats.count(&d.points);
                stats.shards_resumed += 1;
                bar.inc(1);
                continue;
            }
        }
        let mut points = match done.take() {
            Some(d) => d.points,
            None => {
                if model.is_none() {
                    model = Some(load_large(&a.config)?);
                }
                let Some((runner, text, limit)) = model.as_mut() else {
                    return Err(TrainError::Input("the large model did not load".into()));
                };
                let f = shard::read(&shard::shard_path(&a.data, s))?;
                let t0 = Instant::now();
                let mut walks = Vec::new();
                for answer in answers(&f) {
                    let prompt = prompts.get(answer.prompt as usize).ok_or_else(|| {
                        TrainError::file(
                            shard::shard_path(&a.data, s),
                            format!("names prompt {}, past the prompt file", answer.prompt),
                        )
                    })?;
                    walks.push((encode(prompt, text)?, answer));
                }
                let spans = Spans {
                    lines: a.lines,
                    max: a.max_continuation,
                    eos: text.eos_ids().to_vec(),
                };
                let pts = continue_all(
                    runner,
                    text,
                    *limit,
                    &f,
                    &walks,
                    &spans,
                    a.batch,
                    a.context_lines,
                    &mut next_seq,
                )?;
                stats.continued_s += t0.elapsed().as_secs_f64();
                pts
            }
        };
        let t1 = Instant::now();
        judge::judge_all(a.judge, &a.verifier, &mut points, &prompts)?;
        stats.judged_s += t1.elapsed().as_secs_f64();
        stats.count(&points);
        let out = ShardDivergence { judge, points };
        write_whole(&path, &serde_json::to_string(&out).unwrap_or_default())?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let stats_path = a.data.join("divergence_stats.json");
    write_whole(
        &stats_path,
        &serde_json::to_string_pretty(&stats).unwrap_or_default(),
    )?;
    Ok(stats)
}

fn load_large(config: &Path) -> Result<(Runner, TextModel, usize)> {
    let config = EngineConfig::from_file(config)?;
    let (mut models, vocab) = load_config_models(&config)?;
    if models.len() < 2 {
        return Err(TrainError::Input(
            "a pair has two models; this config has fewer".into(),
        ));
    }
    let large = models.remove(1).model;
    Ok((large.runner, large.text, vocab.sample_limit))
}

fn check_or_write_divergence_meta(a: &DivergeArgs) -> Result<()> {
    let meta = serde_json::json!({
        "version": 1,
        "lines": a.lines,
        "max_continuation": a.max_continuation,
        "context_lines": a.context_lines,
    });
    let path = a.data.join(DIVERGENCE_META);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let old: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| TrainError::file(&path, e))?;
            if old != meta {
                return Err(TrainError::file(
                    &path,
                    format!("continuations here were made with other options ({old}); give the same --lines, --max-continuation and --context-lines, or label into a new directory"),
                ));
            }
            Ok(())
        }
        Err(_) => write_whole(&path, &meta.to_string()),
    }
}

/// Write a file whole: a temporary name, then a rename.
fn write_whole(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| TrainError::file(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| TrainError::file(path, e))
}

/// One labelled answer of a shard.
#[derive(Debug, PartialEq)]
pub struct LabelledAnswer {
    pub prompt: u32,
    /// The large model's tokens, one per labelled position.
    pub answer: Vec<u32>,
    /// The shard rows of those positions, in position order.
    pub rows: Vec<usize>,
}

/// Each answer of a shard, in the order its prompt first appears.
pub fn answers(f: &Features) -> Vec<LabelledAnswer> {
    let mut by_prompt: Vec<(u32, Vec<usize>)> = Vec::new();
    let mut index: HashMap<u32, usize> = HashMap::new();
    for r in 0..f.len() {
        let p = f.prompt[r];
        let i = *index.entry(p).or_insert_with(|| {
            by_prompt.push((p, Vec::new()));
            by_prompt.len() - 1
        });
        by_prompt[i].1.push(r);
    }
    by_prompt
        .into_iter()
        .map(|(p, mut rows)| {
            rows.sort_by_key(|&r| f.position[r]);
            let answer = rows.iter().map(|&r| f.large_token[r]).collect();
            LabelledAnswer {
                prompt: p,
                answer,
                rows,
            }
        })
        .collect()
}

/// Where a continuation stops: the end of the `lines`-th line, `max` tokens, or an end
/// token (not part of the text).
pub struct Spans {
    pub lines: usize,
    pub max: usize,
    pub eos: Vec<u32>,
}

/// The text of a span and whether it is closed, for the tokens written so far. (An
/// answer that ended naturally holds its end token, so a labelled answer's tail that
/// stays open was cut at `label --max-tokens`.)
pub fn span_text(spans: &Spans, text: &TextModel, tokens: &[u32]) -> Result<(String, bool)> {
    let (body, stopped) = match tokens.iter().position(|t| spans.eos.contains(t)) {
        Some(i) => (&tokens[..i], true),
        None => (tokens, false),
    };
    let s = text.decode(body, false)?;
    if let Some(cut) = s.match_indices('\n').nth(spans.lines - 1).map(|(i, _)| i) {
        return Ok((s[..=cut].to_string(), true));
    }
    let full = body.len() >= spans.max;
    Ok((s, stopped || full))
}

struct Walk {
    seq: SeqId,
    /// Prompt tokens + the whole answer.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Disagreements still to continue: (point index, answer position).
    todo: VecDeque<(usize, usize)>,
    /// Positions of `tokens` whose KV is cached.
    cached: usize,
    /// The point being continued and the tokens written from its small token on.
    current: Option<(usize, usize, Vec<u32>)>,
}

/// Step 2 for a shard: every disagreement continued by the large model from the small
/// model's token, `batch` answers at a time. One sequence per answer walks its
/// disagreements in order: it is extended to the next disagreement, continued, then cut
/// back to the shared prefix (`Runner::truncate`), so each answer's prefix is computed once.
#[allow(clippy::too_many_arguments)]
fn continue_all(
    runner: &mut Runner,
    text: &TextModel,
    limit: usize,
    f: &Features,
    walks_in: &[(Vec<u32>, LabelledAnswer)],
    spans: &Spans,
    batch: usize,
    context_lines: usize,
    next_seq: &mut SeqId,
) -> Result<Vec<Point>> {
    let mut points: Vec<Point> = Vec::new();
    let mut pending: VecDeque<Walk> = VecDeque::new();
    for (
        ids,
        LabelledAnswer {
            prompt,
            answer,
            rows,
        },
    ) in walks_in
    {
        let fenced = text.decode(answer, false)?.contains("```");
        let mut todo = VecDeque::new();
        for (j, &r) in rows.iter().enumerate() {
            if f.label[r] == 0 {
                continue;
            }
            let (reference, closed) = span_text(spans, text, &answer[j..])?;
            let before = text.decode(&answer[..j], false)?;
            let in_code = inside_code(fenced, &before);
            let code_before = if in_code {
                code_block_start(&before).to_string()
            } else {
                String::new()
            };
            points.push(Point {
                prompt: *prompt,
                position: j as u32,
                small_token: f.small_token[r],
                large_token: answer[j],
                context: last_lines(&before, context_lines),
                small_text: text.decode(&[f.small_token[r]], false)?,
                branch: String::new(),
                large_text: text.decode(&answer[j..=j], false)?,
                reference,
                in_code,
                code_before,
                complete: closed,
                divergent: None,
            });
            todo.push_back((points.len() - 1, j));
        }
        if todo.is_empty() {
            continue;
        }
        *next_seq += 1;
        let mut tokens = ids.clone();
        tokens.extend_from_slice(answer);
        pending.push_back(Walk {
            seq: *next_seq,
            tokens,
            prompt_len: ids.len(),
            todo,
            cached: 0,
            current: None,
        });
    }
    let mut active: Vec<Walk> = Vec::new();
    let result = (|| -> Result<()> {
        loop {
            // Start the next disagreement of every walk without one; a small token that
            // closes its span alone needs no model step.
            while active.len() < batch {
                match pending.pop_front() {
                    Some(w) => active.push(w),
                    None => break,
                }
            }
            let mut i = 0;
            while i < active.len() {
                let w = &mut active[i];
                while w.current.is_none() {
                    let Some((pi, j)) = w.todo.pop_front() else {
                        break;
                    };
                    let first = vec![points[pi].small_token];
                    let (t, closed) = span_text(spans, text, &first)?;
                    if closed {
                        points[pi].branch = t;
                    } else {
                        w.current = Some((pi, j, first));
                    }
                }
                if w.current.is_none() {
                    runner.free(w.seq);
                    active.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            if active.is_empty() {
                if pending.is_empty() {
                    return Ok(());
                }
                continue;
            }
            let mut rows: Vec<Row> = Vec::with_capacity(active.len());
            for w in &active {
                let Some((_, j, written)) = &w.current else {
                    return Err(TrainError::Input("a walk in the batch has no point".into()));
                };
                // A new point: extend the cached prefix to it, then its small token.
                let feed = match written.as_slice() {
                    [first] => {
                        let mut feed = w.tokens[w.cached..w.prompt_len + j].to_vec();
                        feed.push(*first);
                        feed
                    }
                    [.., last] => vec![*last],
                    [] => return Err(TrainError::Input("a point with no token".into())),
                };
                rows.push(Row::new(w.seq, feed));
            }
            let picks = runner
                .step(&rows, StepOptions::default())?
                .greedy_rows(limit)?;
            for (w, (tok, _)) in active.iter_mut().zip(picks) {
                let Some((pi, j, mut written)) = w.current.take() else {
                    continue;
                };
                written.push(tok);
                let (t, closed) = span_text(spans, text, &written)?;
                if closed {
                    points[pi].branch = t;
                    w.cached = runner.truncate(w.seq, w.prompt_len + j);
                } else {
                    w.current = Some((pi, j, written));
                }
            }
        }
    })();
    for w in active.iter().chain(pending.iter()) {
        runner.free(w.seq);
    }
    result?;
    Ok(points)
}

/// Whether text after `before` is code: an answer without fences is all code; one with
/// fences is code between an opening and a closing one.
fn inside_code(fenced: bool, before: &str) -> bool {
    !fenced || before.matches("```").count() % 2 == 1
}

/// The current code block of `before`: after the line of its last fence, or all of it.
fn code_block_start(before: &str) -> &str {
    match before.rfind("```") {
        Some(i) => before[i..].find('\n').map_or("", |k| &before[i + k + 1..]),
        None => before,
    }
}

fn last_lines(s: &str, n: usize) -> String {
    let starts: Vec<usize> = s.match_indices('\n').map(|(i, _)| i + 1).collect();
    if starts.len() < n {
        return s.to_string();
    }
    s[starts[starts.len() - n]..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_lines_keeps_the_partial_line() {
        assert_eq!(last_lines("a\nb\nc", 1), "c");
        assert_eq!(last_lines("a\nb\nc", 2), "b\nc");
        assert_eq!(last_lines("a\nb\nc", 5), "a\nb\nc");
        assert_eq!(last_lines("a\nb\n", 1), "");
    }

    #[test]
    fn code_is_between_fences_or_everywhere_without_them() {
        assert!(inside_code(false, "Here it is:\n"));
        assert!(!inside_code(true, "Here it is:\n"));
        assert!(inside_code(true, "Here it is:\n```python\ndef f():\n"));
        assert!(!inside_code(true, "```python\nx = 1\n```\n\nThe function"));
        assert_eq!(
            code_block_start("Here:\n```python\ndef f():\n"),
            "def f():\n"
        );
        assert_eq!(code_block_start("def f():\n    x"), "def f():\n    x");
        assert_eq!(code_block_start("Here:\n```py"), "");
    }

    #[test]
    fn answers_are_rebuilt_in_position_order() {
        let mut f = Features::new(1, 1, 1);
        for (p, pos, tok) in [(3u32, 1u32, 11u32), (3, 0, 10), (5, 0, 20), (3, 2, 12)] {
            f.prompt.push(p);
            f.position.push(pos);
            f.large_token.push(tok);
            f.small_token.push(tok);
            f.label.push(0);
        }
        let a = answers(&f);
        assert_eq!(a.len(), 2);
        let got: Vec<_> = a
            .into_iter()
            .map(|x| (x.prompt, x.answer, x.rows))
            .collect();
        assert_eq!(got[0], (3, vec![10, 11, 12], vec![1, 0, 3]));
        assert_eq!(got[1], (5, vec![20], vec![2]));
    }
}
