//! Step 3 of R2R's labelling: does a disagreement matter? Three judges. `code` and
//! `exact` need no model: `code` compares the code the two continuations write (what a
//! code benchmark runs), `exact` their text (the same text means the two tokens only
//! split it differently). `model` asks an LLM behind any OpenAI-compatible chat endpoint (R2R used
//! Qwen2.5-72B-Instruct; `tokenrouter serve`, vLLM, SGLang or llama.cpp's server all do)
//! whether the two continuations differ in meaning or behaviour, greedy, one digit back.

use crate::diverge::Point;
use crate::prompts::Prompt;
use crate::{Result, TrainError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokenrouter_api::fim_markers;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum JudgeKind {
    Code,
    Exact,
    Model,
}

impl JudgeKind {
    pub fn name(self) -> &'static str {
        match self {
            JudgeKind::Code => "code",
            JudgeKind::Exact => "exact",
            JudgeKind::Model => "model",
        }
    }

    /// What a shard's verdicts record: the judge, and for an LLM which model (another
    /// verifier re-judges).
    pub fn label(self, v: &Verifier) -> String {
        match self {
            JudgeKind::Model => format!("model:{}", v.verifier_model),
            // Versioned: verdicts of an earlier code judge (v1 read indentation as spacing)
            // are judged again from their stored continuations.
            JudgeKind::Code => format!("code:{CODE_JUDGE_VERSION}"),
            JudgeKind::Exact => self.name().to_string(),
        }
    }
}

/// The code judge's version, recorded with its verdicts (2: indentation is code).
pub const CODE_JUDGE_VERSION: u32 = 2;

/// The LLM judge's endpoint (`--judge model`).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Verifier {
    /// Base URL of an OpenAI-compatible server (`http://host:port` or `…/v1`).
    #[arg(long)]
    pub verifier_url: Option<String>,
    /// The `model` field sent.
    #[arg(long, default_value = "default")]
    pub verifier_model: String,
    /// Bearer token, if the server wants one.
    #[arg(long, env = "TOKENROUTER_VERIFIER_KEY")]
    pub verifier_key: Option<String>,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub verifier_concurrency: usize,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 300)]
    pub verifier_timeout: u64,
}

impl Verifier {
    pub fn check(&self) -> Result<()> {
        if self.verifier_url.is_none() {
            return Err(TrainError::Input(
                "--judge model needs --verifier-url (an OpenAI-compatible server)".into(),
            ));
        }
        if self.verifier_concurrency == 0 {
            return Err(TrainError::Input(
                "--verifier-concurrency must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn endpoint(&self) -> Result<String> {
        let base = self
            .verifier_url
            .as_deref()
            .ok_or_else(|| TrainError::Input("--judge model needs --verifier-url".into()))?
            .trim_end_matches('/');
        Ok(if base.ends_with("/v1") {
            format!("{base}/chat/completions")
        } else {
            format!("{base}/v1/chat/completions")
        })
    }
}

/// Label every complete point with the judge; incomplete points stay unjudged. `prompts`
/// are the label run's prompts: a raw prompt's code before the answer (a fill-in-the-middle
/// prefix, or the text the answer continues) is read by the code judge too, so brackets
/// and strings it opened are known.
pub fn judge_all(
    kind: JudgeKind,
    v: &Verifier,
    points: &mut [Point],
    prompts: &[Prompt],
) -> Result<()> {
    for p in points.iter_mut() {
        p.divergent = None;
    }
    match kind {
        JudgeKind::Exact => {
            for p in points.iter_mut().filter(|p| p.complete) {
                p.divergent = Some(p.branch != p.reference);
            }
            Ok(())
        }
        JudgeKind::Code => {
            for p in points.iter_mut().filter(|p| p.complete) {
                let lead = match prompts.get(p.prompt as usize) {
                    Some(Prompt::Raw(text)) => code_before_answer(text),
                    _ => "",
                };
                let context = format!("{lead}{}", p.code_before);
                p.divergent = Some(p.in_code && code_differs(&context, &p.branch, &p.reference));
            }
            Ok(())
        }
        JudgeKind::Model => judge_by_model(v, points),
    }
}

/// Whether two continuations of `context` write different code: their tokens after the
/// context, with comments, triple-quoted strings (docstrings) and spacing left out, and
/// code after a closing fence ignored, differ where both have written something (or only
/// one has written any).
pub fn code_differs(context: &str, a: &str, b: &str) -> bool {
    let (ta, tb) = (code_after(context, a), code_after(context, b));
    if ta.is_empty() != tb.is_empty() {
        // One writes code where the other has written none yet: nothing says they agree.
        return true;
    }
    let n = ta.len().min(tb.len());
    ta[..n] != tb[..n]
}

/// The code a raw prompt puts right before its answer: a fill-in-the-middle prompt's prefix
/// (the marker families llama.cpp knows, prefix-suffix-middle order), else the whole text,
/// which the answer continues.
pub fn code_before_answer(prompt: &str) -> &str {
    for (prefix, suffix) in fim_markers::PREFIX.iter().zip(fim_markers::SUFFIX) {
        if let Some(at) = prompt.rfind(prefix) {
            let rest = &prompt[at + prefix.len()..];
            return rest.find(suffix).map_or(rest, |end| &rest[..end]);
        }
    }
    prompt
}

/// Python-like tokens of `context + tail` that end inside `tail` (so a comment or string
/// begun in the context is read as one). A line's indentation is a token before its first
/// code token, outside brackets: in Python it is syntax (`    elif` and `        elif` are
/// different programs), unlike the spacing inside a line.
fn code_after(context: &str, tail: &str) -> Vec<String> {
    let s = format!("{context}{tail}");
    let start = context.len();
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line_start = true;
    let mut line_begin = 0;
    let mut depth = 0usize;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line_start = true;
            i += 1;
            line_begin = i;
            continue;
        }
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let at_line_start = std::mem::replace(&mut line_start, false);
        let t0 = i;
        // The indentation, pushed with the line's first token if that is code.
        let indent = (at_line_start && depth == 0).then(|| indent_width(&b[line_begin..t0]));
        if at_line_start && s[i..].starts_with("```") {
            if i >= start {
                break;
            }
            i = s[i..].find('\n').map_or(b.len(), |k| i + k);
            continue;
        }
        if c == b'#' {
            i = s[i..].find('\n').map_or(b.len(), |k| i + k);
            continue;
        }
        if s[i..].starts_with("\"\"\"") || s[i..].starts_with("'''") {
            let q = &s[i..i + 3];
            i = s[i + 3..].find(q).map_or(b.len(), |k| i + 3 + k + 3);
            continue;
        }
        if c == b'"' || c == b'\'' {
            i += 1;
            while i < b.len() && b[i] != c && b[i] != b'\n' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
        } else if c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80 {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] >= 0x80) {
                i += 1;
            }
        } else {
            i += 1;
        }
        match c {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if i > start {
            if let Some(width) = indent {
                out.push(format!("\u{0}indent {width}"));
            }
            out.push(String::from_utf8_lossy(&b[t0..i.min(b.len())]).into_owned());
        }
    }
    out
}

