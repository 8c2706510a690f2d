//! Fill-in-the-middle prompts: code completion between a prefix and a suffix (an editor's
//! cursor), as llama.cpp's `/infill` and OpenAI's completions `suffix` ask for it. Coder
//! models are trained on the layout `[PRE]prefix[SUF]suffix[MID]` and write the middle;
//! Qwen2.5-Coder also on repository context before it (`[REPO]name` then `[SEP]path` and
//! the file's text per file, arXiv 2409.12186). The special tokens are found in the
//! tokenizer by their text (the families llama.cpp knows), so a model without them is told
//! so instead of being fed a prompt it cannot read.

use tokenrouter_api::fim_markers::{FILE_SEP, MIDDLE, PAD, PREFIX, REPO, SUFFIX};
use tokenrouter_api::Backend;

/// llama.cpp's batch size (`-b 2048`), by which it apportions the prompt: the prefix keeps
/// its last 3/4 of it, the suffix (and the `prompt` after the middle token) the rest.
const FIM_BATCH: usize = 2048;

/// The model's fill-in-the-middle tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    pub pad: Option<u32>,
    pub repo: Option<u32>,
    pub file_sep: Option<u32>,
}

impl FimTokens {
    /// The tokens of the served tokenizer, or `None` when it has no prefix, suffix and
    /// middle tokens (the pair shares one tokenizer).
    pub fn find(backend: &dyn Backend) -> Option<Self> {
        let find = |names: &[&str]| names.iter().find_map(|name| special_id(backend, name));
        Some(Self {
            prefix: find(PREFIX)?,
            suffix: find(SUFFIX)?,
            middle: find(MIDDLE)?,
            pad: find(PAD),
            repo: find(REPO),
            file_sep: find(FILE_SEP),
        })
    }

    /// Tokens that end a fill-in-the-middle answer beside the model's EOS: a model that
    /// writes padding or starts another file has finished the middle (llama.cpp counts them
    /// as end of generation).
    pub fn stop_ids(&self) -> Vec<u32> {
        [self.pad, self.repo, self.file_sep]
            .into_iter()
            .flatten()
            .collect()
    }
}

/// `name` as one token of the tokenizer, if it is one.
fn special_id(backend: &dyn Backend, name: &str) -> Option<u32> {
    match backend.encode(name).ok()?.as_slice() {
        [id] => (backend.decode(&[*id], false).ok()? == name).then_some(*id),
        _ => None,
    }
}

/// One file of repository context (llama.cpp's `input_extra` chunk).
#[derive(Clone, Debug, PartialEq)]
pub struct ExtraFile {
    pub filename: String,
    pub text: String,
}

/// A fill-in-the-middle request, tokenized: the text before and after the cursor, other
/// files for context, and the start of the middle the model continues (`prompt`).
#[derive(Clone, Debug, Default)]
pub struct InfillIds {
    pub prefix: Vec<u32>,
    pub suffix: Vec<u32>,
    /// Per extra file: its header (`filename` and a newline) and its text.
    pub extra: Vec<(Vec<u32>, Vec<u32>)>,
    /// `"myproject\n"` (llama.cpp's repository name) and `"filename\n"` (the current
    /// file's header), tokenized; used only when the model has those tokens.
    pub repo_name: Vec<u32>,
    pub current_file: Vec<u32>,
    /// `"\n\n--- snippet ---\n\n"`: separates extra files for a model without file tokens.
    pub snippet_separator: Vec<u32>,
    pub middle_start: Vec<u32>,
}

/// The repository name and current-file header llama.cpp writes (it has no field for them).
pub const REPO_NAME: &str = "myproject\n";
pub const CURRENT_FILE: &str = "filename\n";
pub const SNIPPET_SEPARATOR: &str = "\n\n--- snippet ---\n\n";

