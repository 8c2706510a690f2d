#!/usr/bin/env python3
"""End-to-end test of a running tokenrouter server (real engine) with the official `openai` client.

    python3 crates/cli/tests/openai_e2e.py --base-url http://127.0.0.1:30000/v1 [--api-key KEY]

Written for the tiny synthetic model pair of `e2e_tiny.rs` (random weights, a byte-level
vocabulary whose ids 64..89 are the letters a..z): requests add a logit bias towards those
letters, so outputs are plain ASCII and never end early, whatever the random weights say.
Every check is deterministic (greedy, or sampling with a fixed seed).

Covers: /v1/models, chat, completion, streaming with usage (and equality with the non-streamed
answer), stop strings (also one spanning tokens written by different models), n=2, logprobs
(chat and legacy, with their source model), structured output, provenance, error statuses (404, 400 naming the
field, 400 context, 401, 413, malformed JSON), and a client disconnect mid-stream: the request
is aborted and the KV cache of every model returns to 0 (GET /metrics).
Prints one line per test and "N passed, N failed"; exits non-zero on any failure.
"""

import argparse
import json
import re
import socket
import sys
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request

import openai

ROUTED = "tokenrouter"
# Letters a..z in the synthetic tokenizer (byte-level alphabet sorted: '!' is id 0).
LETTERS = {str(ord(c) - ord("!")): 30 for c in "abcdefghijklmnopqrstuvwxyz"}


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def parse_metrics(text):
    """{(name, labels): value} from a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([^\s{#]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


class Suite:
    def __init__(self, base_url, api_key):
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.api_key = api_key
        self.client = openai.OpenAI(base_url=self.base_url, api_key=api_key or "none",
                                    max_retries=0, timeout=120)
        self.models = [m.id for m in self.client.models.list().data]

    # ---- helpers ----

    def metrics(self):
        with urllib.request.urlopen(self.root + "/metrics", timeout=10) as resp:
            return parse_metrics(resp.read().decode())

    def metric(self, name, label_filter=""):
        return sum(v for (n, labels), v in self.metrics().items() if n == name and label_filter in labels)

    def chat(self, **kw):
        kw.setdefault("model", ROUTED)
        kw.setdefault("messages", [{"role": "user", "content": "Say hello."}])
        extra = kw.setdefault("extra_body", {})
        extra.setdefault("logit_bias", LETTERS)
        return self.client.chat.completions.create(**kw)

    def complete(self, **kw):
        kw.setdefault("model", ROUTED)
        kw.setdefault("prompt", "Once upon a time")
        kw.setdefault("logit_bias", LETTERS)
        return self.client.completions.create(**kw)

    def raw_post(self, path, body: bytes, key=None):
        req = urllib.request.Request(self.base_url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        key = key if key is not None else self.api_key
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def root_post(self, path, body):
        """POSTs JSON to a route outside /v1 (llama.cpp's); the status and the body text."""
        req = urllib.request.Request(self.root + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()

    def post_expect_continue(self, path, body: bytes):
        """POST with `Expect: 100-continue`, as clients do for large uploads: the body is sent
        only if the server asks for it, so a request the server refuses from its headers
        (413: too large) gets its answer instead of a connection closed mid-upload. Returns the
        status, the JSON body and whether the server asked for the body."""
        url = urllib.parse.urlsplit(self.base_url + path)
        head = (f"POST {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Expect: 100-continue\r\nConnection: close\r\n")
        if self.api_key:
            head += f"Authorization: Bearer {self.api_key}\r\n"
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall((head + "\r\n").encode())
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
            continued = reply.startswith(b"HTTP/1.1 100")
            if continued:
                sock.sendall(body)
                reply = reply.split(b"\r\n\r\n", 1)[1]
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        status = int(reply.split(b" ", 2)[1])
        head, _, payload = reply.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            out, rest = b"", payload
            while rest:
                size, _, rest = rest.partition(b"\r\n")
                n = int(size, 16)
                if n == 0:
                    break
                out, rest = out + rest[:n], rest[n + 2:]
            payload = out
        return status, json.loads(payload or b"null"), continued

    # ---- tests ----

    def test_models(self):
        check(self.models[0] == ROUTED, f"first model should be {ROUTED}: {self.models}")
        check({"quick", "reference"} <= set(self.models), self.models)

    def test_chat(self):
        r = self.chat(max_tokens=24, temperature=0, extra_body={"return_token_sources": True,
                                                                "logit_bias": LETTERS})
        c = r.choices[0]
        check(r.object == "chat.completion" and r.id.startswith("chatcmpl-"), (r.object, r.id))
        check(c.message.role == "assistant", c.message.role)
        check(re.fullmatch(r"[a-z]+", c.message.content or ""), f"content {c.message.content!r}")
        check(c.finish_reason == "length", c.finish_reason)
        u = r.usage
        check(u.completion_tokens == 24 and u.total_tokens == u.prompt_tokens + 24, u)
        prov = r.model_extra["tokenrouter"]
        check(sum(prov["tokens_by_model"].values()) == 24, prov)
        sources = c.model_extra["token_sources"]
        check(len(sources) == 24 and set(sources) == {"quick", "reference"},
              f"random routing with p=0.5 should use both models: {sources}")
        switches = sum(1 for a, b in zip(sources, sources[1:]) if a != b)
        check(prov["switches"] == switches, (prov, switches))

    def test_cached_prompt_tokens(self):
        # The same long prompt twice: the second reads its whole 16-token blocks (all but
        # the last position) from the entry model's prefix cache, and says so in usage.
        messages = [{"role": "user", "content": "Count the words: " + " ".join(["apple"] * 60)}]
        self.chat(messages=messages, max_tokens=2)
        again = self.chat(messages=messages, max_tokens=2)
        u = again.usage
        want = (u.prompt_tokens - 1) // 16 * 16
        check(u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens == want,
              (u, want))
        # SGLang's /flush_cache (vLLM's /reset_prefix_cache): the next run computes it all.
        req = urllib.request.Request(self.root + "/flush_cache", method="POST", data=b"")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=10) as resp:
            check(resp.status == 200, resp.status)
        flushed = self.chat(messages=messages, max_tokens=2).usage.prompt_tokens_details
        check(flushed.cached_tokens == 0, flushed)
        # vLLM's cache_salt: blocks are shared only within a salt.
        salted = [self.chat(messages=messages, max_tokens=2, extra_body={"cache_salt": "tenant-a"})
                  .usage.prompt_tokens_details.cached_tokens for _ in range(2)]
        check(salted == [0, want], (salted, want))

    def test_structured_output(self):
        # The official client's response_format, and vLLM's guided_* through extra_body: the
        # random models' answers keep to the constraint, routed and pinned, whole and streamed.
        schema = {"type": "object", "properties": {
            "answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["answer", "n"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False}}
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
        for model in (ROUTED, "reference"):
            r = self.chat(model=model, max_tokens=64, temperature=1.0, seed=3, response_format=fmt)
            v = json.loads(r.choices[0].message.content)
            check(v["answer"] in ("yes", "no") and 0 <= v["n"] <= 99, v)
            check(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
            s = self.chat(model=model, max_tokens=64, temperature=1.0, seed=3, response_format=fmt,
                          stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
            check(text == r.choices[0].message.content, (text, r.choices[0].message.content))
        r = self.client.completions.create(model=ROUTED, prompt="pick", max_tokens=16,
                                           extra_body={"guided_choice": ["alpha", "beta gamma"]})
        check(r.choices[0].text in ("alpha", "beta gamma"), r.choices[0].text)
        r = self.client.completions.create(model=ROUTED, prompt="code", max_tokens=16,
                                           extra_body={"guided_regex": "[a-f]{3}[0-9]{2}"})
        check(re.fullmatch("[a-f]{3}[0-9]{2}", r.choices[0].text), r.choices[0].text)
        try:
            self.client.completions.create(model=ROUTED, prompt="x", max_tokens=4,
                                           extra_body={"guided_regex": "(unclosed"})
            raise AssertionError("an invalid regex was accepted")
        except openai.BadRequestError as e:
            check(e.body.get("param") == "guided_regex", e.body)
        # GBNF: vLLM's guided_grammar written with `::=` (xgrammar's dialect, a rule going on
        # over a line break), and an invalid one named by its line.
        gbnf = 'root ::= word ("-" word){1,2}\nword ::= [a-c]{2}\n  | "zz"'
        r = self.client.completions.create(model=ROUTED, prompt="words", max_tokens=16,
                                           temperature=1.0, seed=5,
                                           extra_body={"guided_grammar": gbnf})
        check(re.fullmatch("([a-c]{2}|zz)(-([a-c]{2}|zz)){1,2}", r.choices[0].text), r.choices[0].text)
        try:
            self.client.completions.create(model=ROUTED, prompt="x", max_tokens=4,
                                           extra_body={"guided_grammar": "root ::= [a-"})
            raise AssertionError("an invalid grammar was accepted")
        except openai.BadRequestError as e:
            check(e.body.get("param") == "guided_grammar" and "line 1" in e.body["message"], e.body)

    def test_pinned_model(self):
        for pinned in ("quick", "reference"):
            r = self.chat(model=pinned, max_tokens=8, temperature=0,
                          extra_body={"return_token_sources": True, "logit_bias": LETTERS})
            check(r.model == pinned, r.model)
            check(r.choices[0].model_extra["token_sources"] == [pinned] * 8,
                  r.choices[0].model_extra)
            check(r.model_extra["tokenrouter"]["switches"] == 0, r.model_extra)

    def test_completion(self):
        r = self.complete(max_tokens=5, temperature=0)
        check(r.object == "text_completion" and r.id.startswith("cmpl-"), (r.object, r.id))
        check(r.choices[0].finish_reason == "length", r.choices[0].finish_reason)
        check(r.usage.completion_tokens == 5 and re.fullmatch(r"[a-z]{5}", r.choices[0].text),
              (r.usage, r.choices[0].text))
        # Without the bias and with ignore_eos the length is exact too.
        r = self.client.completions.create(model=ROUTED, prompt="Hi", max_tokens=7, temperature=0,
                                           extra_body={"ignore_eos": True})
        check(r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length", r)

    def test_stream_with_usage(self):
        base = self.chat(max_tokens=20, temperature=1.0, seed=11).choices[0].message.content
        stream = self.chat(max_tokens=20, temperature=1.0, seed=11, stream=True, stream_options={"include_usage": True},
                           extra_body={"return_token_sources": True, "logit_bias": LETTERS})
        chunks = list(stream)
        content = [c for c in chunks if c.choices]
        check(content, "no content chunks")
        first = content[0].choices[0].delta
        check(first.role == "assistant" and first.content, f"bad first delta {first}")
        for c in content:
            check(c.usage is None, f"usage on a content chunk: {c}")
            check(c.object == "chat.completion.chunk", c.object)
        last = chunks[-1]
        check(last.choices == [] and last.usage is not None, f"bad final chunk {last}")
        check(last.usage.completion_tokens == 20, last.usage)
        text = "".join(c.choices[0].delta.content or "" for c in content)
        check(text == base, f"stream {text!r} != non-stream {base!r}")
        sources = sum((c.choices[0].model_extra.get("token_sources") or [] for c in content), [])
        check(len(sources) == 20, sources)
        check(content[-1].choices[0].finish_reason == "length", content[-1])
        prov = last.model_extra["tokenrouter"]
        check(sum(prov["tokens_by_model"].values()) == 20, prov)
        # Completions stream too.
        chunks = list(self.complete(max_tokens=6, temperature=0, stream=True,
                                    stream_options={"include_usage": True}))
        check(chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == [], chunks[-1])
        check("".join(c.choices[0].text for c in chunks if c.choices), "empty completion stream")

    def test_stop(self):
        # Sampling with a fixed seed is reproducible and gives varied letters.
        same = dict(max_tokens=32, temperature=1.0, seed=7)
        r = self.complete(**same, extra_body={"return_token_sources": True})
        base, sources = r.choices[0].text, r.choices[0].model_extra["token_sources"]
        check(len(base) == 32 == len(sources), (base, sources))  # one letter per token
        # A stop string spanning a hand-off: its first letter from one model, the next from the other.
        cut = next((i for i in range(4, 30) if sources[i] != sources[i + 1]
                    and base.index(base[i:i + 2]) == i), None)
        check(cut is not None, f"no usable hand-off in {base!r} / {sources}")
        stop = base[cut:cut + 2]
        r = self.complete(**same, stop=[stop, "never-seen"])
        c = r.choices[0]
        check(c.finish_reason == "stop", c.finish_reason)
        check(c.text == base[:cut], (c.text, base, stop))
        # The same through streams (completion and chat).
        chunks = [c for c in self.complete(**same, stop=stop, stream=True) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        check(text == base[:cut], (text, stop))
        check(chunks[-1].choices[0].finish_reason == "stop", chunks[-1])
        chat_base = self.chat(**same).choices[0].message.content
        stop = chat_base[10:13]
        s = self.chat(**same, stop=stop, stream=True)
        chunks = [c for c in s if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        check(text == chat_base[: chat_base.index(stop)], (text, chat_base, stop))
        check(chunks[-1].choices[0].finish_reason == "stop", chunks[-1])

    def ids_written(self, **kw):
        """A routed greedy completion's token ids (vLLM's `return_tokens_as_token_ids`) and
        finish reason."""
        extra = kw.pop("extra_body", {})
        r = self.complete(max_tokens=16, temperature=0, seed=3, logprobs=0,
                          extra_body={"return_tokens_as_token_ids": True, **extra}, **kw)
        c = r.choices[0]
        ids = [int(t.split(":")[1]) for t in c.logprobs.tokens]
        check(len(ids) == r.usage.completion_tokens, (ids, r.usage))
        return ids, c.finish_reason

    def test_vllm_token_restrictions(self):
        # vLLM's min_tokens, allowed_token_ids and bad_words on the routed pair.
        base, _ = self.ids_written()
        check(len(base) == 16, base)
        stop = base[4]
        ids, reason = self.ids_written(extra_body={"stop_token_ids": [stop]})
        check(reason == "stop" and ids == base[: base.index(stop) + 1], (ids, base))
        ids, reason = self.ids_written(extra_body={"stop_token_ids": [stop], "min_tokens": 10})
        check(len(ids) >= 10 and stop not in ids[:10], (ids, stop))
        check(reason == "length" or ids[-1] == stop, (ids, reason))
        only = sorted(set(base[:3]))
        ids, _ = self.ids_written(extra_body={"allowed_token_ids": only})
        check(len(ids) == 16 and set(ids) <= set(only), (ids, only))
        # A bad word of one token: the most written letter of the base answer.
        common = max(set(base), key=base.count)
        req = urllib.request.Request(self.root + "/detokenize", method="POST",
                                     data=json.dumps({"tokens": [common]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            word = json.loads(resp.read())["prompt"]
        ids, _ = self.ids_written(extra_body={"bad_words": [word]})
        check(common not in ids and len(ids) == 16, (ids, word, common))

    def test_sglang_abort_request(self):
        # SGLang's /abort_request stops a running /generate by its rid: the stream ends at once
        # with finish_reason abort and the tokens written so far.
        def request(path, body):
            req = urllib.request.Request(self.root + path, method="POST", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            if self.api_key:
                req.add_header("Authorization", f"Bearer {self.api_key}")
            return urllib.request.urlopen(req, timeout=60)
        body = {"text": "Once upon a time", "rid": "e2e-abort", "stream": True,
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
        with request("/generate", body) as stream:
            first = stream.readline()  # the first chunk: the request is running
            check(first.startswith(b"data: "), first)
            request("/abort_request", {"rid": "e2e-abort"}).close()
            chunks = [line[6:] for line in stream.read().split(b"\n") if line.startswith(b"data: ")]
        check(chunks[-1] == b"[DONE]", chunks[-1:])
        meta = json.loads(chunks[-2])["meta_info"]
        check(meta["finish_reason"] == {"type": "abort"}, meta)
        check(0 < meta["completion_tokens"] < 500, meta)

    def test_sglang_generate(self):
        # SGLang's native /generate as its docs call it (requests-style JSON, SSE of the text so far).
        def post(body):
            req = urllib.request.Request(self.root + "/generate", method="POST", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            if self.api_key:
                req.add_header("Authorization", f"Bearer {self.api_key}")
            return urllib.request.urlopen(req, timeout=60)
        params = {"temperature": 0, "max_new_tokens": 12, "logit_bias": LETTERS, "sampling_seed": 3}
        with post({"text": "Once upon a time", "sampling_params": params}) as resp:
            one = json.loads(resp.read())
        meta = one["meta_info"]
        check(len(one["output_ids"]) == meta["completion_tokens"] == 12, one)
        check(meta["finish_reason"] == {"type": "length", "length": 12}, meta)
        check(sum(meta["tokens_by_model"].values()) == 12 and len(meta["token_sources"]) == 12, meta)
        # The same request through the OpenAI endpoint gives the same text.
        r = self.complete(prompt="Once upon a time", max_tokens=12, temperature=0, seed=3)
        check(r.choices[0].text == one["text"], (r.choices[0].text, one["text"]))
        prev, chunks = "", 0
        with post({"text": "Once upon a time", "sampling_params": params, "stream": True}) as resp:
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                check(chunk["text"].startswith(prev), (chunk["text"], prev))
                prev, chunks = chunk["text"], chunks + 1
        check(prev == one["text"] and chunks > 1, (prev, one["text"], chunks))
        with post({"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [params, dict(params, max_new_tokens=4)],
                   "return_logprob": True}) as resp:
            batch = json.loads(resp.read())
        check([b["meta_info"]["completion_tokens"] for b in batch] == [12, 4], batch)
        check(all(len(b["meta_info"]["output_token_logprobs"]) == len(b["output_ids"]) for b in batch), batch)

    def test_responses_api(self):
        # OpenAI's Responses API on the real engine: the same answer as the chat request it
        # amounts to (same template, seed and bias), whole and streamed.
        same = dict(temperature=0, extra_body={"logit_bias": LETTERS, "seed": 5})
        chat = self.client.chat.completions.create(
            model=ROUTED, messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Say hello."}], max_tokens=16, **same)
        r = self.client.responses.create(model=ROUTED, instructions="Be brief.", input="Say hello.",
                                         max_output_tokens=16, **same)
        check(r.output_text == chat.choices[0].message.content, (r.output_text, chat.choices[0].message.content))
        check(r.usage.output_tokens == chat.usage.completion_tokens, (r.usage, chat.usage))
        check(r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed"), r.status)
        events = list(self.client.responses.create(model=ROUTED, instructions="Be brief.", input="Say hello.",
                                                   max_output_tokens=16, stream=True, **same))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        check(text == r.output_text, (text, r.output_text))

    def test_n2(self):
        r = self.chat(max_tokens=12, n=2, temperature=1.0, seed=5)
        check([c.index for c in r.choices] == [0, 1], r.choices)
        check(all(c.message.content for c in r.choices), r.choices)
        check(r.choices[0].message.content != r.choices[1].message.content,
              "n=2 with sampling gave identical choices")
        check(r.usage.completion_tokens == 24, r.usage)
        again = self.chat(max_tokens=12, n=2, temperature=1.0, seed=5)
        check([c.message.content for c in again.choices] == [c.message.content for c in r.choices],
              "a fixed seed should reproduce both choices")
        # Streaming with n=2: both indices appear.
        idx = {c.choices[0].index for c in self.chat(max_tokens=4, n=2, seed=3, stream=True) if c.choices}
        check(idx == {0, 1}, idx)

    def test_logprobs(self):
        r = self.chat(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        check(len(content) == r.usage.completion_tokens == 6, (len(content), r.usage))
        for e in content:
            check(e.logprob <= 0 and len(e.top_logprobs) == 2, e)
            check(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob, e)
            check(e.model_extra.get("source") in ("quick", "reference"), e.model_extra)
        check("".join(e.token for e in content) == r.choices[0].message.content, content)
        r = self.complete(prompt="Hi", max_tokens=4, temperature=0, logprobs=2)
        lp = r.choices[0].logprobs
        check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4, lp)
        check(all(len(t) >= 1 for t in lp.top_logprobs), lp.top_logprobs)
        check(all(v <= 0 for v in lp.token_logprobs), lp.token_logprobs)

    def test_loglikelihood_like_lm_eval(self):
        """lm-eval's `local-completions` log-likelihood request (token ids, `echo`,
        `logprobs=1`, `max_tokens` 1 or 0 in older versions) and its parsing of the answer."""
        def ids(text):
            req = urllib.request.Request(self.root + "/tokenize", method="POST",
                                         data=json.dumps({"prompt": text}).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.api_key}"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())["tokens"]
        ctx, cont = ids("Once upon a time"), ids(" there was")
        n = len(ctx) + len(cont)
        scored = []
        for model in ("quick", "reference"):
            for max_tokens in (1, 0):
                r = self.client.completions.create(model=model, prompt=[ctx + cont], max_tokens=max_tokens,
                                                   echo=True, logprobs=1, temperature=0, seed=1234)
                c = r.choices[0]
                lp = c.logprobs
                check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + max_tokens,
                      (max_tokens, lp))
                check(lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp)
                check(all(v <= 0 for v in lp.token_logprobs[1:]), lp.token_logprobs)
                check(r.usage.prompt_tokens == n and r.usage.completion_tokens == max_tokens, r.usage)
                check(lp.model_extra["sources"] == [model] * (n + max_tokens), lp.model_extra)
                check(c.text.startswith("Once upon a time there was"), c.text)
                # lm-eval's parse_logprobs: the continuation's sum, and whether each of its
                # tokens was the most likely one.
                span = slice(len(ctx), n)
                total = sum(lp.token_logprobs[span])
                greedy = all(max(top, key=top.get) == tok
                             for tok, top in zip(lp.tokens[span], lp.top_logprobs[span]))
                scored.append((model, round(total, 4), greedy))
                if max_tokens == 1:
                    # The answer's token is the argmax of its own distribution (temperature 0).
                    top = lp.top_logprobs[-1]
                    check(max(top, key=top.get) == lp.tokens[-1], (top, lp.tokens[-1]))
                # vLLM's prompt_logprobs (through extra_body): the same scores in its shape.
                v = self.client.completions.create(model=model, prompt=[ctx + cont], max_tokens=1,
                                                   temperature=0, extra_body={"prompt_logprobs": 2})
                plp = v.choices[0].model_extra["prompt_logprobs"]
                check(len(plp) == n and plp[0] is None, plp)
                for i in range(1, n):
                    own = plp[i][str((ctx + cont)[i])]
                    check(abs(own["logprob"] - lp.token_logprobs[i]) < 1e-5, (own, lp.token_logprobs[i]))
                    check(own["decoded_token"] == lp.tokens[i] and own["rank"] >= 1, own)
                    ranks = sorted(e["rank"] for e in plp[i].values())
                    check(ranks[:2] == [1, 2] and len(plp[i]) in (2, 3), plp[i])
        # With or without the generated token the prompt scores agree; the models differ.
        check(scored[0] == scored[1] and scored[2] == scored[3], scored)
        check(scored[0][1] != scored[2][1], scored)
        # The routed model cannot score a prompt: one model's numbers are needed.
        try:
            self.client.completions.create(model=ROUTED, prompt=[ctx], max_tokens=1, echo=True, logprobs=1)
            check(False, "routed echo with logprobs accepted")
        except openai.BadRequestError as e:
            check(e.body["param"] == "echo", e.body)

    def test_errors(self):
        def expect(exc, fn):
            try:
                fn()
            except exc as e:
                return e
            raise AssertionError(f"expected {exc.__name__}")

        e = expect(openai.NotFoundError, lambda: self.chat(model="no-such-model"))
        check(e.status_code == 404, e)
        e = expect(openai.BadRequestError, lambda: self.chat(temperature=-1))
        check(e.status_code == 400 and "temperature" in str(e), e)
        e = expect(openai.BadRequestError, lambda: self.chat(max_tokens=10**7))
        check(e.status_code == 400 and "context" in str(e), e)
        # First come, first served (this server's scheduling policy) takes no priority.
        e = expect(openai.BadRequestError, lambda: self.chat(max_tokens=2, extra_body={"priority": 3}))
        check(e.status_code == 400 and e.body.get("param") == "priority", e)
        check(self.chat(max_tokens=2, extra_body={"priority": 0}).usage.completion_tokens == 2, "priority 0")
        status, body = self.raw_post("/chat/completions", b'{"messages": [')
        check(status == 400 and "error" in body, (status, body))
        status, body = self.raw_post("/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}).encode())
        check(status == 400 and "max_tokens" in json.dumps(body), (status, body))
        status, body = self.raw_post("/completions", json.dumps(
            {"prompt": "x", "max_tokens": 2, "no_such_field": 1}).encode())
        check(status == 200, ("unknown fields must be ignored", status, body))
        big = json.dumps({"prompt": "x" * (5 * 1024 * 1024), "max_tokens": 1}).encode()
        status, body, continued = self.post_expect_continue("/completions", big)
        check(status == 413 and body["error"]["message"], (status, body))
        check(not continued, "a body declared over the limit must be refused from its headers")
        if self.api_key:
            bad = openai.OpenAI(base_url=self.base_url, api_key="wrong", max_retries=0)
            e = expect(openai.AuthenticationError, lambda: bad.models.list())
            check(e.status_code == 401, e)
            status, body = self.raw_post("/completions", b'{"prompt": "x"}', key="")
            check(status == 401 and body["error"]["message"], (status, body))

    def test_disconnect_frees_kv(self):
        aborted = 'reason="client_disconnect"'
        before = self.metric("tokenrouter:requests_aborted_total", aborted)
        stream = self.client.completions.create(model=ROUTED, prompt="Count forever:", max_tokens=3000,
                                                stream=True, temperature=0, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        busy_kv = self.metric("tokenrouter:kv_cache_usage_perc")
        busy_active = self.metric("tokenrouter:engine_active_requests")
        stream.close()
        check(busy_kv > 0 and busy_active == 1, f"mid-stream: kv {busy_kv}, active {busy_active}")
        deadline = time.time() + 20
        state = None
        while time.time() < deadline:
            m = self.metrics()
            kv = {labels: v for (n, labels), v in m.items() if n == "tokenrouter:kv_cache_usage_perc"}
            active = m.get(("tokenrouter:engine_active_requests", ""), -1)
            after = sum(v for (n, labels), v in m.items()
                        if n == "tokenrouter:requests_aborted_total" and aborted in labels)
            state = (kv, active, after)
            if kv and all(v == 0 for v in kv.values()) and active == 0 and after > before:
                return
            time.sleep(0.05)
        raise AssertionError(f"after the disconnect: kv {state[0]}, active {state[1]}, "
                             f"aborted {before} -> {state[2]}")

    def test_oov_prompt_beside_decoding_requests(self):
        """Issue 15's attack: an out-of-vocabulary token id while 4 requests decode. The bad
        request gets 400 naming `prompt`; the 4 finish normally."""
        import concurrent.futures
        def decode(i):
            r = self.client.completions.create(model=ROUTED, prompt=f"Count {i}:", max_tokens=24,
                                               temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].finish_reason, r.usage.completion_tokens
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            running = [pool.submit(decode, i) for i in range(4)]
            time.sleep(0.05)
            bad = []
            for ids in ([1, 2, 999999], [1, 2, 4294967295], [1, 2, 3, 2**40]):
                bad.append(self.raw_post("/completions", json.dumps(
                    {"model": ROUTED, "prompt": ids, "max_tokens": 8}).encode()))
            done = [f.result(timeout=120) for f in running]
        for status, body in bad:
            check(status == 400 and body["error"]["param"] == "prompt", (status, body))
        check(done == [("length", 24)] * 4, done)

    def test_health_and_version(self):
        with urllib.request.urlopen(self.root + "/health", timeout=10) as resp:
            check(resp.status == 200, resp.status)
        with urllib.request.urlopen(self.root + "/version", timeout=10) as resp:
            check(json.loads(resp.read())["name"] == "tokenrouter", "version")
        # SGLang's probes: a token from each model, and the model info.
        for path in ("/health_generate", "/get_model_info"):
            req = urllib.request.Request(self.root + path)
            if self.api_key:
                req.add_header("Authorization", f"Bearer {self.api_key}")
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = json.loads(resp.read())
            if path == "/health_generate":
                check(body["status"] == "ok" and set(body["seconds"]) == {"quick", "reference"}, body)
            else:
                check(body["is_generation"] and len(body["models"]) == 2, body)

    def test_llama_cpp_completion_and_infill(self):
        """llama.cpp's /completion (whole, and streamed to the same text) and /infill, whose
        prompt is made of the synthetic tokenizer's fill-in-the-middle tokens."""
        bias = [[int(k), v] for k, v in LETTERS.items()]
        # A seed: the tiny pair routes at random, seeded by the request.
        body = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "logit_bias": bias,
                "seed": 0}
        status, text = self.root_post("/completion", body)
        whole = json.loads(text)
        check(status == 200 and whole["stop"] and whole["stop_type"] == "limit", whole)
        check(whole["tokens_predicted"] == 8 and re.fullmatch("[a-z]{8}", whole["content"]), whole)
        status, text = self.root_post("/completion", dict(body, stream=True))
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        check(events[-1]["stop"] and events[-1]["content"] == "", events[-1])
        check(not any(e["stop"] for e in events[:-1]), events)
        check("".join(e["content"] for e in events[:-1]) == whole["content"], (events, whole))
        body = {"input_prefix": "ab", "input_suffix": "cd", "n_predict": 4, "temperature": 0,
                "logit_bias": bias, "seed": 0}
        status, text = self.root_post("/infill", body)
        out = json.loads(text)
        check(status == 200 and out["tokens_predicted"] == 4, out)
        check(out["prompt"].endswith("<|fim_prefix|>ab<|fim_suffix|>cd<|fim_middle|>"), out["prompt"])
        # A GBNF grammar, as llama.cpp takes it.
        body = {"prompt": "digits", "n_predict": 12, "seed": 1, "grammar": 'root ::= [0-9]{3} "." [0-9]'}
        status, text = self.root_post("/completion", body)
        out = json.loads(text)
        check(status == 200 and re.fullmatch("[0-9]{3}\\.[0-9]", out["content"]), out)
        check(out["stop_type"] == "eos", out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("-k", "--only", default="", help="run only tests whose name contains this")
    args = parser.parse_args()
    suite = Suite(args.base_url, args.api_key)
    tests = [getattr(suite, n) for n in dir(suite) if n.startswith("test_") and args.only in n]
    passed = failed = 0
    for test in tests:
        t0 = time.time()
        try:
            test()
            passed += 1
            print(f"ok   {test.__name__} ({time.time() - t0:.2f}s)", flush=True)
        except Exception:  # noqa: BLE001 - report every failure and go on
            failed += 1
            print(f"FAIL {test.__name__}\n{traceback.format_exc()}", flush=True)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
