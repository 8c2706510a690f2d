//! Prompt sets for labelling: a JSONL file of prompts or chat messages, rendered into
//! token ids with the small model's chat template; and an offline generator that turns the
//! documented functions of the local Python standard library (signature + docstring) into
//! "complete this function" tasks — a real prompt source that is not an evaluation set.

use crate::{Result, TrainError};
use std::io::Write;
use std::path::{Path, PathBuf};
use tokenrouter_runtime::{Message, TextModel};

/// One prompt: chat messages (rendered with the template) or raw text.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Chat(Vec<Message>),
    Raw(String),
}

/// Read a prompt JSONL: each line `{"prompt": "..."}` (one user turn, or raw text with
/// `raw`), `{"messages": [{"role": ..., "content": ...}, ...]}` or `{"text": "..."}` (raw).
pub fn read_prompts(path: &Path, raw: bool) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::file(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |m: &str| TrainError::file(path, format!("line {}: {m}", i + 1));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(&format!("not JSON: {e}")))?;
        if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
            out.push(if raw {
                Prompt::Raw(p.to_string())
            } else {
                Prompt::Chat(vec![Message::new("user", p)])
            });
        } else if let Some(t) = v.get("text").and_then(|p| p.as_str()) {
            out.push(Prompt::Raw(t.to_string()));
        } else if let Some(m) = v.get("messages") {
            let msgs: Vec<Message> =
                serde_json::from_value(m.clone()).map_err(|e| at(&format!("`messages`: {e}")))?;
            if msgs.is_empty() {
                return Err(at("`messages` is empty"));
            }
            out.push(Prompt::Chat(msgs));
        } else {
            return Err(at("expected a `prompt`, `messages` or `text` field"));
        }
    }
    if out.is_empty() {
        return Err(TrainError::file(path, "holds no prompts"));
    }
    Ok(out)
}

/// Token ids of a prompt as the server would send them to the model.
pub fn encode(prompt: &Prompt, text: &TextModel) -> Result<Vec<u32>> {
    let s = match prompt {
        Prompt::Raw(s) => s.clone(),
        Prompt::Chat(m) => match text.chat_template() {
            Some(_) => text.apply_chat_template(m, true, &serde_json::Value::Null)?,
            // A model without a template (tiny test models): the contents, one per line.
            None => m
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        },
    };
    Ok(text.encode(&s)?)
}

/// `tokenrouter train-router prompts`
#[derive(clap::Args, Clone, Debug)]
pub struct PromptsArgs {
    /// Where to write the JSONL.
    #[arg(long)]
    pub out: PathBuf,
    /// Most prompts to write (a fixed order, round-robin over modules).
    #[arg(long, default_value_t = 2000)]
    pub limit: usize,
    /// The Python interpreter whose standard library is read.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Fill-in-the-middle tasks instead: each function's source with one line of its body
    /// left out, as raw prompts in the Qwen2.5-Coder / StarCoder2 layout
    /// (`<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`), for routers that will serve editors.
    #[arg(long)]
    pub fim: bool,
}

/// Lists public, documented, pure-Python functions of some standard-library modules as
/// JSON lines {module, name, stub}; the stub is the signature and docstring.
const STDLIB_SCRIPT: &str = r#"
import ast, importlib, inspect, json, re, sys, textwrap, zlib
MODULES = """base64 bisect calendar colorsys csv difflib email.utils fnmatch fractions ftplib
glob gzip heapq html html.parser http.cookies ipaddress json keyword linecache locale
mimetypes ntpath numbers operator os os.path pathlib pprint quopri random re shlex shutil
statistics string tarfile tempfile textwrap tokenize urllib.parse uuid wave zipfile
collections functools itertools datetime decimal enum inspect typing dataclasses
configparser argparse logging copy contextlib graphlib secrets hashlib hmac struct
""".split()
def fim(f, qual):
    """The function's source split around one line of its body after the docstring (chosen
    by a checksum of its name), or None."""
    try:
        src = textwrap.dedent(inspect.getsource(f))
        node = ast.parse(src).body[0]
        body = node.body
        start = body[0].end_lineno if ast.get_docstring(node) is not None else body[0].lineno - 1
    except Exception:
        return None
    lines = src.splitlines(keepends=True)
    cands = [i for i in range(start, len(lines)) if lines[i].strip() and not lines[i].strip().startswith('#')]
    if not cands:
        return None
    i = cands[zlib.crc32(qual.encode()) % len(cands)]
    return {"prefix": "".join(lines[:i]), "middle": lines[i], "suffix": "".join(lines[i + 1:])}
