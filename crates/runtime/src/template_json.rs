//! The `tojson` filter as Hugging Face chat templates mean it: Python's `json.dumps` with
//! transformers' defaults (`ensure_ascii=False`, `", "` and `": "` between items, keys in
//! their given order, no HTML escaping). minijinja's own `tojson` writes compact JSON with
//! `<`, `>`, `&` and `'` escaped, so a tool's schema or a call's arguments reached the model
//! in a form it was not trained on (`{"city":"Paris"}` for `{"city": "Paris"}`).

use std::fmt::Write;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// `value | tojson(indent=None, ensure_ascii=False, sort_keys=False, separators=None)`.
pub fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match indent {
        Some(indent) => Some(indent),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: `separators` must be two strings",
            ))
        }
        // Python drops the space after items when indenting (it would end each line).
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let writer = JsonWriter {
        indent,
        item,
        key,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    writer.value(value, 0, &mut out)?;
    Ok(out)
}

struct JsonWriter {
    indent: Option<String>,
    item: String,
    key: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl JsonWriter {
    fn value(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => {
                let _ = write!(out, "{v}");
            }
            ValueKind::Number => out.push_str(&python_float(f64::try_from(v.clone())?)),
            ValueKind::String | ValueKind::Bytes => self.string(v.as_str().unwrap_or(""), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', items.len(), depth, out, |i, out| {
                    self.value(&items[i], depth + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.container('{', '}', keys.len(), depth, out, |i, out| {
                    let key = &keys[i];
                    match key.as_str() {
                        Some(s) => self.string(s, out),
                        None => self.string(&key.to_string(), out),
                    }
                    out.push_str(&self.key);
                    self.value(&v.get_item(key)?, depth + 1, out)
                })?;
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: cannot serialize {}", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn container(
        &self,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item);
            }
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(depth + 1));
            }
            item(i, out)?;
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
        out.push(close);
        Ok(())
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr` of a float: the shortest digits that read back, positional for
/// exponents -4..16 (`0.0001`, `100.0`), else `1e-05` / `1e+16`.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.25e-7".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        return if s.contains('.') { s } else { format!("{s}.0") };
    }
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::Environment;

    fn render(template: &str, value: serde_json::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(template, minijinja::context! { v => value })
            .unwrap()
    }

    #[test]
    fn writes_what_python_json_dumps_writes() {
        let v: serde_json::Value = serde_json::from_str(
            r#"{"type": "function", "b": [1, 2.5, true, null, {}, []], "s": "<a> & 'q' é\n\u0001"}"#,
        )
        .unwrap();
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            render("{{ v | tojson }}", v.clone()),
            r#"{"type": "function", "b": [1, 2.5, true, null, {}, []], "s": "<a> & 'q' é\n\u0001"}"#
        );
        // json.dumps(v, indent=2, sort_keys=True, ensure_ascii=True)
        assert_eq!(
            render("{{ v | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}", v),
            "{\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null,\n    {},\n    []\n  ],\n  \"s\": \"<a> & 'q' \\u00e9\\n\\u0001\",\n  \"type\": \"function\"\n}"
        );
        let v = serde_json::json!({"a": 1});
        assert_eq!(
            render("{{ v | tojson(separators=[',', ':']) }}", v),
            r#"{"a":1}"#
        );
        assert_eq!(
            render(
                "{{ v | tojson(ensure_ascii=true) }}",
                serde_json::json!("🙂")
            ),
            r#""\ud83d\ude42""#
        );
    }

    #[test]
    fn floats_read_like_python_repr() {
        for (x, repr) in [
            (0.1, "0.1"),
            (100.0, "100.0"),
            (-2.5, "-2.5"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.234e300, "1.234e+300"),
            (0.0, "0.0"),
        ] {
            assert_eq!(python_float(x), repr, "{x}");
        }
    }
}
