//! The token masks of one step: structured output's, computed for every constrained row
//! (spread over threads when there are many: a mask takes 0.1-0.3 ms and a GPU step of a
//! large batch only a few ms), narrowed by the request's token restrictions (vLLM's
//! `min_tokens`, `allowed_token_ids`, `bad_words`), then applied on the host or uploaded for
//! the device's greedy pick (`StepOutput::greedy_rows_allowed`).

use candle_core::Tensor;
use std::sync::OnceLock;
use tokenrouter_grammar::{Allowed, Grammar};
use tokenrouter_runtime::RuntimeError;

/// A constrained row's grammar and where its failure is written.
pub(super) type Constrained<'a> = Option<(&'a mut Grammar, &'a mut Option<String>)>;

/// Constrained rows a thread is given at least (a thread costs tens of microseconds).
const ROWS_PER_THREAD: usize = 4;

/// Each row's allowed tokens (`None` for a free row, or where the constraint failed: the
/// failure is written to the row's fault), on several threads when there are enough
/// constrained rows to share.
pub(super) fn compute(rows: Vec<Constrained<'_>>) -> Vec<Option<Allowed>> {
    let constrained = rows.iter().filter(|r| r.is_some()).count();
    let threads = workers().min(constrained / ROWS_PER_THREAD).max(1);
    if threads == 1 {
        return rows.into_iter().map(one).collect();
    }
    let per_thread = rows.len().div_ceil(threads);
    let mut rows = rows.into_iter();
    let chunks: Vec<Vec<_>> = (0..threads)
        .map(|_| rows.by_ref().take(per_thread).collect())
        .collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| scope.spawn(move || chunk.into_iter().map(one).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| match h.join() {
                Ok(out) => out,
                // llguidance does not panic on user input; were it to, resume the panic
                // here rather than lose the rows' places.
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    })
}

fn one(row: Constrained<'_>) -> Option<Allowed> {
    let (grammar, fault) = row?;
    match grammar.allowed() {
        Ok(allowed) => Some(allowed),
        Err(e) => {
            *fault = Some(e.to_string());
            None
        }
    }
}

/// What one row may pick this step.
pub(super) enum RowMask {
    /// Its constraint's tokens alone.
    Grammar(Allowed),
    /// Narrowed by its token restrictions: id `i` is bit `i % 8` of byte `i / 8`.
    Bits(Vec<u8>),
}

