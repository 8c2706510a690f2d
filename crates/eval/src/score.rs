//! Turning a completion into a verdict: code extraction from an instruction model's answer
//! (fenced block, possibly cut by the stop string), the program a test scorer runs, and
//! the text scorers (exact match, `\boxed{}` numeric match).

use crate::dataset::Scorer;

/// The code of an answer: the first fenced block (```` ```python ```` or bare ```` ``` ````;
/// an unterminated block runs to the end, as the stop string cuts the closing fence), else
/// the whole answer when it looks like code. `None`: nothing extractable.
pub fn extract_code(answer: &str) -> Option<String> {
    if let Some(start) = answer.find("```") {
        let after = &answer[start + 3..];
        // The info string (language tag) runs to the end of the fence's line.
        let body = match after.find('\n') {
            Some(nl) => &after[nl + 1..],
            None => "",
        };
        let code = match body.find("```") {
            Some(end) => &body[..end],
            None => body,
        };
        let code = code.trim_end();
        return (!code.trim().is_empty()).then(|| format!("{code}\n"));
    }
    let looks_like_code = answer.lines().any(|l| {
        let t = l.trim_start();
        t.starts_with("def ") || t.starts_with("return") || t.starts_with("import ")
    });
    looks_like_code.then(|| format!("{}\n", answer.trim_end()))
}

/// The Python program a test scorer runs. When the code defines the entry point it follows
/// the prefix (HumanEval's prompt: a stub whose body is its docstring, so it is valid Python
/// and brings the imports and helpers the completion may rely on) and replaces the stub;
/// otherwise the code is taken as the stub's body and appended to the prefix.
pub fn program(prefix: &str, code: &str, test: &str, entry_point: Option<&str>) -> String {
    let defines_entry = entry_point.is_some_and(|e| {
        code.lines()
            .any(|l| l.trim_start().starts_with(&format!("def {e}(")))
    });
    let body = if defines_entry || entry_point.is_none() {
        format!("{prefix}\n{code}")
    } else {
        format!("{prefix}{code}")
    };
    let check = entry_point.map_or(String::new(), |e| format!("\ncheck({e})\n"));
    format!("{body}\n\n{test}\n{check}")
}

/// The Python program an infill scorer runs: the answer as written between the prefix and
/// the suffix, then the test and its check.
pub fn infill_program(
    prefix: &str,
    middle: &str,
    suffix: &str,
    test: &str,
    entry_point: Option<&str>,
) -> String {
    let check = entry_point.map_or(String::new(), |e| format!("check({e})\n"));
    format!("{prefix}{middle}{suffix}\n\n{test}\n{check}")
}

/// Score a text answer (exact or boxed); `None` for program scorers (those need a process).
pub fn score_text(scorer: &Scorer, answer: &str) -> Option<bool> {
    match scorer {
        Scorer::Exact { answer: want } => Some(normalise(answer) == normalise(want)),
        Scorer::Boxed { answer: want } => {
            Some(last_boxed(answer).is_some_and(|got| same_answer(&got, want)))
        }
        Scorer::Program { .. } | Scorer::Infill { .. } => None,
    }
}

fn normalise(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Content of the last `\boxed{...}` (braces balanced).
pub fn last_boxed(text: &str) -> Option<String> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..start + i].trim().to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// Numbers compare with a relative tolerance of 1e-6 (`1,000`, `$5`, `3/4`, `\frac{3}{4}`
/// understood); anything else compares as whitespace-free text.
fn same_answer(got: &str, want: &str) -> bool {
    match (number(got), number(want)) {
        (Some(a), Some(b)) => (a - b).abs() <= 1e-6 * b.abs().max(1.0),
        _ => got.replace(char::is_whitespace, "") == want.replace(char::is_whitespace, ""),
    }
}

fn number(s: &str) -> Option<f64> {
    let s: String = s
        .chars()
        .filter(|c| !c.is_whitespace() && !matches!(c, '$' | ','))
        .collect();
    let s = s
        .trim_end_matches('.')
        .trim_end_matches("\\%")
        .trim_end_matches('%');
    if let Some(rest) = s
        .strip_prefix("\\frac{")
        .or_else(|| s.strip_prefix("\\dfrac{"))
    {
        let (num, den) = rest.strip_suffix('}')?.split_once("}{")?;
        return Some(num.parse::<f64>().ok()? / den.parse::<f64>().ok()?);
    }
    if let Some((a, b)) = s.split_once('/') {
        return Some(a.parse::<f64>().ok()? / b.parse::<f64>().ok()?);
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_fenced_unterminated_and_bare_code() {
        let a = "Here you go:\n\n```python\ndef f():\n    return 1\n```\n\nExplanation.";
        assert_eq!(extract_code(a).as_deref(), Some("def f():\n    return 1\n"));
        // Cut by the stop string: no closing fence.
        let b = "```python\nimport math\ndef f():\n    return math.pi";
        assert_eq!(
            extract_code(b).as_deref(),
            Some("import math\ndef f():\n    return math.pi\n")
        );
        assert_eq!(extract_code("```\nx = 1\n```").as_deref(), Some("x = 1\n"));
        assert_eq!(
            extract_code("def g(x):\n    return x").as_deref(),
            Some("def g(x):\n    return x\n")
        );
        assert_eq!(extract_code("I cannot help with that."), None);
        assert_eq!(extract_code("```python\n```"), None);
        assert_eq!(extract_code("```"), None);
    }

    #[test]
    fn program_replaces_the_stub_or_fills_its_body() {
        let prefix =
            "from typing import List\n\ndef f(x: List[int]) -> int:\n    \"\"\"doc\"\"\"\n";
        let test = "def check(c):\n    assert c([1]) == 1";
        let whole = program(prefix, "def f(x):\n    return x[0]\n", test, Some("f"));
        assert!(whole.starts_with(prefix) && whole.ends_with("check(f)\n"));
        assert!(whole.contains("\ndef f(x):\n    return x[0]"));
        let body = program(prefix, "    return x[0]\n", test, Some("f"));
        assert!(body.contains("\"\"\"doc\"\"\"\n    return x[0]"));
        let free = program("", "x = 1\n", "assert x == 1", None);
        assert!(!free.contains("check("));
    }

    #[test]
    fn text_scorers() {
        let exact = Scorer::Exact {
            answer: "Paris".into(),
        };
        assert_eq!(score_text(&exact, "  Paris \n"), Some(true));
        assert_eq!(score_text(&exact, "paris"), Some(false));
        let boxed = Scorer::Boxed {
            answer: "0.75".into(),
        };
        assert_eq!(score_text(&boxed, "so \\boxed{\\frac{3}{4}}"), Some(true));
        assert_eq!(
            score_text(&boxed, "\\boxed{1} then \\boxed{3/4}"),
            Some(true)
        );
        assert_eq!(score_text(&boxed, "\\boxed{0.7}"), Some(false));
        assert_eq!(score_text(&boxed, "no box"), Some(false));
        let thousands = Scorer::Boxed {
            answer: "1000".into(),
        };
        assert_eq!(score_text(&thousands, "\\boxed{1,000}"), Some(true));
        assert_eq!(score_text(&thousands, "\\boxed{$1000$}"), Some(true));
        let text = Scorer::Boxed {
            answer: "x^2".into(),
        };
        assert_eq!(score_text(&text, "\\boxed{x ^ 2}"), Some(true));
        assert_eq!(last_boxed("\\boxed{a{b}c}"), Some("a{b}c".into()));
        assert_eq!(last_boxed("\\boxed{open"), None);
    }
}
