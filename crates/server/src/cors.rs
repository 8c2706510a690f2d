//! Cross-origin policy. Off by default: without `Access-Control-Allow-Origin` a page on
//! another origin cannot read our responses, which is the safe default for a server that
//! may hold an API key. `--allowed-origins` opens it for named origins (or `*`), parsed
//! once at start-up so a bad origin is a start-up error, never a per-request one.

use axum::http::{header, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::error::ServerError;

#[derive(Clone, Debug, Default, PartialEq)]
pub enum CorsPolicy {
    /// No CORS headers.
    #[default]
    Off,
    /// Every origin (`*`); credentials are not allowed then, as the CORS rules require.
    Any,
    /// These exact origins.
    Origins(Vec<HeaderValue>),
}

impl CorsPolicy {
    /// From the command line's list: empty → off, `*` anywhere → any, else exact origins
    /// (`scheme://host[:port]`, no path).
    pub fn parse<S: AsRef<str>>(origins: &[S]) -> Result<Self, ServerError> {
        let origins: Vec<&str> = origins
            .iter()
            .flat_map(|o| o.as_ref().split(','))
            .map(str::trim)
            .filter(|o| !o.is_empty())
            .collect();
        if origins.is_empty() {
            return Ok(Self::Off);
        }
        if origins.contains(&"*") {
            return Ok(Self::Any);
        }
        origins
            .into_iter()
            .map(|o| {
                let (scheme, rest) = o.split_once("://").unwrap_or(("", ""));
                let valid = matches!(scheme, "http" | "https")
                    && !rest.is_empty()
                    && !rest.contains('/')
                    && !o.chars().any(char::is_whitespace);
                match HeaderValue::from_str(o) {
                    Ok(v) if valid => Ok(v),
                    _ => Err(ServerError::CorsOrigin(o.chars().take(64).collect())),
                }
            })
            .collect::<Result<_, _>>()
            .map(Self::Origins)
    }

    pub(crate) fn layer(&self) -> Option<CorsLayer> {
        let allow = match self {
            Self::Off => return None,
            Self::Any => AllowOrigin::any(),
            Self::Origins(list) => AllowOrigin::list(list.iter().cloned()),
        };
        Some(
            CorsLayer::new()
                .allow_origin(allow)
                .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
                .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE, header::ACCEPT])
                .max_age(std::time::Duration::from_secs(600)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_command_line_forms() {
        assert_eq!(CorsPolicy::parse::<&str>(&[]).ok(), Some(CorsPolicy::Off));
        assert_eq!(CorsPolicy::parse(&[" "]).ok(), Some(CorsPolicy::Off));
        assert_eq!(
            CorsPolicy::parse(&["https://a.example", "*"]).ok(),
            Some(CorsPolicy::Any)
        );
        assert_eq!(
            CorsPolicy::parse(&["https://a.example,http://localhost:3000"]).ok(),
            Some(CorsPolicy::Origins(vec![
                HeaderValue::from_static("https://a.example"),
                HeaderValue::from_static("http://localhost:3000"),
            ]))
        );
        for bad in [
            "a.example",
            "https://",
            "https://a.example/path",
            "ftp://a",
            "https://a\u{7f}",
        ] {
            assert!(
                matches!(CorsPolicy::parse(&[bad]), Err(ServerError::CorsOrigin(_))),
                "{bad}"
            );
        }
    }
}
