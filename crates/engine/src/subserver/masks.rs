//! Structured output's token masks for one step: computed for every constrained row
//! (spread over threads when there are many: a mask takes 0.1-0.3 ms and a GPU step of a
//! large batch only a few ms), then applied on the host or uploaded for the device's greedy
//! pick (`StepOutput::greedy_rows_allowed`).

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

fn workers() -> usize {
    static WORKERS: OnceLock<usize> = OnceLock::new();
    *WORKERS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The masks where `logits` are, as `StepOutput::greedy_rows_allowed` takes them (u8
/// flags `[rows, limit]`, a free row allowing every id; `limit` clamped as it clamps it),
/// uploaded as bits and unpacked there; `None` when no row is constrained.
pub(super) fn upload(
    allowed: &[Option<Allowed>],
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
        let allowed = compute(rows);
        let logits = Tensor::randn(0f32, 3.0, (3, width), &candle_core::Device::Cpu).unwrap();
        let out = StepOutput {
            logits: logits.clone(),
            hidden: None,
        };
        let limit = width - 5;
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
    }
}
