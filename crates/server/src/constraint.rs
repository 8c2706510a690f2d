//! Structured output requests: OpenAI's `response_format` (`json_object`, `json_schema`),
//! vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (or their
//! newer spelling, `structured_outputs: {"json" | "regex" | "choice" | "grammar"}`; a
//! grammar in GBNF or Lark), llama.cpp's GBNF `grammar` and SGLang's `regex` / `ebnf`, read into
//! the engine's [`OutputConstraint`]. The engine compiles it (an invalid schema or regex is
//! its 400, renamed here to the field the client sent) and masks every token that could not
//! continue it, whichever model writes the position.

use serde_json::Value;
use tokenrouter_api::OutputConstraint;

use crate::error::ApiError;
use crate::openai::request::CommonFields;

/// The request's constraint and the field it came in (for error messages), if any.
pub fn output_constraint(
    fields: &CommonFields,
) -> Result<Option<(OutputConstraint, &'static str)>, ApiError> {
    let mut found: Vec<(OutputConstraint, &'static str)> = Vec::new();
    if let Some(format) = &fields.response_format {
        if let Some(c) = response_format(format)? {
            found.push((c, "response_format"));
        }
    }
    if let Some(schema) = &fields.guided_json {
        found.push((json_schema(schema, "guided_json")?, "guided_json"));
    }
    if let Some(rx) = &fields.guided_regex {
        found.push((OutputConstraint::Regex(rx.clone()), "guided_regex"));
    }
    if let Some(choices) = &fields.guided_choice {
        found.push((OutputConstraint::Choice(choices.clone()), "guided_choice"));
    }
    if let Some(grammar) = &fields.guided_grammar {
        found.push((OutputConstraint::grammar(grammar.clone()), "guided_grammar"));
    }
    if let Some(grammar) = fields.grammar.as_ref().filter(|g| !g.is_empty()) {
        found.push((OutputConstraint::grammar(grammar.clone()), "grammar"));
    }
    if let Some(rx) = &fields.regex {
        found.push((OutputConstraint::Regex(rx.clone()), "regex"));
    }
    if let Some(grammar) = &fields.ebnf {
        found.push((OutputConstraint::Gbnf(grammar.clone()), "ebnf"));
    }
    if let Some(outputs) = &fields.structured_outputs {
        found.push((structured_outputs(outputs)?, "structured_outputs"));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, f)| *f).collect();
        return Err(ApiError::invalid(
            found[1].1,
            format!("give one output constraint, not {}", names.join(" and ")),
        ));
    }
    Ok(found.pop())
}

/// A schema given as an object or as its JSON text (vLLM takes both).
fn json_schema(schema: &Value, field: &str) -> Result<OutputConstraint, ApiError> {
    let schema = match schema {
        Value::String(text) => serde_json::from_str(text)
            .map_err(|e| ApiError::invalid(field, format!("`{field}` is not JSON: {e}")))?,
        other => other.clone(),
    };
    Ok(OutputConstraint::JsonSchema(schema))
}

/// vLLM's `structured_outputs` object: exactly one of its constraint keys.
fn structured_outputs(outputs: &Value) -> Result<OutputConstraint, ApiError> {
    const FIELD: &str = "structured_outputs";
    let bad = |why: &str| ApiError::invalid(FIELD, why.to_string());
    let object = outputs
        .as_object()
        .ok_or_else(|| bad("`structured_outputs` must be an object"))?;
    let keys = ["json", "regex", "choice", "grammar", "json_object"];
    let given: Vec<&str> = keys
        .into_iter()
        .filter(|k| {
            object
                .get(*k)
                .is_some_and(|v| !v.is_null() && *v != Value::Bool(false))
        })
        .collect();
    let [key] = given[..] else {
        return Err(bad(&format!(
            "`structured_outputs` takes exactly one of {}",
            keys.join(", ")
        )));
    };
    let value = &object[key];
    let text = || {
        value
            .as_str()
            .map(String::from)
            .ok_or_else(|| bad(&format!("`structured_outputs.{key}` must be a string")))
    };
    match key {
        "json" => json_schema(value, "structured_outputs.json"),
        "regex" => Ok(OutputConstraint::Regex(text()?)),
        "grammar" => Ok(OutputConstraint::grammar(text()?)),
        "choice" => serde_json::from_value(value.clone())
            .map(OutputConstraint::Choice)
            .map_err(|_| bad("`structured_outputs.choice` must be a list of strings")),
        _ => Ok(OutputConstraint::JsonObject),
    }
}

/// `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or `{"type":
/// "json_schema", "json_schema": {"name", "schema", "strict"}}`.
fn response_format(format: &Value) -> Result<Option<OutputConstraint>, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputConstraint::JsonObject)),
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .filter(|s| s.is_object())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "response_format.json_schema.schema",
                        "`response_format.json_schema.schema` must be a JSON schema object",
                    )
                })?;
            Ok(Some(OutputConstraint::JsonSchema(schema.clone())))
        }
        Some(other) => Err(ApiError::invalid(
            "response_format",
            format!(
                "`response_format` must be of type text, json_object or json_schema, not `{}`",
                crate::error::truncate_for_echo(other)
            ),
        )),
        None => Err(ApiError::invalid(
            "response_format",
            "`response_format` must be an object with a string `type`",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(body: Value) -> Result<Option<(OutputConstraint, &'static str)>, ApiError> {
        output_constraint(&serde_json::from_value(body).unwrap())
    }

    #[test]
    fn each_field_becomes_its_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some((OutputConstraint::JsonObject, "response_format")),
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some((
                    OutputConstraint::JsonSchema(schema.clone()),
                    "response_format",
                )),
            ),
            (
                json!({"guided_json": schema.to_string()}),
                Some((OutputConstraint::JsonSchema(schema.clone()), "guided_json")),
            ),
            (
                json!({"guided_regex": "a+"}),
                Some((OutputConstraint::Regex("a+".into()), "guided_regex")),
            ),
            (
                json!({"guided_choice": ["x", "y"]}),
                Some((
                    OutputConstraint::Choice(vec!["x".into(), "y".into()]),
                    "guided_choice",
                )),
            ),
            (
                json!({"guided_grammar": "start: \"a\""}),
                Some((
                    OutputConstraint::Lark("start: \"a\"".into()),
                    "guided_grammar",
                )),
            ),
            (
                json!({"structured_outputs": {"choice": ["x", "y"]}}),
                Some((
                    OutputConstraint::Choice(vec!["x".into(), "y".into()]),
                    "structured_outputs",
                )),
            ),
            (
                json!({"structured_outputs": {"json": schema, "regex": null}}),
                Some((
                    OutputConstraint::JsonSchema(schema.clone()),
                    "structured_outputs",
                )),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                Some((OutputConstraint::JsonObject, "structured_outputs")),
            ),
            (json!({}), None),
        ];
        for (body, want) in cases {
            assert_eq!(read(body.clone()).unwrap(), want, "{body}");
        }
    }

    #[test]
    fn bad_or_several_constraints_are_refused_by_name() {
        for (body, param) in [
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format",
            ),
            (json!({"response_format": {}}), "response_format"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
            (json!({"structured_outputs": {}}), "structured_outputs"),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"regex": 3}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"json": "{x"}}),
                "structured_outputs.json",
            ),
        ] {
            let err = read(body.clone()).unwrap_err();
            assert_eq!(err.param().as_deref(), Some(param), "{body}");
        }
    }
}
