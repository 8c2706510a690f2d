// tokenrouter live view: wires the prompt form, the legend, the answer cards (routed chat
// or compare mode) and the engine panel. Plain ES modules, served from the binary.

import { ApiError, health, listModels, metricsText, streamChat } from "./api.js";
import { AnswerCard } from "./answer.js";
import { MetricsPanel } from "./metrics.js";
import { installTooltip } from "./tooltip.js";

const $ = (id) => document.getElementById(id);

/** CSS class of configured model `i`: a colour and an underline/background pattern. */
const STYLES = 6;
export const modelClass = (i) => (i >= 0 ? `m${i % STYLES}` : "m-unknown");

const KEY_STORAGE = "tokenrouter.apiKey";

const app = {
  routed: "tokenrouter",
  models: [],
  history: [], // routed-mode conversation: [{role, content}]
  controller: null,
  busy: false,
};

function apiKey() {
  return $("api-key").value.trim() || undefined;
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

function renderLegend() {
  const legend = $("legend");
  legend.replaceChildren(
    ...app.models.map((m, i) =>
      el(
        "span",
        { class: "legend-item", dataset: { model: m } },
        el("span", { class: `tok sample ${modelClass(i)}` }, m),
        i === 0 ? el("small", {}, " entry") : "",
      ),
    ),
  );
}

async function watchHealth() {
  const badge = $("health");
  const words = { ok: "ready", loading: "loading models…", shutting_down: "shutting down", unreachable: "server unreachable" };
  const status = await health();
  badge.dataset.state = status;
  badge.textContent = words[status] || status;
  setTimeout(watchHealth, status === "ok" ? 5000 : 1000);
}

function settings() {
  const num = (id, fallback) => {
    const v = Number($(id).value);
    return $(id).value === "" || !Number.isFinite(v) ? fallback : v;
  };
  const body = {
    max_tokens: Math.max(1, Math.floor(num("max-tokens", 256))),
    temperature: num("temperature", 0),
    return_token_sources: true,
    stream_options: { include_usage: true },
  };
  if ($("seed").value !== "") body.seed = Math.floor(num("seed", 0));
  return body;
}

/** Streams one request into `card`; resolves when it ends (never rejects). */
async function run(card, body, signal) {
  card.start(body, performance.now());
  let reason = null;
  let usage = null;
  let provenance = null;
  try {
    for await (const chunk of streamChat(body, { apiKey: apiKey(), signal })) {
      const t = performance.now();
      for (const choice of chunk.choices || []) {
        if (choice.index !== 0) continue;
        card.addDelta(choice.delta?.content ?? "", choice.token_details, t);
        if (choice.finish_reason) reason = choice.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
      if (chunk.tokenrouter) provenance = chunk.tokenrouter;
    }
    card.finish({ reason, usage, provenance }, performance.now());
    return true;
  } catch (e) {
    if (e.name === "AbortError") {
      card.fail("stopped", "stopped");
    } else {
      card.fail(e instanceof ApiError ? e.message : String(e));
      if (e instanceof ApiError && e.status === 401) $("settings").open = true;
    }
    return false;
  }
}

function setBusy(busy) {
  app.busy = busy;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.busy = busy ? "true" : "false";
}

async function sendRouted(prompt) {
  const log = $("runs");
  log.dataset.mode = "routed";
  const turn = el("section", { class: "turn" }, el("p", { class: "user-msg" }, prompt));
  log.append(turn);
  const messages = [...app.history, { role: "user", content: prompt }];
  const card = new AnswerCard(turn, {
    title: "Token-level routing",
    model: app.routed,
    models: app.models,
    modelClass,
    kind: "routed",
  });
  turn.scrollIntoView({ block: "end", behavior: "smooth" });
  const ok = await run(card, { model: app.routed, messages, ...settings() }, app.controller.signal);
  if (ok) app.history = [...messages, { role: "assistant", content: card.text }];
}

async function sendCompare(prompt) {
  const log = $("runs");
  log.dataset.mode = "compare";
  const turn = el("section", { class: "turn compare" }, el("p", { class: "user-msg" }, prompt));
  const grid = el("div", { class: "compare-grid" });
  const summary = el("table", { class: "compare-summary" });
  turn.append(grid, summary);
  log.append(turn);
  const messages = [{ role: "user", content: prompt }];
  const targets = [
    { model: app.routed, title: "Token-level routing", kind: "routed" },
    ...app.models.map((m) => ({ model: m, title: `${m} only`, kind: "pinned" })),
  ];
  const cards = targets.map(
    (t) => new AnswerCard(grid, { ...t, models: app.models, modelClass }),
  );
  const common = settings();
  const signal = app.controller.signal;
  const go = (card, t) => run(card, { model: t.model, messages, ...common }, signal);
  if ($("compare-order").value === "parallel") {
    await Promise.all(cards.map((c, i) => go(c, targets[i])));
  } else {
    for (const [i, c] of cards.entries()) {
      if (signal.aborted) c.fail("stopped", "stopped");
      else await go(c, targets[i]);
    }
  }
  renderSummary(summary, targets, cards);
}

function renderSummary(table, targets, cards) {
  const fmt = (v, d, unit = "") => (v === undefined || !Number.isFinite(v) ? "—" : `${v.toFixed(d)}${unit}`);
  const times = cards.map((c) => c.stats.elapsed(performance.now()));
  const head = el(
    "tr",
    {},
    ...["run", "tokens", "LLM share", "switches", "TTFT", "tokens/s", "time"].map((h) => el("th", { scope: "col" }, h)),
  );
  const rows = cards.map((c, i) => {
    const s = c.stats;
    return el(
      "tr",
      { dataset: { model: targets[i].model } },
      el("th", { scope: "row" }, targets[i].title),
      el("td", {}, String(s.total)),
      el("td", {}, s.llmShare === undefined ? "—" : fmt(s.llmShare * 100, 1, "%")),
      el("td", {}, String(s.switches)),
      el("td", {}, fmt(s.ttft === undefined ? undefined : s.ttft * 1000, 0, " ms")),
      el("td", {}, fmt(s.tokensPerSecond, 1)),
      el("td", {}, fmt(times[i], 2, " s")),
    );
  });
  table.replaceChildren(el("caption", {}, "Same prompt, same settings, one run each"), el("thead", {}, head), el("tbody", {}, ...rows));
}

async function onSubmit(e) {
  e.preventDefault();
  if (app.busy) return;
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  if (apiKey()) localStorage.setItem(KEY_STORAGE, apiKey());
  app.controller = new AbortController();
  setBusy(true);
  try {
    if ($("mode").value === "compare") await sendCompare(prompt);
    else await sendRouted(prompt);
  } finally {
    setBusy(false);
  }
}

function onModeChange() {
  const compare = $("mode").value === "compare";
  document.body.dataset.mode = compare ? "compare" : "routed";
  $("send").textContent = compare ? "Compare" : "Send";
}

function clearRuns() {
  if (app.busy) app.controller.abort();
  app.history = [];
  $("runs").replaceChildren();
}

async function loadModels() {
  try {
    const { routed, models } = await listModels(apiKey());
    app.routed = routed;
    app.models = models;
    renderLegend();
    return true;
  } catch (e) {
    $("legend").textContent = `cannot list models: ${e.message}`;
    if (e instanceof ApiError && e.status === 401) $("settings").open = true;
    return false;
  }
}

async function main() {
  const saved = localStorage.getItem(KEY_STORAGE);
  if (saved) $("api-key").value = saved;
  $("prompt-form").addEventListener("submit", onSubmit);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("prompt-form").requestSubmit();
  });
  $("stop").addEventListener("click", () => app.controller && app.controller.abort());
  $("clear").addEventListener("click", clearRuns);
  $("mode").addEventListener("change", onModeChange);
  $("api-key").addEventListener("change", loadModels);
  onModeChange();
  installTooltip(document.body, $("tooltip"), modelClass);
  watchHealth();
  while (!(await loadModels())) await new Promise((r) => setTimeout(r, 2000));
  new MetricsPanel($("engine"), app.models, { fetchText: metricsText, modelClass }).start();
  document.body.dataset.ready = "true";
}

main();
