//! Prompt loading: built-in sets by name or a JSON array / JSONL file of `{"prompt": ...}` or
//! `{"messages": [...]}` objects, and conversion of a prompt into a request body.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::args::{BenchArgs, BenchError, Endpoint};
use crate::builtin;

/// One prompt of the dataset.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Plain text (sent as one user message on the chat endpoint).
    Text(String),
    /// Chat messages (`[{"role": ..., "content": ...}]`); on the completions endpoint their contents
    /// are joined with blank lines.
    Messages(Vec<Value>),
}

/// Loads `--dataset`: an existing file first, else a built-in set name.
pub fn load(spec: &str) -> Result<Vec<Prompt>, BenchError> {
    let path = Path::new(spec);
    let prompts = if path.is_file() {
        load_file(path)?
    } else {
        match spec {
            "math" => builtin::MATH
                .iter()
                .map(|s| Prompt::Text(s.to_string()))
                .collect(),
            "code" => builtin::CODE
                .iter()
                .map(|s| Prompt::Text(s.to_string()))
                .collect(),
            "long" => builtin::long_prompts()
                .into_iter()
                .map(Prompt::Text)
                .collect(),
            _ => {
                return Err(BenchError::Dataset {
                    path: PathBuf::from(spec),
                    reason: "no such file, and not a built-in set (math, code, long)".into(),
                })
            }
        }
    };
    if prompts.is_empty() {
        return Err(BenchError::EmptyDataset);
    }
    Ok(prompts)
}

fn load_file(path: &Path) -> Result<Vec<Prompt>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::DatasetIo {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |reason: String| BenchError::Dataset {
        path: path.to_path_buf(),
        reason,
    };
    let values: Vec<Value> = if text.trim_start().starts_with('[') {
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON array: {e}")))?
    } else {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| serde_json::from_str(l).map_err(|e| bad(format!("line {}: {e}", i + 1))))
            .collect::<Result<_, _>>()?
    };
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| prompt_of(v).map_err(|r| bad(format!("entry {}: {r}", i + 1))))
        .collect()
}

fn prompt_of(v: Value) -> Result<Prompt, String> {
    match v {
        Value::String(s) => Ok(Prompt::Text(s)),
        Value::Object(mut o) => {
            if let Some(m) = o.remove("messages") {
                match m {
                    Value::Array(list) if !list.is_empty() => Ok(Prompt::Messages(list)),
                    _ => Err("`messages` must be a non-empty array".into()),
                }
            } else if let Some(p) = o.remove("prompt") {
                match p {
                    Value::String(s) => Ok(Prompt::Text(s)),
                    _ => Err("`prompt` must be a string".into()),
                }
            } else {
                Err("expected a `prompt` or `messages` field".into())
            }
        }
        _ => Err("expected an object or a string".into()),
    }
}

impl Prompt {
    fn as_messages(&self) -> Value {
        match self {
            Prompt::Text(s) => json!([{"role": "user", "content": s}]),
            Prompt::Messages(m) => Value::Array(m.clone()),
        }
    }

    fn as_text(&self) -> String {
        match self {
            Prompt::Text(s) => s.clone(),
            Prompt::Messages(m) => m
                .iter()
                .filter_map(|msg| msg.get("content").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n\n"),
        }
    }

    /// Streaming request body for this prompt, as request number `index` of the run.
    pub fn body(&self, args: &BenchArgs, model: &str, index: u64) -> Value {
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        match args.endpoint {
            Endpoint::Chat => body.insert("messages".into(), self.as_messages()),
            Endpoint::Completions => body.insert("prompt".into(), json!(self.as_text())),
        };
        body.insert("max_tokens".into(), json!(args.max_tokens));
        body.insert("stream".into(), json!(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
        if let Some(t) = args.temperature {
            body.insert("temperature".into(), json!(t));
        }
        if let Some(s) = args.seed {
            // Distinct per request (same across runs): one shared seed would make seeded
            // routing policies route every concurrent request at the same positions.
            body.insert("seed".into(), json!(s.wrapping_add(index)));
        }
        if args.ignore_eos {
            body.insert("ignore_eos".into(), json!(true));
        }
        for (key, value) in args.extra_body.iter().flatten() {
            body.insert(key.clone(), value.clone());
        }
        Value::Object(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn builtin_sets_have_sixteen_prompts() {
        for name in ["math", "code", "long"] {
            assert_eq!(load(name).expect(name).len(), 16);
        }
        assert!(matches!(load("nope"), Err(BenchError::Dataset { .. })));
    }

    #[test]
    fn json_array_and_jsonl_files_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let arr = dir.path().join("a.json");
        std::fs::write(
            &arr,
            r#"[{"prompt": "hi"}, {"messages": [{"role": "user", "content": "yo"}]}, "raw"]"#,
        )
        .expect("write");
        let p = load(arr.to_str().expect("utf8")).expect("load");
        assert_eq!(p.len(), 3);
        assert_eq!(p[0], Prompt::Text("hi".into()));
        assert!(matches!(&p[1], Prompt::Messages(m) if m.len() == 1));

        let jl = dir.path().join("b.jsonl");
        let mut f = std::fs::File::create(&jl).expect("create");
        writeln!(f, "{{\"prompt\": \"one\"}}\n\n{{\"prompt\": \"two\"}}").expect("write");
        assert_eq!(load(jl.to_str().expect("utf8")).expect("load").len(), 2);

        std::fs::write(&jl, "{\"prompt\": \"one\"}\n{\"text\": 3}\n").expect("write");
        let err = load(jl.to_str().expect("utf8")).expect_err("bad entry");
        assert!(err.to_string().contains("entry 2"), "{err}");
        std::fs::write(&jl, "[]").expect("write");
        assert!(matches!(
            load(jl.to_str().expect("utf8")),
            Err(BenchError::EmptyDataset)
        ));
    }

    #[test]
    fn bodies_stream_with_usage_and_optional_fields() {
        let mut args = BenchArgs::from_flags(["--max-tokens", "9", "--ignore-eos", "--seed", "3"])
            .expect("flags");
        let b = Prompt::Text("q".into()).body(&args, "m", 0);
        assert_eq!(b["messages"][0]["content"], "q");
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["max_tokens"], 9);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["seed"], 3);
        assert!(b.get("temperature").is_none());
        args.endpoint = Endpoint::Completions;
        args.ignore_eos = false;
        let msgs = Prompt::Messages(vec![
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": "u"}),
        ]);
        let b = msgs.body(&args, "m", 2);
        assert_eq!(b["prompt"], "s\n\nu");
        assert!(b.get("ignore_eos").is_none());
    }

    #[test]
    fn an_extra_body_is_merged_over_the_benchmarks_fields() {
        let args = BenchArgs::from_flags([
            "--max-tokens",
            "9",
            "--extra-body",
            r#"{"response_format": {"type": "json_object"}, "max_tokens": 5}"#,
        ])
        .expect("flags");
        let b = Prompt::Text("q".into()).body(&args, "m", 0);
        assert_eq!(b["response_format"]["type"], "json_object");
        assert_eq!(b["max_tokens"], 5);
        assert_eq!(b["stream"], true);
        for bad in ["[1]", "{nope", "3"] {
            let err = BenchArgs::from_flags(["--extra-body", bad]).unwrap_err();
            assert!(err.to_string().contains("--extra-body"), "{err}");
        }
    }
}