seen = set()
per_module = {}
for name in MODULES:
    try:
        mod = importlib.import_module(name)
    except Exception:
        continue
    items = []
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_"):
            continue
        if inspect.isfunction(obj) and getattr(obj, "__module__", None) == mod.__name__:
            items.append((attr, obj))
        elif inspect.isclass(obj) and getattr(obj, "__module__", None) == mod.__name__:
            for m, f in sorted(vars(obj).items()):
                if not m.startswith("_") and inspect.isfunction(f):
                    items.append((attr + "." + m, f))
    for qual, f in items:
        doc = inspect.getdoc(f)
        if not doc or len(doc) < 60 or len(doc) > 1500:
            continue
        try:
            # Default values print as `<… object at 0x…>`: no addresses, so that the
            # listing is the same on every run.
            sig = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(f)))
        except (TypeError, ValueError):
            continue
        fname = qual.split(".")[-1]
        key = (fname, doc)
        if key in seen:
            continue
        seen.add(key)
        body = "\n".join("    " + l if l else "" for l in doc.splitlines())
        stub = f'def {fname}{sig}:\n    """\n{body}\n    """\n'
        per_module.setdefault(name, []).append({"module": name, "name": qual, "stub": stub, "fim": fim(f, qual)})
# Round-robin across modules, so that any prefix (--limit) spans the library.
queues = [per_module[m] for m in MODULES if m in per_module]
while any(queues):
    for q in queues:
        if q:
            print(json.dumps(q.pop(0)))
"#;

/// The instruction wrapped around each stub (a generic code-completion task).
pub const STDLIB_INSTRUCTION: &str =
    "Complete the following Python function. Answer with the whole function in a Python code block.";

/// Qwen2.5-Coder's (and StarCoder2's) fill-in-the-middle tokens: the marker table's first
/// family.
const FIM_PREFIX: &str = tokenrouter_api::fim_markers::PREFIX[0];
const FIM_SUFFIX: &str = tokenrouter_api::fim_markers::SUFFIX[0];
const FIM_MIDDLE: &str = tokenrouter_api::fim_markers::MIDDLE[0];

