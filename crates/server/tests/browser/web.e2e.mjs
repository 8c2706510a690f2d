// End-to-end test of the live web view in headless Chromium, against a running
// `tokenrouter serve` (run.sh starts one on a tiny synthetic pair). It loads the page,
// sends a prompt in routed mode, waits for the streamed answer and checks every rendered
// token against the API (a non-streamed request with the same body: same seed, greedy):
// source, text, logprob and router score per token, content, counters. It hovers a token
// of the large model and reads the tooltip, runs compare mode (routed vs each model
// pinned) and checks each column the same way, checks the engine panel, that nothing was
// fetched from another origin and that the page logged no error, and saves screenshots.
//
// Environment: BASE_URL (required), CHROMIUM (default /usr/bin/chromium), ARTIFACTS
// (default ./artifacts), PROMPT, MAX_TOKENS, SEED.

import assert from "node:assert/strict";
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { chromium } from "playwright-core";

const BASE = (process.env.BASE_URL || "").replace(/\/$/, "");
if (!BASE) throw new Error("set BASE_URL to a running tokenrouter server");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
const ARTIFACTS = resolve(process.env.ARTIFACTS || "artifacts");
const PROMPT = process.env.PROMPT || "Why is the sky blue? Answer briefly.";
const SEED = Number(process.env.SEED || 11);
const MAX_TOKENS = Number(process.env.MAX_TOKENS || 48);
mkdirSync(ARTIFACTS, { recursive: true });

const t0 = Date.now();
const log = (msg) => console.log(`[${((Date.now() - t0) / 1000).toFixed(1)}s] ${msg}`);

async function api(path, body) {
  const resp = await fetch(BASE + path, {
    method: body ? "POST" : "GET",
    headers: body ? { "Content-Type": "application/json" } : {},
    body: body ? JSON.stringify(body) : undefined,
  });
  const json = await resp.json();
  assert.equal(resp.status, 200, JSON.stringify(json));
  return json;
}

/** Tokens rendered in `card` (an ElementHandle of `.card`): [{source, text, logprob, score}]. */
async function renderedTokens(card) {
  return card.$$eval(".answer .tok", (spans) =>
    spans.map((s) => ({
      source: s.dataset.source,
      text: s.textContent,
      logprob: Number(s.dataset.logprob),
      score: s.dataset.routerScore === undefined ? null : Number(s.dataset.routerScore),
      cls: s.className,
    })),
  );
}

/**
 * The non-streamed answer to the request the page sent for `card`, and the checks that
 * every rendered token matches it.
 */
async function checkCardAgainstApi(card, label) {
  const request = JSON.parse(await card.getAttribute("data-request"));
  assert.equal(request.return_token_sources, true, label);
  const { stream_options: _, ...plain } = request;
  const reference = await api("/v1/chat/completions", { ...plain, stream: false });
  const choice = reference.choices[0];
  const tokens = await renderedTokens(card);
  assert.ok(tokens.length > 0, `${label}: no token rendered`);
  assert.deepEqual(
    tokens.map((t) => t.source),
    choice.token_sources,
    `${label}: rendered token sources differ from the API's token_sources`,
  );
  assert.deepEqual(
    tokens.map((t) => t.text),
    choice.token_details.map((d) => d.text),
    `${label}: rendered token texts differ from the API's token_details[].text`,
  );
  tokens.forEach((t, i) => {
    const d = choice.token_details[i];
    assert.ok(Math.abs(t.logprob - d.logprob) < 1e-4, `${label}: logprob of token ${i}`);
    if (d.router_score === null) assert.equal(t.score, null, `${label}: router score of token ${i}`);
    else assert.ok(Math.abs(t.score - d.router_score) < 1e-4, `${label}: router score of token ${i}`);
  });
  const shown = await card.$eval(".answer", (a) => a.textContent);
  assert.equal(shown, choice.message.content, `${label}: rendered text differs from the API's content`);
  assert.deepEqual(JSON.parse(await card.getAttribute("data-sources")), choice.token_sources, label);
  // Counters shown on the card = the server's provenance for the same request.
  const shownCounts = await card.$$eval("dd[data-stat=tokens]", (dds) =>
    Object.fromEntries(dds.map((d) => [d.dataset.model, Number(d.textContent)])),
  );
  assert.deepEqual(shownCounts, reference.tokenrouter.tokens_by_model, `${label}: tokens per model`);
  const switches = Number(await card.$eval("dd[data-stat=switches]", (d) => d.textContent));
  assert.equal(switches, reference.tokenrouter.switches, `${label}: switches`);
  const streamed = JSON.parse(await card.getAttribute("data-server-provenance"));
  assert.deepEqual(streamed, reference.tokenrouter, `${label}: provenance of the streamed request`);
  for (const stat of ["ttft", "time", "llm-share"]) {
    const v = await card.$eval(`dd[data-stat="${stat}"]`, (d) => d.textContent);
    assert.notEqual(v, "—", `${label}: ${stat} not shown`);
  }
  return { request, reference, tokens };
}