impl RowMask {
    /// Sets the logit of every id the row may not pick to -inf.
    pub(super) fn apply(&self, logits: &mut [f32]) {
        match self {
            RowMask::Grammar(allowed) => allowed.apply(logits),
            RowMask::Bits(bits) => {
                for (i, x) in logits.iter_mut().enumerate() {
                    if !bit(bits, i) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// Whether the row may pick exactly one token.
    pub(super) fn allows_one(&self) -> bool {
        match self {
            RowMask::Grammar(allowed) => allowed.count() == 1,
            RowMask::Bits(bits) => bits.iter().map(|b| b.count_ones()).sum::<u32>() == 1,
        }
    }

    /// Writes the mask over `row` (`limit.div_ceil(8)` bytes; see [`RowMask::Bits`]).
    fn write_bits(&self, row: &mut [u8]) {
        match self {
            RowMask::Grammar(allowed) => allowed.write_bits(row),
            RowMask::Bits(bits) => {
                let n = bits.len().min(row.len());
                row[..n].copy_from_slice(&bits[..n]);
                row[n..].fill(0);
            }
        }
    }
}

impl crate::policy::AllowedTokens for RowMask {
    fn allows(&self, id: u32) -> bool {
        match self {
            RowMask::Grammar(allowed) => allowed.is_allowed(id),
            RowMask::Bits(bits) => bit(bits, id as usize),
        }
    }
}

fn bit(bits: &[u8], i: usize) -> bool {
    bits.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0)
}

/// A row's mask: its constraint's tokens (`grammar`), within `only` (`allowed_token_ids`)
/// when given, less `banned` (its stop ids before `min_tokens`, bad words' last ids) —
/// unless the bans would leave nothing to pick (a finished constraint that allows only its
/// end, `allowed_token_ids` within the stop ids): then the constraint and `only` alone.
/// Ids at or above `limit` are never allowed.
pub(super) fn narrow(
    grammar: Option<Allowed>,
    only: Option<&[u32]>,
    banned: &[u32],
    limit: usize,
) -> Option<RowMask> {
    if only.is_none() && banned.is_empty() {
        return grammar.map(RowMask::Grammar);
    }
    let mut bits = vec![0u8; limit.div_ceil(8)];
    match &grammar {
        Some(allowed) => allowed.write_bits(&mut bits),
        None => {
            bits.fill(0xFF);
            if let Some(last) = bits.last_mut() {
                if !limit.is_multiple_of(8) {
                    *last = ((1u16 << (limit % 8)) - 1) as u8;
                }
            }
        }
    }
    if let Some(only) = only {
        let mut kept = vec![0u8; bits.len()];
        for &id in only {
            let i = id as usize;
            if bit(&bits, i) {
                kept[i / 8] |= 1 << (i % 8);
            }
        }
        bits = kept;
    }
    if banned.is_empty() {
        return Some(RowMask::Bits(bits));
    }
    let mut narrowed = bits.clone();
    for &id in banned {
        if let Some(b) = narrowed.get_mut(id as usize / 8) {
            *b &= !(1 << (id % 8));
        }
    }
    let left = narrowed.iter().any(|&b| b != 0);
    Some(RowMask::Bits(if left { narrowed } else { bits }))
}

fn workers() -> usize {
    static WORKERS: OnceLock<usize> = OnceLock::new();
    *WORKERS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The masks where `logits` are, as `StepOutput::greedy_rows_allowed` takes them (u8
/// flags `[rows, limit]`, a free row allowing every id; `limit` clamped as it clamps it),
/// uploaded as bits and unpacked there; `None` when no row is constrained.
pub(super) fn upload(
    allowed: &[Option<RowMask>],
    limit: usize,
    logits: &Tensor,
) -> Result<Option<Tensor>, RuntimeError> {
    if allowed.iter().all(Option::is_none) {
        return Ok(None);
    }
    let limit = limit.clamp(1, logits.dim(1)?);
    let row_bytes = limit.div_ceil(8);
    let mut bits = vec![0xFFu8; allowed.len() * row_bytes];
    for (row, a) in bits.chunks_mut(row_bytes).zip(allowed) {
        if let Some(a) = a {
            a.write_bits(row);
        }
    }
    let bits = Tensor::from_vec(bits, (allowed.len(), row_bytes), logits.device())?;
    Ok(Some(tokenrouter_runtime::runner::unpack_bits(
        &bits, limit,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenrouter_api::OutputConstraint;
    use tokenrouter_grammar::GrammarCompiler;
    use tokenrouter_runtime::runner::StepOutput;
    use tokenrouter_runtime::TextModel;

    #[test]
    fn free_rows_need_no_upload_and_keep_every_id() {
        let logits =
            Tensor::zeros((2, 10), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        assert!(upload(&[None, None], 10, &logits).unwrap().is_none());
        assert!(compute(vec![None, None, None]).iter().all(Option::is_none));
    }

    /// The uploaded form (bits, unpacked where the logits are) picks what the host's
    /// masking picks, row by row, beside a free row; ids past the token table never.
    #[test]
    fn uploaded_masks_pick_what_host_masks_pick() {
        let (vocab, width) = (300usize, 340usize);
        let text = TextModel::synthetic(vocab).unwrap();
        let eos = text.encode("<|im_end|>").unwrap();
        let compiler = GrammarCompiler::new(text.tokenizer(), width, &eos).unwrap();
        let mut grammars: Vec<_> = ["[a-c]+", "x[0-9]"]
            .iter()
            .map(|rx| {
                compiler
                    .compile(&OutputConstraint::Regex(rx.to_string()))
                    .unwrap()
            })
            .collect();
        let mut faults = [None, None];
        let rows: Vec<Constrained<'_>> = grammars
            .iter_mut()
            .zip(faults.iter_mut())
            .map(Some)
            .chain(std::iter::once(None))
            .collect();
        let limit = width - 5;
        // The third row is free of a constraint but restricted: ids 7..40 alone, less 9.
        let only: Vec<u32> = (7..40).collect();
        let restricted = [
            (None, &[][..]),
            (None, &[][..]),
            (Some(&only[..]), &[9u32][..]),
        ];
        let allowed: Vec<Option<RowMask>> = compute(rows)
            .into_iter()
            .zip(restricted)
            .map(|(g, (only, banned))| narrow(g, only, banned, limit))
            .collect();
        let logits = Tensor::randn(0f32, 3.0, (3, width), &candle_core::Device::Cpu).unwrap();
        let out = StepOutput {
            logits: logits.clone(),
            hidden: None,
        };
        let mask = upload(&allowed, limit, &logits).unwrap().unwrap();
        let picks = out.greedy_rows_allowed(limit, Some(&mask)).unwrap();
        for ((row, a), (token, _)) in logits
            .to_vec2::<f32>()
            .unwrap()
            .iter()
            .zip(&allowed)
            .zip(&picks)
        {
            let mut host = row.clone();
            if let Some(a) = a {
                a.apply(&mut host);
                assert!((*token as usize) < vocab, "an id past the table");
            }
            let best = (0..limit)
                .max_by(|&x, &y| host[x].total_cmp(&host[y]))
                .unwrap();
            assert_eq!(*token as usize, best);
        }
        assert!((7..40).contains(&picks[2].0) && picks[2].0 != 9);
    }

    fn allowed_ids(mask: &RowMask, limit: usize) -> Vec<usize> {
        let mut logits = vec![0.0f32; limit + 3];
        mask.apply(&mut logits);
        (0..logits.len()).filter(|&i| logits[i] == 0.0).collect()
    }

    /// Restrictions narrow a free row to `only` less `banned`, ids past the limit never;
    /// bans that would leave nothing are dropped (the row still has a token to pick).
    #[test]
    fn restrictions_narrow_a_row_but_never_to_nothing() {
        let limit = 21;
        assert!(narrow(None, None, &[], limit).is_none());
        let banned = narrow(None, None, &[3, 20, 99], limit).unwrap();
        let expect: Vec<usize> = (0..limit).filter(|&i| i != 3 && i != 20).collect();
        assert_eq!(allowed_ids(&banned, limit), expect);
        let only = narrow(None, Some(&[2, 5, 30]), &[5], limit).unwrap();
        assert_eq!(allowed_ids(&only, limit), [2]);
        let all_banned = narrow(None, Some(&[2, 5]), &[2, 5], limit).unwrap();
        assert_eq!(allowed_ids(&all_banned, limit), [2, 5]);
        let mut bits = vec![0u8; limit.div_ceil(8)];
        banned.write_bits(&mut bits);
        let from_bits: Vec<usize> = (0..limit).filter(|&i| bit(&bits, i)).collect();
        assert_eq!(from_bits, expect);
    }
}
