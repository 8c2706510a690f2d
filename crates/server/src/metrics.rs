//! The server's own Prometheus metrics (vLLM-like names with the `tokenrouter:` prefix and a
//! `model` label = the requested model name, e.g. `tokenrouter` or a pinned `quick`).
//! `/metrics` serves these after the engine's own exposition (`Backend::metrics_text`),
//! which owns the routing metrics (LLM share, switches, hand-off latency, batch sizes, KV).
//! Names owned here: `http_requests_total`, `request_success_total`,
//! `requests_aborted_total`, `prompt_tokens_total`, `generation_tokens_total`,
//! `time_to_first_token_seconds`, `time_per_output_token_seconds`,
//! `e2e_request_latency_seconds`, `num_requests_running`.

use std::time::Instant;
use tokenrouter_api::ModelLoad;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
];
const TPOT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0,
];

/// All server-side metrics, registered in a private registry.
pub struct Metrics {
    registry: Registry,
    pub http_requests: IntCounterVec,
    request_success: IntCounterVec,
    requests_aborted: IntCounterVec,
    prompt_tokens: IntCounterVec,
    generation_tokens: IntCounterVec,
    ttft: HistogramVec,
    tpot: HistogramVec,
    e2e: HistogramVec,
    running: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(format!("tokenrouter:{name}"), help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok::<_, prometheus::Error>(c)
        };
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            let opts =
                HistogramOpts::new(format!("tokenrouter:{name}"), help).buckets(buckets.to_vec());
            let h = HistogramVec::new(opts, &["model"])?;
            registry.register(Box::new(h.clone()))?;
            Ok::<_, prometheus::Error>(h)
        };
        let running = IntGaugeVec::new(
            Opts::new(
                "tokenrouter:num_requests_running",
                "Generation requests in flight in the HTTP layer.",
            ),
            &["model"],
        )?;
        registry.register(Box::new(running.clone()))?;
        Ok(Self {
            http_requests: counter(
                "http_requests_total",
                "HTTP responses by route and status code.",
                &["path", "status"],
            )?,
            request_success: counter(
                "request_success_total",
                "Finished choices by finish reason.",
                &["model", "finished_reason"],
            )?,
            requests_aborted: counter(
                "requests_aborted_total",
                "Requests that ended without finishing (client_disconnect, shutdown, error, cancelled).",
                &["model", "reason"],
            )?,
            prompt_tokens: counter(
                "prompt_tokens_total",
                "Prompt tokens of submitted requests.",
                &["model"],
            )?,
            generation_tokens: counter("generation_tokens_total", "Generated tokens.", &["model"])?,
            ttft: histogram(
                "time_to_first_token_seconds",
                "Time from request arrival to its first generated token.",
                TTFT_BUCKETS,
            )?,
            tpot: histogram(
                "time_per_output_token_seconds",
                "Mean time between generated tokens of a request after the first.",
                TPOT_BUCKETS,
            )?,
            e2e: histogram(
                "e2e_request_latency_seconds",
                "Time from request arrival to its last token.",
                E2E_BUCKETS,
            )?,
            running,
            registry,
        })
    }

    /// Text exposition of the server's metrics.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(error = %e, "could not encode metrics");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// The load gauges under vLLM's and SGLang's own names, which load-aware routers (vLLM's
/// production stack, the Gateway API inference extension, SGLang's router) and autoscalers
/// read: requests running and queued, summed over the models, and KV usage, the fullest
/// model's; labelled with the served model name as vLLM labels them.
pub fn load_text(load: &[ModelLoad], served_name: &str) -> String {
    if load.is_empty() {
        return String::new();
    }
    let running: usize = load.iter().map(|m| m.running).sum();
    let waiting: usize = load.iter().map(|m| m.waiting).sum();
    let kv = load.iter().map(|m| m.kv_usage).fold(0.0, f64::max);
    let tokens: usize = load.iter().map(|m| m.kv_tokens).sum();
    let name = served_name.replace('\\', "\\\\").replace('"', "\\\"");
    let (running, waiting, kv, tokens) = (
        running.to_string(),
        waiting.to_string(),
        kv.to_string(),
        tokens.to_string(),
    );
    let busy = "Requests in the models' running batches.";
    let queued = "Requests queued at the models.";
    let full = "KV-cache usage of the fullest model (1 = full).";
    let gauges = [
        ("vllm:num_requests_running", busy, &running),
        ("vllm:num_requests_waiting", queued, &waiting),
        ("vllm:kv_cache_usage_perc", full, &kv),
        (
            "vllm:gpu_cache_usage_perc",
            "vLLM's older name of kv_cache_usage_perc.",
            &kv,
        ),
        ("sglang:num_running_reqs", busy, &running),
        ("sglang:num_queue_reqs", queued, &waiting),
        ("sglang:token_usage", full, &kv),
        (
            "sglang:num_used_tokens",
            "Tokens the models' KV blocks in use hold.",
            &tokens,
        ),
    ];
    let mut out = String::new();
    for (metric, help, value) in gauges {
        out.push_str(&format!(
            "# HELP {metric} {help}\n# TYPE {metric} gauge\n{metric}{{model_name=\"{name}\"}} {value}\n"
        ));
    }
    out
}