async function main() {
  const { data } = await api("/v1/models");
  const models = data.filter((m) => !m.routed).map((m) => m.id);
  assert.ok(models.length >= 2, "needs a server with two models");
  log(`server ${BASE}, models ${models.join(", ")}`);

  const profile = mkdtempSync(join(tmpdir(), "tokenrouter-web-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    viewport: { width: 1400, height: 900 },
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  const foreign = [];
  const problems = [];
  context.on("request", (r) => {
    if (!r.url().startsWith(BASE + "/") && !r.url().startsWith("data:")) foreign.push(r.url());
  });
  try {
    const page = context.pages()[0] || (await context.newPage());
    page.on("console", (m) => {
      if (m.type() === "error") problems.push(`console: ${m.text()}`);
    });
    page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));

    // ---- load ----
    const resp = await page.goto(BASE + "/");
    assert.equal(resp.status(), 200);
    await page.waitForSelector("body[data-ready=true]", { timeout: 30_000 });
    await page.waitForSelector("#health[data-state=ok]", { timeout: 60_000 });
    const legend = await page.$$eval(".legend-item", (items) => items.map((i) => i.dataset.model));
    assert.deepEqual(legend, models, "legend lists the configured models in order");
    // Provenance is not shown by colour alone: each model's sample differs in underline
    // style or background pattern too.
    const looks = await page.$$eval(".legend-item .tok", (samples) =>
      samples.map((s) => {
        const c = getComputedStyle(s);
        return `${c.textDecorationStyle}|${c.backgroundImage}`;
      }),
    );
    assert.equal(new Set(looks).size, looks.length, `model styles must differ beyond colour: ${looks}`);
    log("page loaded, legend ok");

    // ---- routed answer ----
    // The same prompt once through the API first. The checks below compare the page with a
    // second, non-streamed run of its request, and the two runs must see the same prefix
    // cache: a prompt's first run computes every token, later runs reuse its cached KV
    // blocks and compute only the rest, in a smaller matmul whose float sums round
    // differently (logprobs move by ~1e-4 on the tiny pair). After this warm-up the page's
    // run and the reference run reuse the same blocks and agree to the last bit.
    await api("/v1/chat/completions", {
      model: data.find((m) => m.routed).id,
      messages: [{ role: "user", content: PROMPT }],
      max_tokens: MAX_TOKENS,
      temperature: 0,
      seed: SEED,
    });
    await page.fill("#prompt", PROMPT);
    await page.fill("#max-tokens", String(MAX_TOKENS));
    await page.fill("#temperature", "0");
    await page.fill("#seed", String(SEED));
    await page.click("#send");
    const routedSel = ".turn:not(.compare) .card.routed";
    await page.waitForSelector(`${routedSel}[data-state=done]`, { timeout: 300_000 });
    const routed = await page.$(routedSel);
    const r = await checkCardAgainstApi(routed, "routed");
    const chunks = Number(await routed.getAttribute("data-chunks"));
    assert.ok(chunks > 1, `answer arrived in ${chunks} chunk(s): not streamed`);
    const bySource = new Set(r.tokens.map((t) => t.source));
    assert.ok(
      models.slice(0, 2).every((m) => bySource.has(m)),
      `the routed answer should mix both models (got ${[...bySource]})`,
    );
    for (const t of r.tokens) {
      assert.ok(t.cls.includes(`m${models.indexOf(t.source)}`), `token class ${t.cls} for ${t.source}`);
    }
    log(`routed answer: ${r.tokens.length} tokens in ${chunks} chunks, sources match the API`);

    // ---- engine panel (live from /metrics) ----
    await page.waitForFunction(
      (ms) =>
        ms.every((m) => {
          const cell = document.querySelector(`tr[data-model="${m}"] td[data-metric=tokens]`);
          return cell && Number(cell.textContent) > 0;
        }),
      models.slice(0, 2),
      { timeout: 10_000 },
    );
    const panel = await page.$$eval("#engine tbody tr", (rows) =>
      rows.map((tr) => ({
        model: tr.dataset.model,
        ...Object.fromEntries([...tr.querySelectorAll("td")].map((td) => [td.dataset.metric, td.textContent])),
      })),
    );
    for (const row of panel.slice(0, 2)) {
      for (const k of ["batch", "step", "running", "waiting", "kv"]) {
        assert.notEqual(row[k], "—", `engine panel: ${k} of ${row.model} missing`);
      }
    }
    log(`engine panel: ${JSON.stringify(panel)}`);

    // ---- hover: source model, logprob, router score ----
    const tooltipOf = async (i) => {
      const span = await routed.$(`.answer .tok[data-i="${i}"]`);
      await span.scrollIntoViewIfNeeded();
      await span.hover();
      await page.waitForFunction(
        (n) => !document.getElementById("tooltip").hidden &&
          document.querySelector("#tooltip .tip-pos").textContent === `token ${n}`,
        i + 1,
        { timeout: 5_000 },
      );
      const tip = await page.$eval("#tooltip", (t) =>
        Object.fromEntries([...t.querySelectorAll("[data-tip]")].map((e) => [e.dataset.tip, e.textContent])),
      );
      const d = r.reference.choices[0].token_details[i];
      assert.equal(tip.source, d.source, `tooltip of token ${i} names the source model`);
      assert.ok(tip.logprob.startsWith(d.logprob.toFixed(3)), `tooltip logprob ${tip.logprob} vs ${d.logprob}`);
      if (d.router_score === null) assert.ok(tip["router-score"].startsWith("—"), tip["router-score"]);
      else assert.equal(tip["router-score"], d.router_score.toFixed(3), "tooltip router score");
      return tip;
    };
    const visible = (t) => t.text.trim() !== "";
    const scored = r.reference.choices[0].token_details.findIndex((d, i) => d.router_score !== null && visible(r.tokens[i]));
    if (scored >= 0) log(`tooltip ok: ${JSON.stringify(await tooltipOf(scored))}`);
    const large = models[1];
    let pick = r.tokens.findIndex((t) => t.source === large && visible(t));
    if (pick < 0) pick = r.tokens.findIndex((t) => t.source === large);
    log(`tooltip ok: ${JSON.stringify(await tooltipOf(pick))}`);
    await page.screenshot({ path: join(ARTIFACTS, "web-routed.png"), fullPage: true });
    log("screenshot web-routed.png");

    // ---- compare mode ----
    await page.selectOption("#mode", "compare");
    await page.click("#send");
    await page.waitForFunction(
      (n) => document.querySelectorAll(".turn.compare .card[data-state=done]").length === n,
      models.length + 1,
      { timeout: 600_000 },
    );
    await page.waitForSelector(".turn.compare .compare-summary tbody tr");
    const cards = await page.$$(".turn.compare .card");
    assert.equal(cards.length, models.length + 1);
    const routedAgain = await checkCardAgainstApi(cards[0], "compare: routed");
    assert.deepEqual(
      routedAgain.tokens.map((t) => t.source),
      r.tokens.map((t) => t.source),
      "same prompt and seed route the same way in compare mode",
    );
    for (const [i, m] of models.entries()) {
      const c = cards[i + 1];
      assert.equal(await c.getAttribute("data-model"), m);
      const pinned = await checkCardAgainstApi(c, `compare: ${m} only`);
      assert.equal(pinned.request.model, m, "pinned through the request's model field");
      assert.ok(pinned.tokens.every((t) => t.source === m), `${m} only: every token from ${m}`);
    }
    const summary = await page.$$eval(".turn.compare .compare-summary tbody tr", (rows) =>
      rows.map((tr) => [tr.dataset.model, ...[...tr.cells].map((c) => c.textContent)]),
    );
    assert.deepEqual(
      summary.map((row) => row[0]),
      [data.find((m) => m.routed).id, ...models],
    );
    for (const row of summary) assert.ok(!row.at(-1).includes("—"), `compare summary time: ${row}`);
    await page.screenshot({ path: join(ARTIFACTS, "web-compare.png"), fullPage: true });
    log(`compare mode ok: ${JSON.stringify(summary)}; screenshot web-compare.png`);

    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    assert.ok(overflow <= 0, `the page is ${overflow}px wider than the window`);
    assert.deepEqual(foreign, [], "the page fetched something from another origin");
    assert.deepEqual(problems, [], "the page logged errors");
  } finally {
    await context.close();
    rmSync(profile, { recursive: true, force: true });
  }
  log(`PASS; screenshots in ${ARTIFACTS}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
