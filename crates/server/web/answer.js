// One answer being streamed: a card with the text, one span per token coloured and
// underlined by the model that wrote it, and live counters (tokens per model, LLM share,
// switches, tokens/s, time to first token, total time).
//
// The DOM doubles as the test surface: each token span carries `data-source` (model
// name), `data-i` (position), `data-logprob` and, when present, `data-router-score`; the
// card carries `data-state`, `data-request` (the JSON body sent) and, once finished,
// `data-sources` (all sources in order), `data-chunks` (streamed chunks that carried
// tokens) and `data-server-provenance` (the server's own `tokenrouter` counts from the
// final chunk).

/** Counters over one answer's tokens, independent of the DOM. */
export class TokenStats {
  constructor(models) {
    this.models = models;
    this.byModel = new Map(models.map((m) => [m, 0]));
    this.total = 0;
    this.switches = 0;
    this.last = null;
    this.tSend = null;
    this.tFirst = null;
    this.tLast = null;
    this.tEnd = null;
  }

  sent(t) {
    this.tSend = t;
  }

  /** Records the tokens of one chunk that arrived at time `t` (ms). */
  add(sources, t) {
    if (!sources.length) return;
    if (this.tFirst === null) this.tFirst = t;
    this.tLast = t;
    for (const s of sources) {
      this.byModel.set(s, (this.byModel.get(s) || 0) + 1);
      if (this.last !== null && this.last !== s) this.switches += 1;
      this.last = s;
      this.total += 1;
    }
  }

  ended(t) {
    this.tEnd = t;
  }

  /** Share of tokens written by models other than the first (entry) model. */
  get llmShare() {
    if (!this.total) return undefined;
    return (this.total - (this.byModel.get(this.models[0]) || 0)) / this.total;
  }

  /** Time to first token, seconds. */
  get ttft() {
    return this.tFirst === null || this.tSend === null ? undefined : (this.tFirst - this.tSend) / 1000;
  }

  /**
   * Tokens per second from sending to the latest token (the request's own throughput, as
   * the paper measures it; robust to chunks that the browser delivers together).
   */
  get tokensPerSecond() {
    if (this.tSend === null || this.tLast === null || this.tLast <= this.tSend) return undefined;
    return this.total / ((this.tLast - this.tSend) / 1000);
  }

  /** Time from sending to the end (or to now while streaming), seconds. */
  elapsed(now) {
    if (this.tSend === null) return undefined;
    return ((this.tEnd ?? now) - this.tSend) / 1000;
  }
}

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

const f2 = (v, unit = "", d = 2) => (v === undefined || !Number.isFinite(v) ? "—" : `${v.toFixed(d)}${unit}`);

/** A streamed answer card inside `parent`. */
export class AnswerCard {
  /**
   * @param parent  container element
   * @param opts    { title, model (request `model` field), models (configured names),
   *                  modelClass (index → CSS class), kind ("routed" | "pinned") }
   */
  constructor(parent, { title, model, models, modelClass, kind }) {
    this.models = models;
    this.modelClass = modelClass;
    this.stats = new TokenStats(models);
    this.sources = [];
    this.text = "";
    this.chunks = 0;
    this.root = el("article", { class: `card ${kind}`, dataset: { model, kind, state: "waiting" } });
    this.stateEl = el("span", { class: "card-state" }, "waiting");
    this.root.append(
      el("header", {}, el("h3", {}, title), el("code", { class: "card-model" }, model), this.stateEl),
    );
    this.answer = el("div", { class: "answer", dataset: { testid: "answer" } });
    this.answer.setAttribute("aria-live", "polite");
    this.bar = el("div", { class: "share-bar", "aria-hidden": "true" });
    this.barParts = models.map((m, i) => {
      const part = el("span", { class: `share ${modelClass(i)}`, title: m });
      this.bar.append(part);
      return part;
    });
    this.counters = el("dl", { class: "stats" });
    this.cells = {};
    const stat = (key, label, title, extra = {}) => {
      const dd = el("dd", { dataset: { stat: key, ...extra } }, "—");
      this.cells[key + (extra.model ? `:${extra.model}` : "")] = dd;
      this.counters.append(el("div", { title }, el("dt", {}, label), dd));
    };
    models.forEach((m, i) => {
      const dt = el("dt", {}, el("span", { class: `swatch ${modelClass(i)}` }), m);
      const dd = el("dd", { dataset: { stat: "tokens", model: m } }, "0");
      this.cells[`tokens:${m}`] = dd;
      this.counters.append(el("div", { title: `tokens written by ${m}` }, dt, dd));
    });
    stat("llm-share", "LLM share", `share of tokens not written by ${models[0] ?? "the entry model"}`);
    stat("switches", "switches", "changes of model between consecutive tokens");
    stat("tps", "tokens/s", "tokens per second from sending to the last token");
    stat("ttft", "TTFT", "time to first token");
    stat("time", "time", "time from sending to the last token");
    this.note = el("p", { class: "card-note" });
    this.root.append(this.answer, this.bar, this.counters, this.note);
    parent.append(this.root);
    this.timer = null;
  }

