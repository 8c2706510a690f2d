// Talking to the tokenrouter server: model list, streamed chat completions (server-sent
// events), health and the Prometheus exposition. Only the public HTTP API is used.

/** Thrown for non-2xx answers and for error events inside a stream. */
export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

function headers(apiKey, json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function failure(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(message, resp.status);
}

/**
 * `GET /v1/models`: `{ routed, models }` where `routed` is the token-routed entry (listed
 * first by the server) and `models` the configured models in engine order (index = colour).
 */
export async function listModels(apiKey) {
  const resp = await fetch("/v1/models", { headers: headers(apiKey, false) });
  if (!resp.ok) throw await failure(resp);
  const body = await resp.json();
  const data = Array.isArray(body.data) ? body.data : [];
  const routed = data.find((m) => m.routed) || { id: "tokenrouter", routed: true };
  const models = data.filter((m) => !m.routed).map((m) => m.id);
  return { routed: routed.id, models };
}

/** `GET /health` → "ok" | "loading" | "shutting_down" | "unreachable". */
export async function health() {
  try {
    const resp = await fetch("/health", { cache: "no-store" });
    const body = await resp.json();
    return body.status || (resp.ok ? "ok" : "loading");
  } catch {
    return "unreachable";
  }
}

/** `GET /metrics` as text (empty string when unreachable). */
export async function metricsText() {
  try {
    const resp = await fetch("/metrics", { cache: "no-store" });
    return resp.ok ? await resp.text() : "";
  } catch {
    return "";
  }
}

/**
 * Incremental parser of a server-sent-events body: feed it text as it arrives, get back
 * the `data` payloads of the events completed so far (multi-line data joined by "\n";
 * comments and other fields ignored).
 */
export class SseParser {
  constructor() {
    this.buffer = "";
    this.data = [];
  }

  push(text) {
    this.buffer += text;
    const out = [];
    let nl;
    while ((nl = this.buffer.search(/\r\n|\r|\n/)) >= 0) {
      const line = this.buffer.slice(0, nl);
      const width = this.buffer.startsWith("\r\n", nl) ? 2 : 1;
      // A lone "\r" at the end may be the first half of "\r\n": wait for more text.
      if (width === 1 && this.buffer[nl] === "\r" && nl === this.buffer.length - 1) break;
      this.buffer = this.buffer.slice(nl + width);
      if (line === "") {
        if (this.data.length) out.push(this.data.join("\n"));
        this.data = [];
      } else if (line.startsWith("data:")) {
        const value = line.slice(5);
        this.data.push(value.startsWith(" ") ? value.slice(1) : value);
      }
    }
    return out;
  }

  /** Payload of an event left unterminated at the end of the body, if any. */
  end() {
    const rest = this.push("\n\n");
    return rest;
  }
}

/**
 * `POST /v1/chat/completions` with `stream: true`; yields each parsed chunk object until
 * `[DONE]`. An error event in the stream (an `{"error": …}` payload) throws `ApiError`.
 */
export async function* streamChat(body, { apiKey, signal } = {}) {
  const resp = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey, true),
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SseParser();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      const payloads = done ? parser.end() : parser.push(value);
      for (const payload of payloads) {
        if (payload === "[DONE]") return;
        const chunk = JSON.parse(payload);
        if (chunk.error) throw new ApiError(chunk.error.message || "stream failed", chunk.error.code);
        yield chunk;
      }
      if (done) return;
    }
  } finally {
    reader.releaseLock();
  }
}
