//! The text of the fill-in-the-middle special tokens of the coder-model families llama.cpp
//! recognises: one table for the server (which finds them in the served tokenizer) and for
//! router training (which reads FIM prompts as text).

/// Each role's token text in the families llama.cpp recognises: Qwen2.5-Coder and
/// StarCoder2 style, StarCoder's, Code Llama's, DeepSeek-Coder's.
pub const PREFIX: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<PRE>",
    "▁<PRE>",
    "<｜fim▁begin｜>",
];
pub const SUFFIX: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<SUF>",
    "▁<SUF>",
    "<｜fim▁hole｜>",
];
pub const MIDDLE: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<MID>",
    "▁<MID>",
    "<｜fim▁end｜>",
];
pub const PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"];
pub const REPO: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
pub const FILE_SEP: &[&str] = &["<|file_sep|>", "<file_sep>", "<fim-sep>"];
