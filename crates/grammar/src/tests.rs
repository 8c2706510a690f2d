//! Constrained decoding with a synthetic byte-level vocabulary and random logits: whatever
//! the logits, the tokens kept decode to text the constraint accepts.

use super::*;
use serde_json::{json, Value};
use tokenrouter_runtime::TextModel;

const VOCAB: usize = 600;

fn text_model() -> TextModel {
    TextModel::synthetic(VOCAB).unwrap()
}

fn compiler(text: &TextModel) -> GrammarCompiler {
    // Logits wider than the tokenizer: the padding ids are never allowed.
    let eos: Vec<u32> = text.encode("<|im_end|>").unwrap();
    GrammarCompiler::new(text.tokenizer(), VOCAB + 40, &eos).unwrap()
}

/// xorshift: deterministic "model" logits.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Decodes under `constraint` with random logits (end-of-sequence favoured where allowed,
/// so every run ends), greedy over the masked row. Returns the text before the end.
fn decode(constraint: &OutputConstraint, seed: u64) -> String {
    decode_favouring(constraint, seed, "")
}

/// `decode` with the single-byte tokens of `favoured` preferred too (a "model" that
/// closes what it opens).
fn decode_favouring(constraint: &OutputConstraint, seed: u64, favoured: &str) -> String {
    let text = text_model();
    let eos = text.encode("<|im_end|>").unwrap()[0];
    let favoured: Vec<u32> = favoured
        .chars()
        .map(|c| text.encode(&c.to_string()).unwrap()[0])
        .collect();
    let mut grammar = compiler(&text).compile(constraint).unwrap();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut out = Vec::new();
    for _ in 0..400 {
        let mut logits: Vec<f32> = (0..VOCAB + 40).map(|_| rng.next()).collect();
        logits[eos as usize] += 0.5;
        for &f in &favoured {
            logits[f as usize] += 1.0;
        }
        let allowed = grammar.allowed().unwrap();
        let mut bits = vec![0xA5u8; logits.len().div_ceil(8)];
        allowed.write_bits(&mut bits);
        allowed.apply(&mut logits);
        assert!(logits[VOCAB..].iter().all(|x| *x == f32::NEG_INFINITY));
        // The device's form of the mask (bits) allows exactly what the host's leaves finite.
        for (i, x) in logits.iter().enumerate() {
            let bit = bits[i / 8] >> (i % 8) & 1 == 1;
            assert_eq!(bit, x.is_finite(), "token {i}");
            assert_eq!(bit, allowed.is_allowed(i as u32), "token {i}");
        }
        let (token, best) = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |a, (i, &x)| if x > a.1 { (i, x) } else { a },
            );
        assert!(best.is_finite(), "no token allowed after {out:?}");
        let token = token as u32;
        grammar.accept(token).unwrap();
        if token == eos {
            assert!(grammar.must_end() || grammar.matcher.is_accepting().unwrap());
            return text.decode(&out, false).unwrap();
        }
        out.push(token);
    }
    panic!("no end in 400 tokens: {:?}", text.decode(&out, false));
}

