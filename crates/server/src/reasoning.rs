//! Reasoning models' thinking separated from their answer (`--reasoning-parser`, as vLLM
//! and SGLang do it): Qwen3 and DeepSeek-R1 write `<think>…</think>` before the answer. A
//! chat response then carries the thinking in `message.reasoning_content` (DeepSeek's and
//! SGLang's name) and `message.reasoning` (vLLM's newer one), streamed deltas alike, and
//! `content` is the answer alone (which is what tool calls are read from).
//!
//! Qwen3 thinks only when its answer opens with `<think>` (with `enable_thinking: false`
//! its template closes an empty block in the prompt); DeepSeek-R1 starts thinking at once,
//! its opening tag optional. Either way, a prompt whose text ends with `</think>` has
//! finished the thinking, and the whole answer is content.

const START: &str = "<think>";
const END: &str = "</think>";

/// Which reasoning format chat answers are read with (`--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningParser {
    /// The answer as written, thinking included.
    #[default]
    None,
    /// Thinking when the answer opens with `<think>` (Qwen3).
    Qwen3,
    /// Thinking from the start, to `</think>` (DeepSeek-R1 and its distills).
    DeepSeekR1,
}

impl std::str::FromStr for ReasoningParser {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qwen3" => Ok(Self::Qwen3),
            "deepseek_r1" | "deepseek-r1" => Ok(Self::DeepSeekR1),
            "none" => Ok(Self::None),
            other => Err(format!(
                "unknown reasoning parser `{other}` (expected qwen3, deepseek_r1 or none)"
            )),
        }
    }
}

/// How one chat request's answer is to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasoningStart {
    pub parser: ReasoningParser,
    /// The prompt already closed the thinking (its text ends with `</think>`).
    pub prompt_ended_thinking: bool,
    /// Return the thinking (vLLM's `include_reasoning`; off: it is only taken out of the
    /// content).
    pub shown: bool,
}