/// Columns of a line's leading whitespace, a tab to the next multiple of 8 (as Python
/// reads it).
fn indent_width(lead: &[u8]) -> usize {
    lead.iter()
        .fold(0, |w, &c| if c == b'\t' { (w / 8 + 1) * 8 } else { w + 1 })
}

const SYSTEM: &str =
    "You compare two continuations of the same text and say whether their difference matters.";

/// The judge's question: R2R's task (does the divergence change meaning, reasoning, logic
/// or conclusions?) asked for code and prose, the answer first so one token decides.
pub fn question(p: &Point) -> String {
    let a = marked(&p.small_text, &p.branch);
    let b = marked(&p.large_text, &p.reference);
    format!(
        "Two writers continued the same text. From the point marked << >> on, they wrote different things (the marks are not part of the text).\n\
         Answer 1 if the difference matters: it changes what the code does or computes, the names or values used, the approach, or the meaning, facts or conclusions of the prose.\n\
         Answer 0 if it is superficial: the same behaviour and meaning written differently (formatting, spacing, wording, an equivalent spelling).\n\
         Reply with the single digit.\n\n\
         Text before the point:\n\"\"\"\n{}\n\"\"\"\n\n\
         Continuation 1:\n\"\"\"\n{a}\n\"\"\"\n\n\
         Continuation 2:\n\"\"\"\n{b}\n\"\"\"\n\n\
         Answer (0 or 1):",
        p.context
    )
}

/// `<<first>>rest` when the continuation starts with its first token's text.
fn marked(first: &str, whole: &str) -> String {
    match whole.strip_prefix(first) {
        Some(rest) => format!("<<{first}>>{rest}"),
        None => format!("<<>>{whole}"),
    }
}

/// The verdict in a reply: the digit after "answer"/"output" if there is one, else the
/// first 0 or 1 on its own; `None` when there is none.
pub fn parse_verdict(reply: &str) -> Option<bool> {
    let lower = reply.to_ascii_lowercase();
    for key in ["answer", "output"] {
        if let Some(i) = lower.find(key) {
            if let Some(d) = lower[i + key.len()..].chars().find(|c| c.is_ascii_digit()) {
                return digit(d);
            }
        }
    }
    let bytes = lower.as_bytes();
    (0..bytes.len())
        .find(|&i| {
            bytes[i].is_ascii_digit()
                && (i == 0 || !bytes[i - 1].is_ascii_alphanumeric())
                && bytes.get(i + 1).is_none_or(|c| !c.is_ascii_alphanumeric())
        })
        .and_then(|i| digit(bytes[i] as char))
}

