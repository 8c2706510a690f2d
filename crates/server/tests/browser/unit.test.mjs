// Unit tests of the web view's DOM-free logic (SSE parsing, Prometheus parsing, token
// counters), run by Node against the very files the server embeds:
//   node --experimental-detect-module --test unit.test.mjs
import assert from "node:assert/strict";
import test from "node:test";

import { SseParser } from "../../web/api.js";
import { TokenStats } from "../../web/answer.js";
import { modelRows, parsePrometheus, pick } from "../../web/metrics.js";
import { visibleText } from "../../web/tooltip.js";

test("SSE payloads survive arbitrary splits, CRLF, comments and multi-line data", () => {
  const body = 'data: {"a":1}\n\n: keep-alive\n\ndata: {"b":\r\ndata: 2}\r\n\r\ndata:[DONE]\n\n';
  for (let cut = 0; cut <= body.length; cut++) {
    for (const step of [1, 3, 7]) {
      const p = new SseParser();
      const out = [...p.push(body.slice(0, cut))];
      for (let i = cut; i < body.length; i += step) out.push(...p.push(body.slice(i, i + step)));
      out.push(...p.end());
      assert.deepEqual(out, ['{"a":1}', '{"b":\n2}', "[DONE]"], `cut ${cut} step ${step}`);
    }
  }
});

test("an unterminated last event is delivered by end()", () => {
  const p = new SseParser();
  assert.deepEqual(p.push("data: x"), []);
  assert.deepEqual(p.end(), ["x"]);
});

const EXPOSITION = `# HELP tokenrouter:model_batch_size Requests per model step
# TYPE tokenrouter:model_batch_size histogram
tokenrouter:model_batch_size_bucket{model="small",le="1"} 3
tokenrouter:model_batch_size_sum{model="small"} 10
tokenrouter:model_batch_size_count{model="small"} 4
tokenrouter:model_step_latency_seconds_sum{model="small"} 0.2
tokenrouter:model_step_latency_seconds_count{model="small"} 4
tokenrouter:kv_cache_usage_perc{model="small"} 0.25
tokenrouter:model_requests_waiting{model="large"} 2
tokenrouter:delayed_batching_threshold{model="large"} 3
tokenrouter:switches_total{from="large",to="small"} 5
tokenrouter:switches_total{from="small",to="large"} 6
weird{label="a \\"quoted\\" value"} +Inf
`;

test("Prometheus text is parsed with labels, escapes and special values", () => {
  const s = parsePrometheus(EXPOSITION);
  assert.equal(pick(s, "tokenrouter:switches_total"), 11);
  assert.equal(pick(s, "tokenrouter:switches_total", { from: "small" }), 6);
  assert.equal(pick(s, "tokenrouter:kv_cache_usage_perc", { model: "large" }), undefined);
  const weird = s.find((x) => x.name === "weird");
  assert.equal(weird.labels.label, 'a "quoted" value');
  assert.equal(weird.value, Infinity);
});

test("per-model rows: all-time means, then means over the last interval", () => {
  const before = parsePrometheus(EXPOSITION);
  const [small, large] = modelRows(["small", "large"], before, null);
  assert.equal(small.batch.overall, 2.5);
  assert.equal(small.batch.recent, undefined);
  assert.equal(small.step.overall, 0.05);
  assert.equal(small.kv, 0.25);
  assert.equal(large.waiting, 2);
  assert.equal(large.threshold, 3);
  assert.equal(large.batch.overall, undefined);
  const after = parsePrometheus(
    EXPOSITION.replace('size_sum{model="small"} 10', 'size_sum{model="small"} 16').replace(
      'size_count{model="small"} 4',
      'size_count{model="small"} 6',
    ),
  );
  const [small2] = modelRows(["small", "large"], after, before);
  assert.equal(small2.batch.recent, 3);
});

test("token counters: per model, LLM share, switches, TTFT and speed", () => {
  const s = new TokenStats(["small", "large"]);
  s.sent(1000);
  s.add(["small", "small"], 1100);
  s.add(["large"], 1150);
  s.add(["small", "large", "large"], 1300);
  s.ended(1310);
  assert.equal(s.total, 6);
  assert.equal(s.byModel.get("small"), 3);
  assert.equal(s.byModel.get("large"), 3);
  assert.equal(s.llmShare, 0.5);
  assert.equal(s.switches, 3);
  assert.equal(s.ttft, 0.1);
  assert.equal(s.tokensPerSecond, 6 / 0.3);
  assert.equal(s.elapsed(99999), 0.31);
});

test("token text is shown with visible whitespace", () => {
  assert.equal(visibleText(" a\n\tb"), "␣a↵⇥b");
  assert.equal(visibleText(""), "(no visible text)");
});
