// Hovering a token shows which model wrote it, its log-probability and, where the routing
// method has one, the router's score for that position. The data sits on the token's
// span (`data-source`, `data-logprob`, `data-router-score`, `data-i`); one floating
// element is shared by all tokens.

/** Visible form of a token's text: spaces as "␣", newlines as "↵", tabs as "⇥". */
export function visibleText(text) {
  if (text === "") return "(no visible text)";
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

function row(label, value, key) {
  const dt = document.createElement("dt");
  dt.textContent = label;
  const dd = document.createElement("dd");
  dd.textContent = value;
  dd.dataset.tip = key;
  return [dt, dd];
}

/** Wires hover on `.tok` spans under `root` to the tooltip `tip`. */
export function installTooltip(root, tip, modelClass) {
  let current = null;

  const show = (span) => {
    current = span;
    const d = span.dataset;
    const logprob = Number(d.logprob);
    const score = d.routerScore === undefined ? null : Number(d.routerScore);
    const head = document.createElement("div");
    head.className = "tip-head";
    const sw = document.createElement("span");
    sw.className = `swatch ${modelClass(Number(d.m))}`;
    const name = document.createElement("strong");
    name.textContent = d.source;
    name.dataset.tip = "source";
    const pos = document.createElement("span");
    pos.className = "tip-pos";
    pos.textContent = `token ${Number(d.i) + 1}`;
    head.append(sw, name, pos);
    const dl = document.createElement("dl");
    dl.append(
      ...row("text", visibleText(span.textContent), "text"),
      ...row(
        "logprob",
        Number.isFinite(logprob) ? `${logprob.toFixed(3)}  (p = ${(Math.exp(logprob) * 100).toFixed(1)}%)` : "—",
        "logprob",
      ),
      ...row("router score", score === null || !Number.isFinite(score) ? "— (none for this method)" : score.toFixed(3), "router-score"),
    );
    tip.replaceChildren(head, dl);
    tip.hidden = false;
    const r = span.getBoundingClientRect();
    const t = tip.getBoundingClientRect();
    let left = Math.min(r.left, window.innerWidth - t.width - 8);
    let top = r.bottom + 6;
    if (top + t.height > window.innerHeight - 4) top = r.top - t.height - 6;
    tip.style.left = `${Math.max(4, left)}px`;
    tip.style.top = `${Math.max(4, top)}px`;
  };

  const hide = () => {
    current = null;
    tip.hidden = true;
  };

  root.addEventListener("mouseover", (e) => {
    const span = e.target.closest && e.target.closest(".tok");
    if (span && span !== current) show(span);
    else if (!span && current) hide();
  });
  root.addEventListener("mouseleave", hide);
  window.addEventListener("scroll", hide, { passive: true });
}
