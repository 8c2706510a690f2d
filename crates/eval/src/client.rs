//! One chat completion (or a fill-in-the-middle completion) against any OpenAI-compatible
//! server, non-streamed, greedy by default. Reads the standard fields and, when present, tokenrouter's extensions: tokens
//! by model, switches and per-token details (which model wrote each token), so the same
//! harness scores llama.cpp's or vLLM's server (where the share is then unknown).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// What one request sends.
#[derive(Clone, Debug)]
pub struct RequestSpec {
    pub model: String,
    pub max_tokens: usize,
    pub temperature: f64,
    /// Nucleus sampling (omitted: the server's default, 1).
    pub top_p: Option<f64>,
    pub stop: Vec<String>,
    /// tokenrouter's per-request routing overrides (omitted when empty).
    pub routing: BTreeMap<String, f64>,
    /// Ask for the top-k logprobs of every token (the difficulty score reads them).
    pub top_logprobs: Option<usize>,
    /// Ask for tokenrouter's per-token details.
    pub token_details: bool,
    /// The request's seed.
    pub seed: u64,
}

/// One token of a tokenrouter answer: its text and the model that wrote it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenSource {
    pub text: String,
    pub source: String,
}

/// What came back.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub text: String,
    pub finish_reason: Option<String>,
    pub completion_tokens: u64,
    /// tokenrouter's provenance; `None` from other servers.
    pub tokens_by_model: Option<BTreeMap<String, u64>>,
    pub switches: Option<u64>,
    /// Per-token (text, source) when asked for and served.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<TokenSource>,
    /// Per generated token: the top-k logprobs (natural log), when asked for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top_logprobs: Vec<Vec<f64>>,
    pub latency_s: f64,
}

/// The HTTP side of the harness.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    api_key: Option<String>,
}

impl Client {
    pub fn new(timeout: Duration, api_key: Option<String>) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self { http, api_key })
    }

    /// The API key as a bearer token, when one is set.
    fn with_key(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(k) => req.bearer_auth(k),
            None => req,
        }
    }

    /// `GET {base}/v1/models` → the ids, with the `routed` extension flag when given.
    pub async fn models(&self, base: &str) -> Result<Vec<(String, Option<bool>)>, String> {
        let url = format!("{}/v1/models", api_root(base));
        let resp = self
            .with_key(self.http.get(&url))
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let body: Value = resp.json().await.map_err(|e| format!("{url}: {e}"))?;
        if !status.is_success() {
            return Err(format!("{url}: HTTP {status}: {body}"));
        }
        Ok(body["data"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| Some((m["id"].as_str()?.to_string(), m["routed"].as_bool())))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Empty the server's prefix cache: SGLang's (and ours) `POST /flush_cache`, else vLLM's
    /// `POST /reset_prefix_cache`. `Ok(false)` when the server has neither (llama.cpp).
    pub async fn flush_cache(&self, base: &str) -> Result<bool, String> {
        for path in ["/flush_cache", "/reset_prefix_cache"] {
            let url = format!("{}{path}", api_root(base));
            let resp = self
                .with_key(self.http.post(&url))
                .send()
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            let status = resp.status();
            if status.is_success() {
                return Ok(true);
            }
            if status != reqwest::StatusCode::NOT_FOUND
                && status != reqwest::StatusCode::METHOD_NOT_ALLOWED
            {
                let text = resp.text().await.unwrap_or_default();
                return Err(format!("{url}: HTTP {status}: {}", clip(&text)));
            }
        }
        Ok(false)
    }

    /// Send `messages`; an HTTP or protocol failure is an `Err` with the server's message.
    pub async fn chat(
        &self,
        base: &str,
        messages: &[Value],
        spec: &RequestSpec,
    ) -> Result<Answer, String> {
        let mut body = spec.body();
        body["messages"] = json!(messages);
        if let Some(k) = spec.top_logprobs {
            body["logprobs"] = json!(true);
            body["top_logprobs"] = json!(k);
        }
        self.post(&format!("{}/v1/chat/completions", api_root(base)), body)
            .await
    }

    /// Fill in the middle: `/v1/completions` with `prefix` as the prompt and `suffix` (the
    /// server builds the model's fill-in-the-middle prompt; ours, OpenAI's legacy models).
    pub async fn infill(
        &self,
        base: &str,
        prefix: &str,
        suffix: &str,
        spec: &RequestSpec,
    ) -> Result<Answer, String> {
        let mut body = spec.body();
        body["prompt"] = json!(prefix);
        body["suffix"] = json!(suffix);
        if let Some(k) = spec.top_logprobs {
            body["logprobs"] = json!(k);
        }
        self.post(&format!("{}/v1/completions", api_root(base)), body)
            .await
    }

    async fn post(&self, url: &str, body: Value) -> Result<Answer, String> {
        let start = Instant::now();
        let resp = self
            .with_key(self.http.post(url).json(&body))
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let text = resp.text().await.map_err(|e| format!("{url}: {e}"))?;
        let latency_s = start.elapsed().as_secs_f64();
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| format!("{url}: HTTP {status}, not JSON ({e}): {}", clip(&text)))?;
        if !status.is_success() {
            let msg = v["error"]["message"].as_str().unwrap_or(&text);
            return Err(format!("HTTP {status}: {}", clip(msg)));
        }
        let mut answer = parse_answer(&v)?;
        answer.latency_s = latency_s;
        Ok(answer)
    }
}