  setState(state, label = state) {
    this.root.dataset.state = state;
    this.stateEl.textContent = label;
  }

  /** The request is about to be sent. */
  start(requestBody, t) {
    this.root.dataset.request = JSON.stringify(requestBody);
    this.stats.sent(t);
    this.setState("streaming", "streaming…");
    this.timer = setInterval(() => this.render(performance.now()), 100);
  }

  /**
   * Adds the tokens of one streamed choice delta. `details` are the chunk's
   * `token_details` ([{source, text, logprob, router_score}]); when a server predates the
   * per-token `text`, the delta's whole content goes to its last token.
   */
  addDelta(content, details, t) {
    if (!details || !details.length) {
      if (content) this.appendSpan(content, null, {});
      return;
    }
    this.chunks += 1;
    const hasText = details.every((d) => typeof d.text === "string");
    details.forEach((d, k) => {
      const text = hasText ? d.text : k === details.length - 1 ? content || "" : "";
      this.appendSpan(text, d.source, d);
    });
    this.stats.add(
      details.map((d) => d.source),
      t,
    );
    this.render(t);
  }

  appendSpan(text, source, detail) {
    this.text += text;
    if (source === null) {
      this.answer.append(document.createTextNode(text));
      return;
    }
    const i = this.sources.length;
    this.sources.push(source);
    const m = this.models.indexOf(source);
    const span = el("span", {
      class: `tok ${this.modelClass(m)}${text === "" ? " empty" : ""}`,
      dataset: { source, i: String(i), m: String(m), logprob: String(detail.logprob) },
    });
    if (detail.router_score !== null && detail.router_score !== undefined) {
      span.dataset.routerScore = String(detail.router_score);
    }
    span.textContent = text;
    this.answer.append(span);
  }

  render(now) {
    const s = this.stats;
    this.models.forEach((m, i) => {
      const n = s.byModel.get(m) || 0;
      this.cells[`tokens:${m}`].textContent = String(n);
      this.barParts[i].style.flexGrow = String(n);
    });
    this.cells["llm-share"].textContent = s.llmShare === undefined ? "—" : `${(s.llmShare * 100).toFixed(1)}%`;
    this.cells.switches.textContent = String(s.switches);
    this.cells.tps.textContent = f2(s.tokensPerSecond, "", 1);
    this.cells.ttft.textContent = f2(s.ttft === undefined ? undefined : s.ttft * 1000, " ms", 0);
    this.cells.time.textContent = f2(s.elapsed(now), " s");
  }

  /** The stream ended normally. */
  finish({ reason, usage, provenance }, t) {
    clearInterval(this.timer);
    this.stats.ended(t);
    this.render(t);
    this.root.dataset.sources = JSON.stringify(this.sources);
    this.root.dataset.chunks = String(this.chunks);
    if (provenance) this.root.dataset.serverProvenance = JSON.stringify(provenance);
    const notes = [];
    if (reason) notes.push(`finish: ${reason}`);
    if (usage) notes.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    if (provenance && provenance.switches !== this.stats.switches) {
      notes.push(`server counted ${provenance.switches} switches`);
    }
    this.note.textContent = notes.join(" · ");
    this.setState("done", reason === "length" ? "done (length)" : "done");
  }

  /** The request failed or was stopped. */
  fail(message, state = "error") {
    clearInterval(this.timer);
    this.stats.ended(performance.now());
    this.render(performance.now());
    this.root.dataset.sources = JSON.stringify(this.sources);
    this.note.textContent = message;
    this.setState(state);
  }
}
