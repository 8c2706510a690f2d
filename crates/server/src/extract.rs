//! A JSON body extractor whose rejections are our OpenAI-shaped [`ApiError`]s: a body over
//! the limit is 413, malformed JSON is 400, and a wrongly typed or missing field is 400
//! naming the field (via `serde_path_to_error`), which axum's own `Json` cannot do.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;
use crate::state::AppState;

/// Deserialized request body.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        // Refused from its headers, before a byte of the body is read: a client that sent
        // `Expect: 100-continue` is answered 413 instead of being invited to upload, and one
        // that did not is answered without its upload being read up to the limit first.
        if declared_length(&req).is_some_and(|n| n > state.config.max_body_bytes as u64) {
            return Err(ApiError::BodyTooLarge {
                limit: state.config.max_body_bytes,
            });
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge {
                    limit: state.config.max_body_bytes,
                }
            } else {
                ApiError::InvalidJson {
                    message: format!("could not read the request body: {rejection}"),
                    param: None,
                }
            }
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// The body's `Content-Length`, when the request declares one that parses.
fn declared_length(req: &Request) -> Option<u64> {
    req.headers()
        .get(axum::http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Parses `bytes` as a JSON object, then as `T` (see [`parse_value`]).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    parse_value(&parse_object(bytes)?)
}

/// Parses `bytes` as a JSON object; anything else is a 400 without a `param`.
pub fn parse_object(bytes: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| ApiError::InvalidJson {
        message: format!("the request body is not valid JSON: {e}"),
        param: None,
    })?;
    if !value.is_object() {
        return Err(ApiError::InvalidJson {
            message: "the request body must be a JSON object".into(),
            param: None,
        });
    }
    Ok(value)
}

/// Deserializes `value` as `T`; a wrongly typed or missing field becomes a 400 that names
/// it in `param` (dotted path, e.g. `stream_options.include_usage`, `messages[0].role`).
/// Several views of one body (common sampling fields, endpoint fields) can be parsed from
/// the same value this way, which `#[serde(flatten)]` would not allow without losing paths.
pub fn parse_value<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize::<_, T>(value).map_err(|err| {
        let path = err.path().to_string();
        let message = err.into_inner().to_string();
        let missing = missing_field_name(&message);
        let param = match (path.as_str(), missing) {
            (".", Some(field)) => Some(field.to_string()),
            (".", None) => None,
            (parent, Some(field)) => Some(format!("{parent}.{field}")),
            (parent, None) => Some(parent.to_string()),
        };
        match (missing, param) {
            (Some(_), Some(param)) => ApiError::MissingField(param),
            (_, Some(param)) => ApiError::InvalidJson {
                message: format!("invalid value for `{param}`: {message}"),
                param: Some(param),
            },
            (_, None) => ApiError::InvalidJson {
                message: format!("invalid request body: {message}"),
                param: None,
            },
        }
    })
}

/// serde reports a missing field as "missing field `name`".
fn missing_field_name(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("missing field `")?;
    rest.split('`').next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct Inner {
        #[allow(dead_code)]
        include_usage: bool,
    }

    #[derive(Debug, Deserialize)]
    struct Body {
        #[allow(dead_code)]
        messages: Vec<String>,
        #[allow(dead_code)]
        temperature: Option<f32>,
        #[allow(dead_code)]
        stream_options: Option<Inner>,
    }

    #[test]
    fn names_wrongly_typed_field() {
        let err = parse_json::<Body>(br#"{"messages": [], "temperature": "hot"}"#).unwrap_err();
        assert!(
            matches!(&err, ApiError::InvalidJson { param: Some(p), .. } if p == "temperature"),
            "{err:?}"
        );
        assert!(err.to_string().contains("temperature"), "{err}");
    }

    #[test]
    fn names_nested_and_missing_fields() {
        let err = parse_json::<Body>(br#"{"messages": ["a", 3]}"#).unwrap_err();
        assert!(
            matches!(&err, ApiError::InvalidJson { param: Some(p), .. } if p == "messages[1]"),
            "{err:?}"
        );
        let err =
            parse_json::<Body>(br#"{"messages": [], "stream_options": {"include_usage": 3}}"#)
                .unwrap_err();
        assert!(
            matches!(&err, ApiError::InvalidJson { param: Some(p), .. } if p == "stream_options.include_usage"),
            "{err:?}"
        );
        let err = parse_json::<Body>(br#"{"temperature": 1}"#).unwrap_err();
        assert_eq!(err, ApiError::MissingField("messages".into()));
    }

    #[test]
    fn malformed_json_and_trailing_garbage() {
        let err = parse_json::<Body>(br#"{"messages": ["#).unwrap_err();
        assert!(matches!(err, ApiError::InvalidJson { param: None, .. }));
        let err = parse_json::<Body>(br#"{"messages": []} x"#).unwrap_err();
        assert!(matches!(err, ApiError::InvalidJson { param: None, .. }));
        let err = parse_json::<Body>(br#"[["a"]]"#).unwrap_err();
        assert!(matches!(err, ApiError::InvalidJson { param: None, .. }));
    }

    #[test]
    fn unknown_fields_are_ignored() {
        assert!(parse_json::<Body>(br#"{"messages": [], "frobnicate": 1}"#).is_ok());
    }
}