#[test]
fn json_schema_output_parses_and_fits_the_schema() {
    let schema = json!({"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["answer", "count", "tags"], "additionalProperties": false});
    for seed in 0..12 {
        let out = decode(&OutputConstraint::JsonSchema(schema.clone()), seed);
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(
            ["yes", "no"].contains(&v["answer"].as_str().unwrap()),
            "{out}"
        );
        assert!(v["count"].as_u64().unwrap() <= 99, "{out}");
        assert!(v["tags"].as_array().unwrap().len() <= 2, "{out}");
        assert_eq!(v.as_object().unwrap().len(), 3, "{out}");
    }
}

/// The Lark grammars the server writes for a forced tool call (Hermes and Llama 3 forms)
/// compile, and decode to a call whose arguments fit the tool's schema.
#[test]
fn forced_tool_call_grammars_decode_to_calls() {
    let params = r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}"#;
    let hermes = format!(
        "start: call0\ncall0: \"<tool_call>\\n{{\\\"name\\\": \\\"f\\\", \\\"arguments\\\": \" %json {params} \"}}\\n</tool_call>\""
    );
    let llama3 = format!(
        "start: call0\ncall0: \"{{\\\"name\\\": \\\"f\\\", \\\"parameters\\\": \" %json {params} \"}}\""
    );
    for (grammar, key) in [(hermes, "arguments"), (llama3, "parameters")] {
        for seed in 0..4 {
            let out = decode(&OutputConstraint::Lark(grammar.clone()), seed);
            let body = out
                .trim_start_matches("<tool_call>\n")
                .trim_end_matches("\n</tool_call>");
            let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{out:?}: {e}"));
            assert_eq!(v["name"], "f", "{out}");
            assert!(v[key]["n"].as_u64().unwrap() <= 9, "{out}");
        }
    }
}

#[test]
fn json_object_regex_and_choice() {
    for seed in 0..6 {
        let out = decode_favouring(&OutputConstraint::JsonObject, seed, "{}\":1,a[]");
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(v.is_object(), "{out}");
        let out = decode(&OutputConstraint::Regex("[0-9]{3}-[a-c]{2}".into()), seed);
        assert!(
            out.len() == 6
                && out[..3].bytes().all(|b| b.is_ascii_digit())
                && &out[3..4] == "-"
                && out[4..].bytes().all(|b| (b'a'..=b'c').contains(&b)),
            "{out:?}"
        );
        let choices = vec![
            "red".to_string(),
            "green \"x\"".to_string(),
            "é".to_string(),
        ];
        let out = decode(&OutputConstraint::Choice(choices.clone()), seed);
        assert!(choices.contains(&out), "{out:?}");
    }
}

/// GBNF (llama.cpp's grammars, SGLang's `ebnf`) decodes to text its rules accept: an
/// arithmetic grammar with nested groups, rule references and classes; a JSON grammar in
/// llama.cpp's style (whitespace rule, escapes, `{m,n}` repeats); token references.
#[test]
fn gbnf_grammars_decode_to_text_they_accept() {
    let arithmetic = OutputConstraint::Gbnf(
        "# sums and products of numbers and groups\n\
         root ::= expr\n\
         expr ::= term (op term)*\n\
         op   ::= [-+*/]\n\
         term ::= [0-9]{1,3} | \"(\" expr \")\"\n"
            .into(),
    );
    let json_gbnf = OutputConstraint::Gbnf(
        r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ws
ws ::= | " " | "\n" [ \t]{0,20}
"#
        .into(),
    );
    for seed in 0..6 {
        let out = decode_favouring(&arithmetic, seed, "1)");
        let mut depth = 0i32;
        for c in out.chars() {
            depth += match c {
                '(' => 1,
                ')' => -1,
                _ => 0,
            };
            assert!(depth >= 0 && "0123456789+-*/()".contains(c), "{out:?}");
        }
        assert_eq!(depth, 0, "{out:?}");
        assert!(
            !out.is_empty() && !out.ends_with(|c| "+-*/(".contains(c)),
            "{out:?}"
        );

        let out = decode_favouring(&json_gbnf, seed, "{}\":1,a[]");
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(v.is_object(), "{out}");
    }
    // Tokens by id and by their text, and negated: only they are allowed.
    let text = text_model();
    let id = |t: &str| {
        let ids = text.encode(t).unwrap();
        assert_eq!(ids.len(), 1, "{t}");
        ids[0]
    };
    let (im_start, fim, a) = (id("<|im_start|>"), id("<|fim_prefix|>"), id("a"));
    let compiler = compiler(&text);
    for (grammar, allowed_ids) in [
        (format!("root ::= <[{im_start}]> \"x\""), vec![im_start]),
        ("root ::= <|im_start|> \"x\"".to_string(), vec![im_start]),
        (
            "root ::= (<|fim_prefix|> | <|im_start|>) \"x\"".to_string(),
            vec![im_start.min(fim), im_start.max(fim)],
        ),
    ] {
        let mut grammar = compiler.compile(&OutputConstraint::Gbnf(grammar)).unwrap();
        let allowed = grammar.allowed().unwrap();
        let all: Vec<u32> = (0..VOCAB as u32)
            .filter(|&t| allowed.is_allowed(t))
            .collect();
        assert_eq!(all, allowed_ids);
    }
    let mut grammar = compiler
        .compile(&OutputConstraint::Gbnf(
            "root ::= !<|im_start|> \"x\"".into(),
        ))
        .unwrap();
    let allowed = grammar.allowed().unwrap();
    assert!(!allowed.is_allowed(im_start) && allowed.is_allowed(a) && allowed.is_allowed(fim));
    // Nesting past llguidance's own limit (its Lark reader stops at 30) still compiles.
    let deep = format!("root ::= {}\"a\"{}", "(\"b\" ".repeat(100), ")".repeat(100));
    let out = decode(&OutputConstraint::Gbnf(deep), 1);
    assert_eq!(out, format!("{}a", "b".repeat(100)));
}

#[test]
fn rollback_restores_the_earlier_mask() {
    let text = text_model();
    let mut grammar = compiler(&text)
        .compile(&OutputConstraint::Choice(vec!["abc".into(), "abd".into()]))
        .unwrap();
    let row = |g: &mut Grammar| {
        let mut logits = vec![0.0f32; VOCAB + 40];
        g.mask(&mut logits).unwrap();
        logits.iter().map(|x| x.is_finite()).collect::<Vec<_>>()
    };
    let first = row(&mut grammar);
    let a = text.encode("a").unwrap();
    assert_eq!(a.len(), 1);
    assert!(first[a[0] as usize]);
    grammar.accept(a[0]).unwrap();
    assert_ne!(row(&mut grammar), first);
    grammar.rollback(1).unwrap();
    assert_eq!(row(&mut grammar), first);
    // A token the constraint does not allow is an error, not a silent pass.
    let z = text.encode("z").unwrap()[0];
    assert!(matches!(grammar.accept(z), Err(GrammarError::Decoding(_))));
}

#[test]
fn invalid_constraints_are_refused_with_a_reason() {
    let text = text_model();
    let c = compiler(&text);
    for bad in [
        OutputConstraint::Regex("(".into()),
        OutputConstraint::JsonSchema(json!({"type": "no-such-type"})),
        OutputConstraint::Choice(vec![]),
        OutputConstraint::Lark("start: undefined_rule".into()),
        OutputConstraint::Gbnf("root ::= undefined-rule".into()),
        OutputConstraint::Gbnf("root ::= \"unclosed".into()),
    ] {
        match c.compile(&bad) {
            Err(GrammarError::Invalid(reason)) => assert!(!reason.is_empty()),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

/// The byte-level reading of a tokenizer equals llguidance's reading of its JSON, for the
/// synthetic vocabulary and (when fetched) Qwen2.5's.
#[test]
fn byte_level_words_equal_llguidances_reading() {
    let mut tokenizers = vec![text_model().tokenizer().clone()];
    let home = std::env::var("HOME").unwrap_or_default();
    let qwen = std::path::Path::new(&home)
        .join(".cache/tokenrouter/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    if let Ok((_, text)) = tokenrouter_runtime::inspect(&qwen) {
        tokenizers.push(text.tokenizer().clone());
    }
    for tokenizer in tokenizers {
        let ours = byte_level_words(&tokenizer).expect("a byte-level tokenizer");
        let json: Value = serde_json::from_str(&tokenizer.to_string(false).unwrap()).unwrap();
        let mut theirs = llguidance::token_bytes_from_tokenizer_json(&json).unwrap();
        theirs.resize(ours.len(), Vec::new());
        assert_eq!(ours.len(), tokenizer.get_vocab_size(true));
        let differ: Vec<usize> = (0..ours.len()).filter(|&i| ours[i] != theirs[i]).collect();
        assert!(
            differ.is_empty(),
            "{} ids differ, first {:?}",
            differ.len(),
            &differ[..differ.len().min(5)]
        );
    }
}

/// What the token table costs on a real vocabulary (Qwen2.5's 151,665 tokens from the
/// fetched 0.5B GGUF): build time, resident memory, and one mask. A probe, not a check:
/// `cargo test --release -p tokenrouter-grammar -- --ignored --nocapture`.
#[test]
#[ignore]
fn token_table_cost_on_the_real_vocabulary() {
    let home = std::env::var("HOME").unwrap_or_default();
    let path = std::path::Path::new(&home)
        .join(".cache/tokenrouter/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let (_, text) = tokenrouter_runtime::inspect(&path).unwrap();
    let rss = || {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    let before = rss();
    let t = std::time::Instant::now();
    let compiler =
        GrammarCompiler::new(text.tokenizer(), text.vocab_len(), text.eos_ids()).unwrap();
    let built = t.elapsed();
    let after = rss();
    let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
    let t = std::time::Instant::now();
    let mut grammar = compiler
        .compile(&OutputConstraint::JsonSchema(schema))
        .unwrap();
    let compiled = t.elapsed();
    let mut logits = vec![0.0f32; text.vocab_len()];
    let t = std::time::Instant::now();
    grammar.mask(&mut logits).unwrap();
    let first = t.elapsed();
    // Inside a free string nearly every token may come next: the costly case.
    for id in text.encode("{\"a\": \"").unwrap() {
        grammar.accept(id).unwrap();
    }
    let mut logits = vec![0.0f32; text.vocab_len()];
    let t = std::time::Instant::now();
    grammar.mask(&mut logits).unwrap();
    let in_string = t.elapsed();
    // Its parts: the allowed set, applied to host logits, written as device bits.
    let t = std::time::Instant::now();
    let allowed = grammar.allowed().unwrap();
    let computed = t.elapsed();
    let t = std::time::Instant::now();
    allowed.apply(&mut logits);
    let applied = t.elapsed();
    let mut bits = vec![0u8; text.vocab_len().div_ceil(8)];
    let t = std::time::Instant::now();
    allowed.write_bits(&mut bits);
    let flagged = t.elapsed();
    println!(
        "token table: {:.2} s, {:.1} MB resident; a schema compiled in {:.2} ms; first mask \
         {:.2} ms; in a string {:.2} ms ({} allowed): the set {:.3} ms, applied {:.3} ms, \
         as bits {:.3} ms",
        built.as_secs_f64(),
        after - before,
        compiled.as_secs_f64() * 1e3,
        first.as_secs_f64() * 1e3,
        in_string.as_secs_f64() * 1e3,
        logits.iter().filter(|x| x.is_finite()).count(),
        computed.as_secs_f64() * 1e3,
        applied.as_secs_f64() * 1e3,
        flagged.as_secs_f64() * 1e3,
    );
    assert_eq!(
        bits.iter().map(|b| b.count_ones() as usize).sum::<usize>(),
        logits.iter().filter(|x| x.is_finite()).count()
    );
}