fn digit(c: char) -> Option<bool> {
    match c {
        '0' => Some(false),
        '1' => Some(true),
        _ => None,
    }
}

fn judge_by_model(v: &Verifier, points: &mut [Point]) -> Result<()> {
    v.check()?;
    let url = v.endpoint()?;
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(v.verifier_timeout))
        .build();
    let todo: Vec<usize> = (0..points.len()).filter(|&i| points[i].complete).collect();
    let questions: Vec<String> = todo.iter().map(|&i| question(&points[i])).collect();
    let next = AtomicUsize::new(0);
    let verdicts: Mutex<Vec<(usize, Option<bool>)>> = Mutex::new(Vec::new());
    let failure: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..v.verifier_concurrency.min(todo.len().max(1)) {
            s.spawn(|| loop {
                if failure.lock().map(|f| f.is_some()).unwrap_or(true) {
                    return;
                }
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(q) = questions.get(k) else {
                    return;
                };
                match ask(&agent, &url, v, q) {
                    Ok(reply) => {
                        if let Ok(mut out) = verdicts.lock() {
                            out.push((todo[k], parse_verdict(&reply)));
                        }
                    }
                    Err(e) => {
                        if let Ok(mut f) = failure.lock() {
                            f.get_or_insert(e);
                        }
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(TrainError::Input(format!("the verifier at {url}: {e}")));
    }
    let verdicts = verdicts
        .into_inner()
        .map_err(|_| TrainError::Input("a verifier thread panicked".into()))?;
    for (i, d) in verdicts {
        points[i].divergent = d;
    }
    Ok(())
}

fn ask(
    agent: &ureq::Agent,
    url: &str,
    v: &Verifier,
    q: &str,
) -> std::result::Result<String, String> {
    let body = serde_json::json!({
        "model": v.verifier_model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": q},
        ],
        "temperature": 0,
        "max_tokens": 8,
    });
    let mut req = agent.post(url).set("Content-Type", "application/json");
    if let Some(key) = &v.verifier_key {
        req = req.set("Authorization", &format!("Bearer {key}"));
    }
    let reply = match req.send_string(&body.to_string()) {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            let text = r.into_string().unwrap_or_default();
            return Err(format!(
                "HTTP {code}: {}",
                text.chars().take(300).collect::<String>()
            ));
        }
        Err(e) => return Err(e.to_string()),
    };
    let text = reply.into_string().map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
    v.pointer("/choices/0/message/content")
        .and_then(|c| c.as_str())
        .map(str::to_string)
        .ok_or_else(|| format!("no choices[0].message.content in {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(branch: &str, reference: &str) -> Point {
        Point {
            prompt: 0,
            position: 3,
            small_token: 1,
            large_token: 2,
            context: "def f(x):\n".into(),
            small_text: "    return".into(),
            branch: branch.into(),
            large_text: "   ".into(),
            reference: reference.into(),
            in_code: true,
            code_before: "def f(x):\n    \"\"\"Doc.\n\n    More.\n    \"\"\"\n".into(),
            complete: true,
            divergent: None,
        }
    }

    #[test]
    fn verdicts_are_read_as_r2r_reads_them() {
        assert_eq!(parse_verdict("1"), Some(true));
        assert_eq!(parse_verdict("0"), Some(false));
        assert_eq!(parse_verdict(" 0\nReasoning: the same"), Some(false));
        assert_eq!(parse_verdict("Output: 1"), Some(true));
        assert_eq!(parse_verdict("Answer (0 or 1): 0"), Some(false));
        assert_eq!(parse_verdict("The answer is 1."), Some(true));
        assert_eq!(parse_verdict("x1 y2"), None);
        assert_eq!(parse_verdict("2"), None);
        assert_eq!(parse_verdict("I cannot tell"), None);
    }

    #[test]
    fn the_exact_judge_sees_only_different_text() {
        let mut ps = vec![
            point("    return x\n", "    return x\n"),
            point("    return x\n", "    return y\n"),
            point("    return x", "    return x"),
        ];
        ps[2].complete = false;
        judge_all(JudgeKind::Exact, &Verifier::default(), &mut ps, &[]).unwrap();
        let got: Vec<_> = ps.iter().map(|p| p.divergent).collect();
        assert_eq!(got, vec![Some(false), Some(true), None]);
    }

    #[test]
    fn the_code_judge_compares_code_only() {
        let ctx = "def f(x):\n    # Find the";
        // Different comment words, the same code after them.
        assert!(!code_differs(
            ctx,
            " largest\n    return max(x)\n",
            " biggest one\n    return max(x)\n"
        ));
        assert!(code_differs(
            ctx,
            " largest\n    return max(x)\n",
            " largest\n    return min(x)\n"
        ));
        let ctx = "def f(x):\n   ";
        // A comment line before the same statement; spacing inside a line.
        assert!(!code_differs(
            ctx,
            " # make it\n    d = D()\n",
            " d = D()\n    d.run()\n"
        ));
        assert!(!code_differs(ctx, " y = a+b\n", " y = a + b\n"));
        // Indentation is syntax: another block level is other code, also when the line
        // begun in the context; inside brackets it is layout.
        let ctx = "    if a:\n        x()\n";
        assert!(code_differs(ctx, "    elif b:\n", "        elif b:\n"));
        assert!(code_differs("    if a:\n   ", " y()\n", "     y()\n"));
        assert!(!code_differs("    if a:\n   ", " y()\n", " y()\n"));
        assert!(!code_differs(
            "    f(a,\n",
            "      b)\n    g()\n",
            "            b)\n    g()\n"
        ));
        assert!(code_differs(ctx, "\tz()\n", "    z()\n"));
        assert!(!code_differs(ctx, "\tz()\n", "        z()\n"));
        assert!(code_differs(ctx, " y = a+b\n", " y = a - b\n"));
        // Strings are code; docstrings are not.
        assert!(code_differs(
            ctx,
            " raise E(\"user\")\n",
            " raise E(\"User\")\n"
        ));
        assert!(!code_differs(
            ctx,
            " \"\"\"Sum.\"\"\"\n    return 1\n",
            " \"\"\"Add.\"\"\"\n    return 1\n"
        ));
        // A string begun in the context; a split identifier.
        assert!(code_differs("    s = \"ab", "c\"\n", "d\"\n"));
        assert!(code_differs("    get", "_value()\n", "Value()\n"));
        // Code after the closing fence does not count.
        assert!(!code_differs(
            "    return x\n",
            "```\nx = 1\n",
            "```\nThe function\n"
        ));
        let mut ps = vec![
            point(" return x\n", " return y\n"),
            point(" return x\n", " return y\n"),
        ];
        ps[1].in_code = false;
        judge_all(JudgeKind::Code, &Verifier::default(), &mut ps, &[]).unwrap();
        assert_eq!(ps[0].divergent, Some(true));
        assert_eq!(ps[1].divergent, Some(false), "prose is not code");
    }

    /// A fill-in-the-middle prompt's prefix is the code before the answer: a bracket it
    /// opened makes the answer's line breaks layout, not indentation.
    #[test]
    fn the_code_judge_reads_a_raw_prompts_code() {
        let fim = "<|fim_prefix|>def f(a):\n    return g(a,<|fim_suffix|>)\n<|fim_middle|>";
        assert_eq!(code_before_answer(fim), "def f(a):\n    return g(a,");
        assert_eq!(code_before_answer("x = (1,"), "x = (1,");
        let mut p = point("\n             b, c", "\n    b, c");
        p.code_before = String::new();
        let mut ps = [p.clone(), p];
        let prompts = [Prompt::Raw(fim.into())];
        judge_all(
            JudgeKind::Code,
            &Verifier::default(),
            &mut ps[..1],
            &prompts,
        )
        .unwrap();
        judge_all(JudgeKind::Code, &Verifier::default(), &mut ps[1..], &[]).unwrap();
        assert_eq!(ps[0].divergent, Some(false), "inside g( the layout is free");
        assert_eq!(
            ps[1].divergent,
            Some(true),
            "without the prompt: another indentation"
        );
    }

    #[test]
    fn the_question_marks_both_divergent_tokens() {
        let q = question(&point("    return x\n", "    return y\n"));
        assert!(q.contains("<<    return>> x\n"), "{q}");
        assert!(q.contains("<<   >> return y\n"), "{q}");
        assert!(q.contains("def f(x):"), "{q}");
        assert_eq!(marked("a", "bc"), "<<>>bc");
    }

    #[test]
    fn a_model_judge_needs_an_endpoint() {
        let e = judge_all(
            JudgeKind::Model,
            &Verifier::default(),
            &mut [point("a", "b")],
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--verifier-url"), "{e}");
        let v = Verifier {
            verifier_url: Some("http://h:1/v1/".into()),
            ..Default::default()
        };
        assert_eq!(v.endpoint().unwrap(), "http://h:1/v1/chat/completions");
        let v = Verifier {
            verifier_url: Some("http://h:1".into()),
            ..Default::default()
        };
        assert_eq!(v.endpoint().unwrap(), "http://h:1/v1/chat/completions");
    }
}