/// Write the stdlib prompt set; returns how many prompts were written.
pub fn write_stdlib_prompts(a: &PromptsArgs) -> Result<usize> {
    let out = std::process::Command::new(&a.python)
        .args(["-I", "-c", STDLIB_SCRIPT])
        .output()
        .map_err(|e| TrainError::Input(format!("cannot run `{}`: {e}", a.python)))?;
    if !out.status.success() {
        return Err(TrainError::Input(format!(
            "`{}` failed listing the standard library: {}",
            a.python,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let listing = String::from_utf8_lossy(&out.stdout);
    let mut f = std::fs::File::create(&a.out).map_err(|e| TrainError::file(&a.out, e))?;
    let mut n = 0;
    for line in listing.lines() {
        if n == a.limit {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| TrainError::Input(format!("stdlib listing: {e}")))?;
        let source = format!(
            "{}.{}",
            v["module"].as_str().unwrap_or(""),
            v["name"].as_str().unwrap_or("")
        );
        let row = if a.fim {
            let part = |k: &str| v["fim"][k].as_str().map(str::to_string);
            let (Some(prefix), Some(middle), Some(suffix)) =
                (part("prefix"), part("middle"), part("suffix"))
            else {
                continue;
            };
            // Raw text (`label` reads `text` without a chat template); `middle` is the
            // line left out, kept for reference.
            serde_json::json!({"text": format!("{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"), "middle": middle, "source": source})
        } else {
            let stub = v["stub"].as_str().unwrap_or_default();
            let prompt = format!("{STDLIB_INSTRUCTION}\n\n```python\n{stub}```");
            serde_json::json!({"prompt": prompt, "source": source})
        };
        writeln!(f, "{row}").map_err(|e| TrainError::file(&a.out, e))?;
        n += 1;
    }
    if n == 0 {
        return Err(TrainError::Input(
            "the standard library listing gave no prompts".into(),
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_forms_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\":\"a\"}\n\n{\"messages\":[{\"role\":\"user\",\"content\":\"b\"}]}\n{\"text\":\"c\"}\n",
        )
        .unwrap();
        let got = read_prompts(&p, false).unwrap();
        assert_eq!(got.len(), 3);
        assert!(matches!(&got[0], Prompt::Chat(m) if m[0].content == "a"));
        assert_eq!(got[2], Prompt::Raw("c".into()));
        assert_eq!(read_prompts(&p, true).unwrap()[0], Prompt::Raw("a".into()));
        std::fs::write(&p, "\n\n").unwrap();
        assert!(read_prompts(&p, false)
            .unwrap_err()
            .to_string()
            .contains("holds no prompts"));
        std::fs::write(&p, "{\"q\":1}\n").unwrap();
        assert!(read_prompts(&p, false)
            .unwrap_err()
            .to_string()
            .contains("line 1"));
        std::fs::write(&p, "nope\n").unwrap();
        assert!(read_prompts(&p, false).is_err());
    }

    #[test]
    fn stdlib_prompts_are_function_stubs() {
        let dir = tempfile::tempdir().unwrap();
        let a = PromptsArgs {
            out: dir.path().join("s.jsonl"),
            limit: 25,
            python: "python3".into(),
            fim: false,
        };
        let n = write_stdlib_prompts(&a).unwrap();
        assert_eq!(n, 25);
        // The same listing on every run (no object addresses in default values).
        let all = PromptsArgs {
            out: dir.path().join("all.jsonl"),
            limit: 2000,
            ..a.clone()
        };
        write_stdlib_prompts(&all).unwrap();
        let first = std::fs::read(&all.out).unwrap();
        write_stdlib_prompts(&all).unwrap();
        assert_eq!(std::fs::read(&all.out).unwrap(), first);
        let got = read_prompts(&a.out, false).unwrap();
        let Prompt::Chat(m) = &got[0] else {
            panic!("chat prompt")
        };
        assert!(m[0].content.starts_with(STDLIB_INSTRUCTION));
        assert!(m[0].content.contains("def "));
        let bad = PromptsArgs {
            python: "/nonexistent/python".into(),
            ..a
        };
        assert!(write_stdlib_prompts(&bad).is_err());
    }

    #[test]
    fn fim_prompts_leave_one_body_line_out() {
        let dir = tempfile::tempdir().unwrap();
        let a = PromptsArgs {
            out: dir.path().join("f.jsonl"),
            limit: 20,
            python: "python3".into(),
            fim: true,
        };
        assert_eq!(write_stdlib_prompts(&a).unwrap(), 20);
        let text = std::fs::read_to_string(&a.out).unwrap();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let t = v["text"].as_str().unwrap();
            let middle = v["middle"].as_str().unwrap();
            let rest = t.strip_prefix(FIM_PREFIX).unwrap();
            let (prefix, rest) = rest.split_once(FIM_SUFFIX).unwrap();
            let suffix = rest.strip_suffix(FIM_MIDDLE).unwrap();
            // The three parts are the function again, the middle one line of its body.
            let whole = format!("{prefix}{middle}{suffix}");
            assert!(
                whole.trim_start().starts_with("def ") || whole.contains("\ndef "),
                "{whole}"
            );
            assert_eq!(
                middle.trim_end_matches('\n').lines().count(),
                1,
                "{middle:?}"
            );
            assert!(!middle.trim().is_empty() && !middle.trim().starts_with('#'));
            assert!(prefix.contains("def "), "the signature is in the prefix");
        }
        let got = read_prompts(&a.out, false).unwrap();
        assert!(matches!(&got[0], Prompt::Raw(t) if t.starts_with(FIM_PREFIX)));
    }
}
