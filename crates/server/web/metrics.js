// The engine panel: polls `/metrics` and shows, per configured model, the batch size and
// step latency (means over the last poll interval, from the histograms' _sum/_count), queue
// lengths, KV-cache usage and the current delayed-batching threshold.

/**
 * Parses the Prometheus text exposition into `[{ name, labels, value }]` (comments and
 * malformed lines skipped; label values unescaped).
 */
export function parsePrometheus(text) {
  const samples = [];
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    const body = m[3] || "";
    const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
    let l;
    while ((l = re.exec(body))) {
      labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    const value = Number(m[4] === "+Inf" ? Infinity : m[4] === "-Inf" ? -Infinity : m[4]);
    samples.push({ name: m[1], labels, value });
  }
  return samples;
}

/** Value of `name` with `labels ⊆ sample.labels`, summed over matches; undefined if none. */
export function pick(samples, name, labels = {}) {
  let sum;
  for (const s of samples) {
    if (s.name !== name) continue;
    if (Object.entries(labels).some(([k, v]) => s.labels[k] !== v)) continue;
    sum = (sum || 0) + s.value;
  }
  return sum;
}

const P = "tokenrouter:";

/** One row of numbers per model from two consecutive scrapes (`prev` may be null). */
export function modelRows(models, now, prev) {
  return models.map((model) => {
    const l = { model };
    const meanOver = (base) => {
      const sum = pick(now, `${base}_sum`, l);
      const count = pick(now, `${base}_count`, l);
      if (sum === undefined || count === undefined) return { recent: undefined, overall: undefined };
      const overall = count > 0 ? sum / count : undefined;
      let recent;
      if (prev) {
        const dc = count - (pick(prev, `${base}_count`, l) || 0);
        const ds = sum - (pick(prev, `${base}_sum`, l) || 0);
        if (dc > 0) recent = ds / dc;
      }
      return { recent, overall };
    };
    return {
      model,
      batch: meanOver(`${P}model_batch_size`),
      step: meanOver(`${P}model_step_latency_seconds`),
      steps: pick(now, `${P}model_step_latency_seconds_count`, l),
      running: pick(now, `${P}model_requests_running`, l),
      waiting: pick(now, `${P}model_requests_waiting`, l),
      kv: pick(now, `${P}kv_cache_usage_perc`, l),
      threshold: pick(now, `${P}delayed_batching_threshold`, l),
      tokens: pick(now, `${P}tokens_by_model_total`, l),
    };
  });
}

const fmt = {
  num: (v, d = 0) => (v === undefined || !Number.isFinite(v) ? "—" : v.toFixed(d)),
  ms: (v) => (v === undefined ? "—" : v < 0.01 ? `${(v * 1000).toFixed(2)}` : `${(v * 1000).toFixed(1)}`),
  pct: (v) => (v === undefined ? "—" : `${(v * 100).toFixed(1)}%`),
};

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "dataset") Object.assign(e.dataset, v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

/** The live panel inside `root`; call `start()` once the model list is known. */
export class MetricsPanel {
  constructor(root, models, { intervalMs = 1000, fetchText, modelClass }) {
    this.root = root;
    this.models = models;
    this.intervalMs = intervalMs;
    this.fetchText = fetchText;
    this.modelClass = modelClass;
    this.prev = null;
    this.timer = null;
    this.build();
  }

  build() {
    const head = el(
      "tr",
      {},
      el("th", { scope: "col" }, "model"),
      el("th", { scope: "col", title: "Mean requests per step over the last second (all-time mean when idle)" }, "batch"),
      el("th", { scope: "col", title: "Mean step latency over the last second (all-time mean when idle)" }, "step ms"),
      el("th", { scope: "col", title: "Requests in the model's running batch" }, "run"),
      el("th", { scope: "col", title: "Requests queued at the model" }, "wait"),
      el("th", { scope: "col", title: "KV-cache blocks in use" }, "KV"),
      el("th", { scope: "col", title: "Delayed-batching threshold: requests the model waits for before stepping" }, "delay B"),
      el("th", { scope: "col", title: "Output tokens written by the model since start" }, "tokens"),
    );
    this.body = el("tbody");
    this.rows = new Map();
    for (const [i, model] of this.models.entries()) {
      const cells = {};
      const cell = (key) => (cells[key] = el("td", { dataset: { metric: key } }, "—"));
      const name = el("th", { scope: "row" }, el("span", { class: `swatch ${this.modelClass(i)}` }), model);
      const row = el(
        "tr",
        { dataset: { model } },
        name,
        cell("batch"),
        cell("step"),
        cell("running"),
        cell("waiting"),
        cell("kv"),
        cell("threshold"),
        cell("tokens"),
      );
      this.rows.set(model, { row, cells });
      this.body.append(row);
    }
    this.footer = el("p", { class: "metrics-footer" }, "waiting for /metrics…");
    this.root.replaceChildren(
      el("table", { class: "metrics" }, el("thead", {}, head), this.body),
      this.footer,
    );
  }

  start() {
    const tick = async () => {
      if (document.visibilityState !== "hidden") await this.refresh();
      this.timer = setTimeout(tick, this.intervalMs);
    };
    tick();
  }

  async refresh() {
    const text = await this.fetchText();
    if (!text) {
      this.footer.textContent = "/metrics unreachable";
      return;
    }
    const now = parsePrometheus(text);
    const rows = modelRows(this.models, now, this.prev);
    this.prev = now;
    for (const r of rows) {
      const { row, cells: c } = this.rows.get(r.model);
      const pickMean = (m) => (m.recent !== undefined ? m.recent : m.overall);
      c.batch.textContent = fmt.num(pickMean(r.batch), 2);
      c.step.textContent = fmt.ms(pickMean(r.step));
      c.running.textContent = fmt.num(r.running);
      c.waiting.textContent = fmt.num(r.waiting);
      c.kv.textContent = fmt.pct(r.kv);
      c.threshold.textContent = fmt.num(r.threshold);
      c.tokens.textContent = fmt.num(r.tokens);
      // Highlight models that stepped since the previous poll.
      row.classList.toggle("busy", r.batch.recent !== undefined);
    }
    const switches = pick(now, `${P}switches_total`);
    const active = pick(now, `${P}engine_active_requests`);
    const handoffSum = pick(now, `${P}handoff_latency_seconds_sum`);
    const handoffCount = pick(now, `${P}handoff_latency_seconds_count`);
    const predicted = pick(now, `${P}planner_predicted_tokens_per_second`);
    const written = rows.reduce((a, r) => a + (r.tokens || 0), 0);
    const parts = [];
    if (active !== undefined) parts.push(`active requests ${fmt.num(active)}`);
    if (switches !== undefined) parts.push(`switches ${fmt.num(switches)}`);
    if (written > 0 && this.models.length > 1 && rows[0].tokens !== undefined) {
      parts.push(`LLM share ${fmt.pct((written - rows[0].tokens) / written)}`);
    }
    if (handoffCount) parts.push(`hand-off ${fmt.ms(handoffSum / handoffCount)} ms`);
    if (predicted) parts.push(`planner predicts ${fmt.num(predicted, 1)} tok/s`);
    this.footer.textContent = parts.length ? parts.join(" · ") : "no engine metrics on this server";
  }
}
