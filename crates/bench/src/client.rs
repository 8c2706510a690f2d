//! One streamed request: send it, read the server-sent events, time every content chunk and read the
//! final usage chunk (and tokenrouter's provenance field when present). Failures are recorded in the
//! returned record, never raised.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

/// Outcome of one request (one row of `requests.csv`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestRecord {
    /// Position in the request list.
    pub index: usize,
    /// Index of the prompt in the dataset.
    pub prompt_index: usize,
    /// Which repetition of the prompt (0-based).
    pub repeat: usize,
    /// Send time, ms since the benchmark started.
    pub start_ms: f64,
    /// Completed with `[DONE]` after a 2xx status.
    pub success: bool,
    /// Why the request failed.
    pub error: Option<String>,
    pub http_status: Option<u16>,
    pub prompt_tokens: Option<u64>,
    /// From the usage chunk, or the number of content chunks when the server sent no usage.
    pub output_tokens: u64,
    /// Whether `output_tokens` came from the server's usage.
    pub usage_reported: bool,
    /// Time to the first non-empty content.
    pub ttft_ms: Option<f64>,
    /// (e2e − ttft) / (output_tokens − 1).
    pub tpot_ms: Option<f64>,
    /// Time to `[DONE]` (or to the failure).
    pub e2e_ms: f64,
    /// Gaps between consecutive content chunks.
    pub itl_ms: Vec<f64>,
    /// Number of chunks with non-empty content.
    pub chunks: u64,
    pub finish_reason: Option<String>,
    /// tokenrouter provenance: tokens written by each model.
    pub tokens_by_model: Option<BTreeMap<String, u64>>,
    /// tokenrouter provenance: model switches in this request.
    pub switches: Option<u64>,
}

/// Incremental parser of `text/event-stream` bodies: yields the payload of every `data:` line.
/// OpenAI-compatible servers put one JSON object per `data:` line, so each line is one event.
#[derive(Debug, Default)]
pub(crate) struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<String>) {
        self.buf.extend_from_slice(bytes);
        let mut consumed = 0;
        while let Some(pos) = self.buf[consumed..].iter().position(|&b| b == b'\n') {
            let line = &self.buf[consumed..consumed + pos];
            Self::line(line, out);
            consumed += pos + 1;
        }
        self.buf.drain(..consumed);
    }

    /// Flushes a last line that had no newline.
    pub fn finish(&mut self, out: &mut Vec<String>) {
        let rest = std::mem::take(&mut self.buf);
        Self::line(&rest, out);
    }

    fn line(line: &[u8], out: &mut Vec<String>) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(data) = line.strip_prefix(b"data:") {
            let data = data.strip_prefix(b" ").unwrap_or(data);
            out.push(String::from_utf8_lossy(data).into_owned());
        }
    }
}

/// Accumulates the measurements of one response.
struct Reader {
    t0: Instant,
    rec: RequestRecord,
    last_content: Option<Instant>,
    done: bool,
}

fn content_of(choice: &Value) -> Option<&str> {
    if let Some(delta) = choice.get("delta") {
        for key in ["content", "reasoning_content", "reasoning"] {
            if let Some(s) = delta.get(key).and_then(Value::as_str) {
                if !s.is_empty() {
                    return Some(s);
                }
            }
        }
        return None;
    }
    if let Some(s) = choice.get("text").and_then(Value::as_str) {
        return Some(s);
    }
    choice
        .get("message")
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
}

impl Reader {
    fn ms(&self, t: Instant) -> f64 {
        t.duration_since(self.t0).as_secs_f64() * 1000.0
    }

    /// Handles one event payload; `Err` means the request failed.
    fn event(&mut self, data: &str) -> Result<(), String> {
        let data = data.trim();
        if data.is_empty() {
            return Ok(());
        }
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| format!("invalid JSON chunk ({e}): {}", truncate(data, 120)))?;
        self.chunk(&v)
    }

    fn chunk(&mut self, v: &Value) -> Result<(), String> {
        if let Some(err) = v.get("error") {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            return Err(format!("server error in stream: {msg}"));
        }
        let now = Instant::now();
        for choice in v
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if content_of(choice).is_some_and(|s| !s.is_empty()) {
                self.rec.chunks += 1;
                match self.last_content {
                    None => self.rec.ttft_ms = Some(self.ms(now)),
                    Some(prev) => self
                        .rec
                        .itl_ms
                        .push(now.duration_since(prev).as_secs_f64() * 1000.0),
                }
                self.last_content = Some(now);
            }
            if let Some(fr) = choice.get("finish_reason").and_then(Value::as_str) {
                self.rec.finish_reason = Some(fr.to_string());
            }
        }
        if let Some(usage) = v.get("usage").filter(|u| u.is_object()) {
            if let Some(n) = usage.get("completion_tokens").and_then(Value::as_u64) {
                self.rec.output_tokens = n;
                self.rec.usage_reported = true;
            }
            if let Some(n) = usage.get("prompt_tokens").and_then(Value::as_u64) {
                self.rec.prompt_tokens = Some(n);
            }
        }
        if let Some(tr) = v.get("tokenrouter") {
            if let Some(map) = tr.get("tokens_by_model").and_then(Value::as_object) {
                let by_model = map
                    .iter()
                    .filter_map(|(k, n)| n.as_u64().map(|n| (k.clone(), n)))
                    .collect();
                self.rec.tokens_by_model = Some(by_model);
            }
            if let Some(s) = tr.get("switches").and_then(Value::as_u64) {
                self.rec.switches = Some(s);
            }
        }
        Ok(())
    }

    fn finish(mut self, failure: Option<String>) -> RequestRecord {
        let end = Instant::now();
        self.rec.e2e_ms = self.ms(end);
        if !self.rec.usage_reported {
            self.rec.output_tokens = self.rec.chunks;
        }
        let failure =
            failure.or_else(|| (!self.done).then(|| "stream ended before [DONE]".to_string()));
        self.rec.success = failure.is_none();
        self.rec.error = failure;
        if let Some(ttft) = self.rec.ttft_ms {
            if self.rec.output_tokens > 1 {
                self.rec.tpot_ms =
                    Some((self.rec.e2e_ms - ttft) / (self.rec.output_tokens - 1) as f64);
            }
        }
        self.rec
    }
}