impl RequestSpec {
    /// The fields every request carries.
    fn body(&self) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            // Per problem, so seeded random routing draws independent positions per request
            // (greedy decoding does not depend on it).
            "seed": self.seed,
        });
        if let Some(p) = self.top_p {
            body["top_p"] = json!(p);
        }
        if !self.stop.is_empty() {
            body["stop"] = json!(self.stop);
        }
        if !self.routing.is_empty() {
            body["routing"] = json!(self.routing);
        }
        if self.token_details {
            body["return_token_sources"] = json!(true);
        }
        body
    }
}

/// `http://host:port` or `http://host:port/v1` → `http://host:port`.
pub fn api_root(base: &str) -> &str {
    let b = base.trim_end_matches('/');
    b.strip_suffix("/v1").unwrap_or(b)
}

fn clip(s: &str) -> String {
    s.chars().take(300).collect()
}

/// A chat completion body → `Answer` (latency left 0).
pub fn parse_answer(v: &Value) -> Result<Answer, String> {
    let choice = &v["choices"][0];
    if choice.is_null() {
        return Err(format!(
            "no choices in the response: {}",
            clip(&v.to_string())
        ));
    }
    // A chat answer's message, or a completion's text.
    let text = choice["message"]["content"]
        .as_str()
        .or(choice["text"].as_str())
        .unwrap_or("")
        .to_string();
    let tokens: Vec<TokenSource> = choice["token_details"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| {
                    Some(TokenSource {
                        text: t["text"].as_str()?.to_string(),
                        source: t["source"].as_str()?.to_string(),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let chat_top = choice["logprobs"]["content"].as_array().map(|a| {
        a.iter()
            .map(|t| {
                t["top_logprobs"]
                    .as_array()
                    .map(|alts| alts.iter().filter_map(|x| x["logprob"].as_f64()).collect())
                    .unwrap_or_default()
            })
            .collect()
    });
    // Completions' legacy shape: per token a map from token text to logprob.
    let legacy_top = || {
        choice["logprobs"]["top_logprobs"].as_array().map(|a| {
            a.iter()
                .map(|alts| {
                    let mut lps: Vec<f64> = alts
                        .as_object()
                        .map(|m| m.values().filter_map(Value::as_f64).collect())
                        .unwrap_or_default();
                    lps.sort_by(|x, y| y.total_cmp(x));
                    lps
                })
                .collect()
        })
    };
    let top_logprobs = chat_top.or_else(legacy_top).unwrap_or_default();
    let tokens_by_model = v["tokenrouter"]["tokens_by_model"].as_object().map(|m| {
        m.iter()
            .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
            .collect()
    });
    Ok(Answer {
        text,
        finish_reason: choice["finish_reason"].as_str().map(str::to_string),
        completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        tokens_by_model,
        switches: v["tokenrouter"]["switches"].as_u64(),
        tokens,
        top_logprobs,
        latency_s: 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tokenrouter_and_plain_answers() {
        let ours = json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop", "token_details": [{"source": "quick", "text": "h", "logprob": -0.1},
            {"source": "reference", "text": "i", "logprob": -0.2}],
            "logprobs": {"content": [{"token": "h", "logprob": -0.1, "top_logprobs": [{"token": "h", "logprob": -0.1}, {"token": "x", "logprob": -2.5}]}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "tokenrouter": {"tokens_by_model": {"quick": 1, "reference": 1}, "switches": 1}});
        let a = parse_answer(&ours).expect("parse");
        assert_eq!(a.text, "hi");
        assert_eq!(a.completion_tokens, 2);
        assert_eq!(a.tokens_by_model.as_ref().map(|m| m["reference"]), Some(1));
        assert_eq!(a.switches, Some(1));
        assert_eq!(a.tokens[1].source, "reference");
        assert_eq!(a.top_logprobs, vec![vec![-0.1, -2.5]]);
        let plain = json!({"choices": [{"message": {"content": "x"}, "finish_reason": "length"}],
            "usage": {"completion_tokens": 7}});
        let a = parse_answer(&plain).expect("parse");
        assert_eq!((a.tokens_by_model, a.switches), (None, None));
        assert_eq!(a.finish_reason.as_deref(), Some("length"));
        assert!(parse_answer(&json!({"choices": []})).is_err());
        let completion = json!({"choices": [{"text": "    return x", "finish_reason": "stop",
            "logprobs": {"top_logprobs": [{"a": -2.0, "b": -0.5}]}}],
            "usage": {"completion_tokens": 3}});
        let a = parse_answer(&completion).expect("parse");
        assert_eq!(a.text, "    return x");
        assert_eq!(a.top_logprobs, vec![vec![-0.5, -2.0]]);
        assert_eq!(api_root("http://h:1/v1/"), "http://h:1");
    }
}