/// The prompt, in llama.cpp's layout and proportions:
/// `[REPO]myproject\n [SEP]file\n text … [SEP]filename\n [PRE]prefix[SUF]suffix[MID]prompt`.
/// The prefix keeps its last `3/4 · 2048` tokens, the suffix its first `2048/4 − 2 −
/// |prompt|`, and the extra context, cut from its start, what the context leaves beyond one
/// batch and twice the output.
pub fn assemble(tokens: &FimTokens, ids: &InfillIds, context: usize, max_new: usize) -> Vec<u32> {
    let batch = FIM_BATCH.min(context);
    let prefix_take = ids.prefix.len().min(3 * (batch / 4));
    let suffix_room = (batch / 4).saturating_sub(2 + ids.middle_start.len());
    let suffix_take = ids.suffix.len().min(suffix_room);

    let mut extra = Vec::new();
    if let Some(repo) = tokens.repo {
        extra.push(repo);
        extra.extend(&ids.repo_name);
    }
    for (header, text) in &ids.extra {
        match tokens.file_sep {
            Some(sep) => {
                extra.push(sep);
                extra.extend(header);
            }
            None => extra.extend(&ids.snippet_separator),
        }
        extra.extend(text);
    }
    if let Some(sep) = tokens.file_sep {
        extra.push(sep);
        extra.extend(&ids.current_file);
    }
    let extra_room = context.saturating_sub(batch + 2 * max_new);
    let extra_take = extra.len().min(extra_room);

    let mut out = Vec::with_capacity(extra_take + prefix_take + suffix_take + 3);
    out.extend(&extra[extra.len() - extra_take..]);
    out.push(tokens.prefix);
    out.extend(&ids.prefix[ids.prefix.len() - prefix_take..]);
    out.push(tokens.suffix);
    out.extend(&ids.suffix[..suffix_take]);
    out.push(tokens.middle);
    out.extend(&ids.middle_start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN: FimTokens = FimTokens {
        prefix: 1000,
        suffix: 1001,
        middle: 1002,
        pad: Some(1003),
        repo: Some(1004),
        file_sep: Some(1005),
    };

    fn ids(prefix: usize, suffix: usize) -> InfillIds {
        InfillIds {
            prefix: (0..prefix as u32).collect(),
            suffix: (500..500 + suffix as u32).collect(),
            repo_name: vec![7, 8],
            current_file: vec![9],
            snippet_separator: vec![6, 6],
            ..InfillIds::default()
        }
    }

    #[test]
    fn a_short_request_reads_repo_file_prefix_suffix_middle() {
        let mut request = ids(3, 2);
        request.extra = vec![(vec![20], vec![21, 22])];
        request.middle_start = vec![30];
        let prompt = assemble(&QWEN, &request, 4096, 64);
        assert_eq!(
            prompt,
            [1004, 7, 8, 1005, 20, 21, 22, 1005, 9, 1000, 0, 1, 2, 1001, 500, 501, 1002, 30]
        );
        assert_eq!(QWEN.stop_ids(), [1003, 1004, 1005]);
    }

    #[test]
    fn without_file_tokens_extra_files_are_snippets_and_no_headers_are_written() {
        let tokens = FimTokens {
            repo: None,
            file_sep: None,
            pad: None,
            ..QWEN
        };
        let mut request = ids(1, 1);
        request.extra = vec![(vec![20], vec![21])];
        let prompt = assemble(&tokens, &request, 4096, 64);
        assert_eq!(prompt, [6, 6, 21, 1000, 0, 1001, 500, 1002]);
        assert!(tokens.stop_ids().is_empty());
    }

    #[test]
    fn long_text_keeps_the_prefix_end_the_suffix_start_and_the_latest_context() {
        let mut request = ids(5000, 5000);
        request.middle_start = vec![30; 8];
        request.extra = vec![(vec![20], (0..10_000).map(|i| 40 + i % 3).collect())];
        let prompt = assemble(&QWEN, &request, 8192, 512);
        let pre = prompt.iter().position(|&t| t == 1000).unwrap();
        let suf = prompt.iter().position(|&t| t == 1001).unwrap();
        let mid = prompt.iter().position(|&t| t == 1002).unwrap();
        // 3/4 of the batch of prefix, its end; 2048/4 − 2 − 8 of suffix, its start.
        assert_eq!(suf - pre - 1, 1536);
        assert_eq!(prompt[suf - 1], 4999);
        assert_eq!(mid - suf - 1, 502);
        assert_eq!(prompt[suf + 1], 500);
        // Context beyond one batch and twice the output: 8192 − 2048 − 1024.
        assert_eq!(pre, 5120);
        assert_eq!(prompt[pre - 2..pre], [1005, 9]);
        assert_eq!(prompt.len(), 5120 + 1 + 1536 + 1 + 502 + 1 + 8);
    }

    #[test]
    fn a_small_context_shrinks_the_batch_with_it() {
        let prompt = assemble(&QWEN, &ids(500, 500), 256, 16);
        // batch 256: prefix 192, suffix 62, no room for context.
        assert_eq!(prompt.len(), 1 + 192 + 1 + 62 + 1);
        assert_eq!(prompt[0], 1000);
    }
}