/// An error and its sources, e.g. "error sending request: connection refused".
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Sends `body` to `url` and measures the streamed answer. `rec` carries the identifying fields.
pub(crate) async fn execute(
    client: &reqwest::Client,
    url: &str,
    api_key: Option<&str>,
    body: &Value,
    timeout: Duration,
    rec: RequestRecord,
) -> RequestRecord {
    let mut reader = Reader {
        t0: Instant::now(),
        rec,
        last_content: None,
        done: false,
    };
    let result = tokio::time::timeout(
        timeout,
        stream_into(client, url, api_key, body, &mut reader),
    )
    .await
    .unwrap_or_else(|_| Err(format!("timed out after {:.0} s", timeout.as_secs_f64())));
    reader.finish(result.err())
}

async fn stream_into(
    client: &reqwest::Client,
    url: &str,
    api_key: Option<&str>,
    body: &Value,
    reader: &mut Reader,
) -> Result<(), String> {
    let mut req = client.post(url).json(body);
    if let Some(key) = api_key {
        req = req.bearer_auth(key);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| format!("request failed: {}", chain(&e)))?;
    let status = resp.status();
    reader.rec.http_status = Some(status.as_u16());
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!(
            "HTTP {}: {}",
            status.as_u16(),
            truncate(text.trim(), 200)
        ));
    }
    let is_json = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        // A server that ignored `stream: true`: one whole response, TTFT = e2e.
        let v: Value = resp
            .json()
            .await
            .map_err(|e| format!("invalid JSON response: {e}"))?;
        reader.chunk(&v)?;
        reader.done = true;
        return Ok(());
    }
    let mut parser = SseParser::default();
    let mut events = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(item) = stream.next().await {
        let bytes = item.map_err(|e| format!("stream error: {}", chain(&e)))?;
        parser.push(&bytes, &mut events);
        for data in events.drain(..) {
            reader.event(&data)?;
        }
        if reader.done {
            return Ok(());
        }
    }
    parser.finish(&mut events);
    for data in events.drain(..) {
        reader.event(&data)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_lines_split_across_chunks() {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        p.push(b"data: {\"a\"", &mut out);
        assert!(out.is_empty());
        p.push(b":1}\r\n\r\n: comment\nevent: x\ndata:[DONE]", &mut out);
        assert_eq!(out, vec!["{\"a\":1}".to_string()]);
        p.finish(&mut out);
        assert_eq!(out[1], "[DONE]");
    }

    fn reader() -> Reader {
        Reader {
            t0: Instant::now(),
            rec: RequestRecord::default(),
            last_content: None,
            done: false,
        }
    }

    #[test]
    fn usage_and_provenance_are_read() {
        let mut r = reader();
        r.event(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#)
            .expect("ok");
        r.event(r#"{"choices":[{"delta":{"content":"Hi"}}]}"#)
            .expect("ok");
        r.event(r#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#)
            .expect("ok");
        r.event(r#"{"choices":[{"delta":{},"finish_reason":"length"}]}"#)
            .expect("ok");
        r.event(
            r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":7},
               "tokenrouter":{"tokens_by_model":{"quick":5,"reference":2},"switches":3}}"#,
        )
        .expect("ok");
        r.event("[DONE]").expect("ok");
        let rec = r.finish(None);
        assert!(rec.success);
        assert_eq!(rec.chunks, 2);
        assert_eq!(rec.itl_ms.len(), 1);
        assert_eq!(rec.output_tokens, 7);
        assert_eq!(rec.prompt_tokens, Some(4));
        assert_eq!(rec.finish_reason.as_deref(), Some("length"));
        assert_eq!(rec.switches, Some(3));
        let by = rec.tokens_by_model.expect("provenance");
        assert_eq!((by["quick"], by["reference"]), (5, 2));
        assert!(rec.tpot_ms.is_some() && rec.ttft_ms.is_some());
    }

    #[test]
    fn missing_done_or_usage() {
        let mut r = reader();
        r.event(r#"{"choices":[{"text":"a"}]}"#).expect("ok");
        r.event(r#"{"choices":[{"text":"b"}]}"#).expect("ok");
        let rec = r.finish(None);
        assert!(!rec.success);
        assert_eq!(rec.error.as_deref(), Some("stream ended before [DONE]"));
        assert_eq!(rec.output_tokens, 2, "falls back to counting chunks");
        assert!(!rec.usage_reported);
    }

    #[test]
    fn errors_in_stream_fail_the_request() {
        let mut r = reader();
        let err = r
            .event(r#"{"error":{"message":"overloaded"}}"#)
            .expect_err("error");
        assert!(err.contains("overloaded"));
        assert!(r.event("{not json").is_err());
        assert_eq!(truncate("abcdef", 3), "abc…");
    }
}
