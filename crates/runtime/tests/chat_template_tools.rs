//! Tool use through the real Qwen2.5-Coder chat template (read from the fetched GGUFs):
//! the request's tools, an assistant's earlier call and a tool's result render exactly as
//! Hugging Face renders them (jinja2 with transformers' `tojson`: Python's `json.dumps`,
//! keys in the given order, `", "` / `": "`, nothing HTML-escaped). The expected text was
//! made that way from the same templates (`ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)` with transformers' `tojson`).

mod fetched;

use fetched::fetched_model;
use serde_json::json;
use tokenrouter_runtime::{inspect, Message};

const EXPECTED: &str = "\
<|im_start|>system\n\
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\
\n\
# Tools\n\
\n\
You may call one or more functions to assist with the user query.\n\
\n\
You are provided with function signatures within <tools></tools> XML tags:\n\
<tools>\n\
{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather <now> & 'here' é\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n\
</tools>\n\
\n\
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
<tool_call>\n\
{\"name\": <function-name>, \"arguments\": <args-json-object>}\n\
</tool_call><|im_end|>\n\
<|im_start|>user\n\
Weather?<|im_end|>\n\
<|im_start|>assistant\n\
<tool_call>\n\
{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"b\": 1}}\n\
</tool_call><|im_end|>\n\
<|im_start|>user\n\
<tool_response>\n\
18 C\n\
</tool_response><|im_end|>\n\
<|im_start|>assistant\n\
";

fn conversation() -> (Vec<Message>, serde_json::Value) {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather <now> & 'here' \u{e9}",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]);
    let call = Message {
        tool_calls: Some(vec![json!({"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "b": 1}}})]),
        ..Message::new("assistant", "")
    };
    let result = Message {
        tool_call_id: Some("c1".into()),
        ..Message::new("tool", "18 C")
    };
    (vec![Message::new("user", "Weather?"), call, result], tools)
}

#[test]
fn tools_calls_and_results_render_as_hugging_face_renders_them() {
    for file in [
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ] {
        let Some(path) = fetched_model(file) else {
            continue;
        };
        let (_, text) = inspect(&path).unwrap();
        let (messages, tools) = conversation();
        let rendered = text
            .apply_chat_template(&messages, true, &json!({ "tools": tools }))
            .unwrap();
        // The 1.5B's template writes the format line's braces doubled, and jinja2 prints
        // them so: that model was given `{{"name": ...}}`.
        let expected = match file.contains("1.5b") {
            true => EXPECTED.replace(
                r#"{"name": <function-name>, "arguments": <args-json-object>}"#,
                r#"{{"name": <function-name>, "arguments": <args-json-object>}}"#,
            ),
            false => EXPECTED.to_string(),
        };
        assert_eq!(rendered, expected, "{file}");
    }
}