/// Follows one generation request; dropping it unfinished counts an abort (a client that
/// disconnected drops the response, and this with it).
pub struct RequestTracker {
    metrics: std::sync::Arc<Metrics>,
    model: String,
    start: Instant,
    first_token: Option<Instant>,
    tokens: usize,
    ended: bool,
}

impl RequestTracker {
    pub fn start(
        metrics: std::sync::Arc<Metrics>,
        model: &str,
        start: Instant,
        prompt_tokens: usize,
    ) -> Self {
        metrics.running.with_label_values(&[model]).inc();
        metrics
            .prompt_tokens
            .with_label_values(&[model])
            .inc_by(prompt_tokens as u64);
        Self {
            metrics,
            model: model.to_string(),
            start,
            first_token: None,
            tokens: 0,
            ended: false,
        }
    }

    /// Records `count` more generated tokens.
    pub fn on_tokens(&mut self, count: usize) {
        if count == 0 {
            return;
        }
        if self.first_token.is_none() {
            let now = Instant::now();
            self.first_token = Some(now);
            self.metrics
                .ttft
                .with_label_values(&[&self.model])
                .observe((now - self.start).as_secs_f64());
        }
        self.tokens += count;
        self.metrics
            .generation_tokens
            .with_label_values(&[&self.model])
            .inc_by(count as u64);
    }

    /// One choice finished with `reason` ("stop" / "length").
    pub fn on_choice_finished(&self, reason: &str) {
        self.metrics
            .request_success
            .with_label_values(&[&self.model, reason])
            .inc();
    }

    /// The whole request finished normally.
    pub fn finish(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        let now = Instant::now();
        let model = [self.model.as_str()];
        self.metrics
            .e2e
            .with_label_values(&model)
            .observe((now - self.start).as_secs_f64());
        if let (Some(first), true) = (self.first_token, self.tokens > 1) {
            let per_token = (now - first).as_secs_f64() / (self.tokens - 1) as f64;
            self.metrics
                .tpot
                .with_label_values(&model)
                .observe(per_token);
        }
    }

    /// The request ended early for `reason` (shutdown, error).
    pub fn abort(&mut self, reason: &str) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.metrics
            .requests_aborted
            .with_label_values(&[&self.model, reason])
            .inc();
    }
}

impl Drop for RequestTracker {
    fn drop(&mut self) {
        self.abort("client_disconnect");
        self.metrics.running.with_label_values(&[&self.model]).dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn tracker_records_tokens_and_disconnects() {
        let metrics = Arc::new(Metrics::new().unwrap());
        {
            let mut t = RequestTracker::start(metrics.clone(), "tokenrouter", Instant::now(), 7);
            t.on_tokens(3);
            t.on_choice_finished("stop");
            t.finish();
        }
        {
            let mut t = RequestTracker::start(metrics.clone(), "quick", Instant::now(), 2);
            t.on_tokens(1);
        }
        let text = metrics.render();
        assert!(
            text.contains("tokenrouter:prompt_tokens_total{model=\"tokenrouter\"} 7"),
            "{text}"
        );
        assert!(text.contains("tokenrouter:generation_tokens_total{model=\"tokenrouter\"} 3"));
        assert!(text.contains(
            "tokenrouter:request_success_total{finished_reason=\"stop\",model=\"tokenrouter\"} 1"
        ));
        assert!(text.contains(
            "tokenrouter:requests_aborted_total{model=\"quick\",reason=\"client_disconnect\"} 1"
        ));
        assert!(text.contains("tokenrouter:num_requests_running{model=\"quick\"} 0"));
        assert!(text
            .contains("tokenrouter:time_per_output_token_seconds_count{model=\"tokenrouter\"} 1"));
        assert!(
            text.contains("tokenrouter:e2e_request_latency_seconds_count{model=\"tokenrouter\"} 1")
        );
    }

    #[test]
    fn load_is_told_under_vllm_and_sglang_names() {
        let load = |name: &str, running, waiting, kv_usage| ModelLoad {
            name: name.into(),
            running,
            waiting,
            kv_usage,
            kv_tokens: running * 16,
        };
        let text = load_text(
            &[load("quick", 3, 1, 0.25), load("reference", 2, 4, 0.5)],
            "my \"model\"",
        );
        for line in [
            r#"vllm:num_requests_running{model_name="my \"model\""} 5"#,
            r#"vllm:num_requests_waiting{model_name="my \"model\""} 5"#,
            r#"vllm:kv_cache_usage_perc{model_name="my \"model\""} 0.5"#,
            r#"vllm:gpu_cache_usage_perc{model_name="my \"model\""} 0.5"#,
            r#"sglang:num_running_reqs{model_name="my \"model\""} 5"#,
            r#"sglang:num_queue_reqs{model_name="my \"model\""} 5"#,
            r#"sglang:token_usage{model_name="my \"model\""} 0.5"#,
            r#"sglang:num_used_tokens{model_name="my \"model\""} 80"#,
            "# TYPE vllm:num_requests_waiting gauge",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        assert_eq!(load_text(&[], "x"), "", "a backend that tells no load");
    }
}
