//! Engine metrics in Prometheus form: per model step latency, batch size, queue lengths,
//! KV usage and tokens written; routing switches and hand-off latency; the current
//! delayed-batching thresholds. Names carry the `tokenrouter:` prefix and a `model` label.

use prometheus::{
    Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

pub struct EngineMetrics {
    registry: Registry,
    pub step_latency: HistogramVec,
    pub batch_size: HistogramVec,
    pub tokens: IntCounterVec,
    pub switches: IntCounterVec,
    pub handoff_latency: HistogramVec,
    pub running: GaugeVec,
    pub waiting: GaugeVec,
    pub kv_usage: GaugeVec,
    /// Tokens held in a model's KV blocks (SGLang's `num_used_tokens`).
    pub kv_used_tokens: GaugeVec,
    pub prefix_queried: GaugeVec,
    pub prefix_hits: GaugeVec,
    pub threshold: GaugeVec,
    pub predicted_throughput: Gauge,
    pub active: IntGauge,
    pub slow_steps: IntCounterVec,
    pub preemptions: IntCounterVec,
    pub failed_rows: IntCounterVec,
    pub handoff_transport: HistogramVec,
    pub handoff_bytes: HistogramVec,
    pub remote_reconnects: IntCounterVec,
    pub remote_resends: IntCounterVec,
    pub token_masks: HistogramVec,
}

/// Loopback hops take tens of microseconds: finer buckets than the step latencies'.
fn buckets_transport() -> Vec<f64> {
    vec![
        1e-5, 2e-5, 5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 0.1, 1.0,
    ]
}

fn buckets_seconds() -> Vec<f64> {
    vec![
        0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
    ]
}

impl EngineMetrics {
    /// Drop the counts and histograms of requests served so far (the warm-up's); gauges keep
    /// describing the current state.
    pub fn reset_requests(&self) {
        self.step_latency.reset();
        self.batch_size.reset();
        self.tokens.reset();
        self.switches.reset();
        self.handoff_latency.reset();
        self.handoff_transport.reset();
        self.handoff_bytes.reset();
        self.token_masks.reset();
    }

    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let m = |name: &str| format!("tokenrouter:{name}");
        let step_latency = HistogramVec::new(
            HistogramOpts::new(
                m("model_step_latency_seconds"),
                "Duration of one model step",
            )
            .buckets(buckets_seconds()),
            &["model"],
        )?;
        let batch_size = HistogramVec::new(
            HistogramOpts::new(m("model_batch_size"), "Requests per model step")
                .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
            &["model"],
        )?;
        let tokens = IntCounterVec::new(
            Opts::new(
                m("tokens_by_model_total"),
                "Output tokens written by each model",
            ),
            &["model"],
        )?;
        let switches = IntCounterVec::new(
            Opts::new(
                m("switches_total"),
                "Requests handed from one model to another",
            ),
            &["from", "to"],
        )?;
        let handoff_latency = HistogramVec::new(
            HistogramOpts::new(
                m("handoff_latency_seconds"),
                "From a routing decision to the receiver's step that includes the request (for a \
                 hand-off between processes: from its arrival, the queueing part)",
            )
            .buckets(buckets_seconds()),
            &["model"],
        )?;
        let running = GaugeVec::new(
            Opts::new(
                m("model_requests_running"),
                "Requests in a model's running batch",
            ),
            &["model"],
        )?;
        let waiting = GaugeVec::new(
            Opts::new(m("model_requests_waiting"), "Requests queued at a model"),
            &["model"],
        )?;
        let kv_usage = GaugeVec::new(
            Opts::new(m("kv_cache_usage_perc"), "Fraction of KV blocks in use"),
            &["model"],
        )?;
        let kv_used_tokens = GaugeVec::new(
            Opts::new(
                m("kv_cache_used_tokens"),
                "Tokens the KV blocks held by requests can store (whole blocks)",
            ),
            &["model"],
        )?;
        let prefix_queried = GaugeVec::new(
            Opts::new(
                m("prefix_cache_queried_tokens"),
                "Tokens of new sequences looked up in the prefix cache, since the start",
            ),
            &["model"],
        )?;
        let prefix_hits = GaugeVec::new(
            Opts::new(
                m("prefix_cache_hit_tokens"),
                "Tokens of new sequences found in the prefix cache (not recomputed), since the start",
            ),
            &["model"],
        )?;
        let threshold = GaugeVec::new(
            Opts::new(
                m("delayed_batching_threshold"),
                "Current delayed-batching threshold (requests a model waits for)",
            ),
            &["model"],
        )?;
        let predicted_throughput = Gauge::new(
            m("planner_predicted_tokens_per_second"),
            "Throughput the delayed-batching planner predicts for the current thresholds",
        )?;
        let active = IntGauge::new(m("engine_active_requests"), "Requests inside the engine")?;
        let slow_steps = IntCounterVec::new(
            Opts::new(
                m("slow_steps_total"),
                "Steps that exceeded the watchdog deadline (system.step_watchdog_s)",
            ),
            &["model"],
        )?;
        let preemptions = IntCounterVec::new(
            Opts::new(
                m("preemptions_total"),
                "Running requests sent back to the queue for lack of KV blocks (recomputed \
                 when readmitted; vLLM's num_preemptions)",
            ),
            &["model"],
        )?;
        let failed_rows = IntCounterVec::new(
            Opts::new(
                m("failed_requests_total"),
                "Requests a model failed (invalid logits, a failed step, the model going down)",
            ),
            &["model"],
        )?;
        let handoff_transport = HistogramVec::new(
            HistogramOpts::new(
                m("handoff_transport_seconds"),
                "From sending a hand-off to another process to its arrival there (observed by \
                 the receiving process; `model` is the receiver)",
            )
            .buckets(buckets_transport()),
            &["model"],
        )?;
        let handoff_bytes = HistogramVec::new(
            HistogramOpts::new(
                m("handoff_bytes"),
                "Encoded size of a hand-off to a remote sub-server (`first`: the first contact \
                 with the whole request; `delta`: later ones)",
            )
            .buckets(prometheus::exponential_buckets(16.0, 4.0, 10)?),
            &["model", "kind"],
        )?;
        let remote_reconnects = IntCounterVec::new(
            Opts::new(
                m("remote_reconnects_total"),
                "Times the connection to a remote sub-server was re-established",
            ),
            &["model"],
        )?;
        let remote_resends = IntCounterVec::new(
            Opts::new(
                m("remote_first_contact_resends_total"),
                "Requests re-sent in full because the remote had no copy of them",
            ),
            &["model"],
        )?;
        let token_masks = HistogramVec::new(
            HistogramOpts::new(
                m("token_mask_seconds"),
                "Time a step spends on its constrained rows' token masks (structured output; \
                 on a GPU while the step runs)",
            )
            .buckets(buckets_transport()),
            &["model"],
        )?;
        registry.register(Box::new(token_masks.clone()))?;
        registry.register(Box::new(handoff_transport.clone()))?;
        registry.register(Box::new(handoff_bytes.clone()))?;
        registry.register(Box::new(remote_reconnects.clone()))?;
        registry.register(Box::new(remote_resends.clone()))?;
        registry.register(Box::new(step_latency.clone()))?;
        registry.register(Box::new(batch_size.clone()))?;
        registry.register(Box::new(tokens.clone()))?;
        registry.register(Box::new(switches.clone()))?;
        registry.register(Box::new(handoff_latency.clone()))?;
        registry.register(Box::new(running.clone()))?;
        registry.register(Box::new(waiting.clone()))?;
        registry.register(Box::new(kv_usage.clone()))?;
        registry.register(Box::new(kv_used_tokens.clone()))?;
        registry.register(Box::new(prefix_queried.clone()))?;
        registry.register(Box::new(prefix_hits.clone()))?;
        registry.register(Box::new(threshold.clone()))?;
        registry.register(Box::new(predicted_throughput.clone()))?;
        registry.register(Box::new(active.clone()))?;
        registry.register(Box::new(slow_steps.clone()))?;
        registry.register(Box::new(preemptions.clone()))?;
        registry.register(Box::new(failed_rows.clone()))?;
        Ok(Self {
            registry,
            step_latency,
            batch_size,
            tokens,
            switches,
            handoff_latency,
            running,
            waiting,
            kv_usage,
            kv_used_tokens,
            prefix_queried,
            prefix_hits,
            threshold,
            predicted_throughput,
            active,
            slow_steps,
            preemptions,
            failed_rows,
            handoff_transport,
            handoff_bytes,
            remote_reconnects,
            remote_resends,
            token_masks,
        })
    }

    pub fn text(&self) -> String {
        let mut buf = Vec::new();
        let enc = TextEncoder::new();
        if enc.encode(&self.registry.gather(), &mut buf).is_err() {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}