impl ReasoningStart {
    /// `None` when the server reads no reasoning.
    pub fn new(parser: ReasoningParser, prompt: &str, shown: bool) -> Option<Self> {
        (parser != ReasoningParser::None).then(|| Self {
            parser,
            prompt_ended_thinking: prompt.trim_end().ends_with(END),
            shown,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Qwen3, before the answer shows whether it opens with `<think>`.
    Undecided,
    /// In the thinking; `opening` while a leading `<think>` may still come (DeepSeek-R1).
    Thinking {
        opening: bool,
    },
    Answer,
}

/// One piece of an answer, split.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

/// Reads one choice's text as it arrives; a possible start of a tag is held back until
/// the next piece tells.
#[derive(Debug)]
pub struct ReasoningReader {
    mode: Mode,
    shown: bool,
    pending: String,
    /// Whether the answer had thinking at all (then an empty answer is `null`).
    thought: bool,
}

impl ReasoningReader {
    pub fn new(start: ReasoningStart) -> Self {
        let mode = match (start.prompt_ended_thinking, start.parser) {
            (true, _) | (false, ReasoningParser::None) => Mode::Answer,
            (false, ReasoningParser::Qwen3) => Mode::Undecided,
            (false, ReasoningParser::DeepSeekR1) => Mode::Thinking { opening: true },
        };
        Self {
            thought: matches!(mode, Mode::Thinking { .. }),
            mode,
            shown: start.shown,
            pending: String::new(),
        }
    }

    /// Whether the answer had thinking to show.
    pub fn thought(&self) -> bool {
        self.thought && self.shown
    }

    /// The next piece of text; `last` at the choice's end (nothing is held back then).
    pub fn push(&mut self, text: &str, last: bool) -> Split {
        let mut out = self.split(text, last);
        if !self.shown {
            out.reasoning.clear();
        }
        out
    }

    fn split(&mut self, text: &str, last: bool) -> Split {
        let mut out = Split::default();
        self.pending.push_str(text);
        loop {
            match self.mode {
                Mode::Undecided => {
                    let opened = self.pending.trim_start();
                    if let Some(rest) = opened.strip_prefix(START) {
                        self.pending = rest.to_string();
                        self.mode = Mode::Thinking { opening: false };
                        self.thought = true;
                    } else if START.starts_with(opened) && !last {
                        break;
                    } else {
                        self.mode = Mode::Answer;
                    }
                }
                Mode::Thinking { opening: true } => {
                    let opened = self.pending.trim_start();
                    if let Some(rest) = opened.strip_prefix(START) {
                        self.pending = rest.to_string();
                    } else if START.starts_with(opened) && !last {
                        break;
                    }
                    self.mode = Mode::Thinking { opening: false };
                }
                Mode::Thinking { opening: false } => {
                    if let Some(end) = self.pending.find(END) {
                        out.reasoning.push_str(&self.pending[..end]);
                        self.pending.drain(..end + END.len());
                        self.mode = Mode::Answer;
                        continue;
                    }
                    let keep = if last { 0 } else { partial_tag(&self.pending) };
                    let shown = self.pending.len() - keep;
                    out.reasoning.extend(self.pending.drain(..shown));
                    break;
                }
                Mode::Answer => {
                    out.content.push_str(&self.pending);
                    self.pending.clear();
                    break;
                }
            }
        }
        out
    }
}

/// The length of the longest end of `text` that `</think>` starts with (held back: the
/// tag may be arriving).
fn partial_tag(text: &str) -> usize {
    (1..END.len())
        .rev()
        .find(|&n| text.ends_with(&END[..n]))
        .unwrap_or(0)
}

/// A whole answer split: its thinking (`None` when it had none) and its content.
pub fn read_whole(start: ReasoningStart, text: &str) -> (Option<String>, String) {
    let mut reader = ReasoningReader::new(start);
    let split = reader.push(text, true);
    (reader.thought().then_some(split.reasoning), split.content)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(parser: ReasoningParser) -> ReasoningStart {
        ReasoningStart {
            parser,
            prompt_ended_thinking: false,
            shown: true,
        }
    }

    /// Every way of cutting `text` in two (and one piece a byte) streams to the whole split.
    fn streams_as_whole(s: ReasoningStart, text: &str) -> (Option<String>, String) {
        let whole = read_whole(s, text);
        let cuts: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &cut in &cuts {
            let mut r = ReasoningReader::new(s);
            let (mut reasoning, mut content) = (String::new(), String::new());
            for (piece, last) in [(&text[..cut], false), (&text[cut..], true)] {
                let split = r.push(piece, last);
                reasoning += &split.reasoning;
                content += &split.content;
            }
            assert_eq!(
                (r.thought().then_some(reasoning), content),
                whole,
                "cut at {cut}"
            );
        }
        let mut r = ReasoningReader::new(s);
        let mut content = String::new();
        for (i, w) in cuts.windows(2).enumerate() {
            content += &r.push(&text[w[0]..w[1]], i + 2 == cuts.len()).content;
        }
        assert_eq!(content, whole.1);
        whole
    }

    #[test]
    fn qwen3_thinks_only_when_the_answer_opens_with_the_tag() {
        let q = start(ReasoningParser::Qwen3);
        assert_eq!(
            streams_as_whole(q, "<think>\nLet me see.\n</think>\n\nIt is 4."),
            (Some("\nLet me see.\n".into()), "\n\nIt is 4.".into())
        );
        assert_eq!(streams_as_whole(q, "It is 4."), (None, "It is 4.".into()));
        // A tag later in the answer is text.
        assert_eq!(
            streams_as_whole(q, "Use <think> tags."),
            (None, "Use <think> tags.".into())
        );
        // Cut by max_tokens while thinking: all thinking, no answer.
        assert_eq!(
            streams_as_whole(q, "<think>hmm </thi"),
            (Some("hmm </thi".into()), String::new())
        );
        assert_eq!(streams_as_whole(q, "<thi"), (None, "<thi".into()));
        assert_eq!(streams_as_whole(q, ""), (None, String::new()));
    }

    #[test]
    fn deepseek_r1_thinks_from_the_start() {
        let d = start(ReasoningParser::DeepSeekR1);
        assert_eq!(
            streams_as_whole(d, "Hmm, 2+2.</think>4"),
            (Some("Hmm, 2+2.".into()), "4".into())
        );
        assert_eq!(
            streams_as_whole(d, "<think>Hmm.</think>4"),
            (Some("Hmm.".into()), "4".into())
        );
        assert_eq!(
            streams_as_whole(d, "no end"),
            (Some("no end".into()), String::new())
        );
    }

    #[test]
    fn a_prompt_that_closed_the_thinking_leaves_the_answer_alone() {
        for parser in [ReasoningParser::Qwen3, ReasoningParser::DeepSeekR1] {
            let s = ReasoningStart::new(
                parser,
                "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                true,
            )
            .unwrap();
            assert!(s.prompt_ended_thinking);
            assert_eq!(
                streams_as_whole(s, "<think>x</think>y"),
                (None, "<think>x</think>y".into())
            );
        }
        assert!(ReasoningStart::new(ReasoningParser::None, "", true).is_none());
    }

    #[test]
    fn thinking_not_shown_is_still_taken_out_of_the_answer() {
        let hidden = ReasoningStart {
            shown: false,
            ..start(ReasoningParser::Qwen3)
        };
        assert_eq!(
            streams_as_whole(hidden, "<think>hmm</think>4"),
            (None, "4".into())
        );
    }

    #[test]
    fn names_parse_as_vllm_spells_them() {
        assert_eq!("qwen3".parse(), Ok(ReasoningParser::Qwen3));
        assert_eq!("deepseek_r1".parse(), Ok(ReasoningParser::DeepSeekR1));
        assert_eq!("none".parse(), Ok(ReasoningParser::None));
        assert!("granite".parse::<ReasoningParser>().is_err());
    }
}
