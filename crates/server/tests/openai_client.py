#!/usr/bin/env python3
"""End-to-end test of tokenrouter's OpenAI-compatible API with the official `openai` client.

Runs against a live server (the Rust test `openai_client` starts one with a mock engine;
it works the same against the real engine):

    python3 crates/server/tests/openai_client.py --base-url http://127.0.0.1:30000/v1 [--api-key KEY]

Covers: models, chat, completion, streaming with usage, stop, n=2, logprobs (chat and
legacy), tool calls (whole, streamed, and fed back), provenance extensions, error statuses,
and that a client disconnect aborts the request (seen in /metrics). Prints "N passed, N failed" and exits non-zero on any failure.
"""

import argparse
import json
import re
import sys
import time
import traceback
import urllib.request

import openai

ROUTED = "tokenrouter"
# What the mock backend writes (crates/server/tests/server/mock.rs).
SCRIPT = "Hello, world! The answer is 42. é日本🙂 END of story."


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def metric_sum(root, name, label_filter=""):
    """Sum of the samples of `name` whose labels contain `label_filter`."""
    with urllib.request.urlopen(root + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and label_filter in (m.group(2) or ""):
            total += float(m.group(3))
    return total, text


class Suite:
    def __init__(self, base_url, api_key):
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.api_key = api_key
        self.client = openai.OpenAI(base_url=self.base_url, api_key=api_key or "none", max_retries=0, timeout=60)
        self.models = [m.id for m in self.client.models.list().data]

    def chat(self, **kw):
        kw.setdefault("model", ROUTED)
        kw.setdefault("messages", [{"role": "user", "content": "Say hello."}])
        return self.client.chat.completions.create(**kw)

    # ---- tests ----

    def test_models(self):
        check(self.models[0] == ROUTED, f"first model should be {ROUTED}: {self.models}")
        check(len(self.models) >= 2, f"configured models missing: {self.models}")

    def test_chat(self):
        r = self.chat(max_tokens=16)
        c = r.choices[0]
        check(r.object == "chat.completion", r.object)
        check(c.message.role == "assistant", c.message.role)
        check(c.message.content, "empty content")
        check(c.finish_reason in ("stop", "length"), c.finish_reason)
        u = r.usage
        check(u.total_tokens == u.prompt_tokens + u.completion_tokens, u)
        prov = (r.model_extra or {}).get("tokenrouter")
        check(prov and sum(prov["tokens_by_model"].values()) == u.completion_tokens, prov)

    def test_pinned_model(self):
        pinned = self.models[1]
        r = self.chat(model=pinned, max_tokens=8, extra_body={"return_token_sources": True})
        sources = r.choices[0].model_extra["token_sources"]
        check(r.model == pinned, r.model)
        check(sources and set(sources) == {pinned}, sources)

    def test_completion_length(self):
        r = self.client.completions.create(model=ROUTED, prompt="Once upon a time", max_tokens=5,
                                           extra_body={"ignore_eos": True})
        check(r.object == "text_completion", r.object)
        check(r.choices[0].finish_reason == "length", r.choices[0].finish_reason)
        check(r.usage.completion_tokens == 5, r.usage)

    def test_stream_with_usage(self):
        stream = self.chat(max_tokens=24, stream=True, stream_options={"include_usage": True},
                           extra_body={"return_token_sources": True})
        chunks = list(stream)
        content_chunks = [c for c in chunks if c.choices]
        check(content_chunks, "no content chunks")
        first = content_chunks[0].choices[0].delta
        check(first.role == "assistant" and first.content, f"bad first delta {first}")
        for c in content_chunks:
            check(c.usage is None, f"usage on a content chunk: {c}")
        last = chunks[-1]
        check(last.choices == [] and last.usage is not None, f"bad final chunk {last}")
        text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
        check(text, "empty streamed text")
        sources = sum((c.choices[0].model_extra.get("token_sources", []) for c in content_chunks), [])
        check(len(sources) == last.usage.completion_tokens, (len(sources), last.usage))
        check(content_chunks[-1].choices[0].finish_reason in ("stop", "length"), "no finish_reason")
        check("tokenrouter" in (last.model_extra or {}), "no provenance on the usage chunk")

    def test_stop(self):
        base = self.chat(max_tokens=32, temperature=0, seed=1).choices[0].message.content
        check(len(base) > 8, f"output too short to test stop: {base!r}")
        stop = base[len(base) // 2: len(base) // 2 + 3]
        r = self.chat(max_tokens=32, temperature=0, seed=1, stop=[stop])
        c = r.choices[0]
        check(c.finish_reason == "stop", c.finish_reason)
        check(c.message.content == base[: base.index(stop)], (c.message.content, base, stop))
        # The same through a stream.
        s = self.chat(max_tokens=32, temperature=0, seed=1, stop=stop, stream=True)
        chunks = [c for c in s if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        check(text == base[: base.index(stop)], (text, stop))
        check(chunks[-1].choices[0].finish_reason == "stop", chunks[-1])

    def test_n2(self):
        r = self.chat(max_tokens=8, n=2, seed=5)
        check([c.index for c in r.choices] == [0, 1], r.choices)
        check(all(c.message.content for c in r.choices), r.choices)

    def test_logprobs(self):
        r = self.chat(max_tokens=6, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        check(len(content) == r.usage.completion_tokens, (len(content), r.usage))
        for e in content:
            check(e.logprob <= 0 and len(e.top_logprobs) == 2, e)
            check(e.model_extra.get("source") in self.models, e.model_extra)
        r = self.client.completions.create(model=ROUTED, prompt="Hi", max_tokens=4, logprobs=2)
        lp = r.choices[0].logprobs
        check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4, lp)
        check(all(len(t) >= 1 for t in lp.top_logprobs), lp.top_logprobs)

    def test_tool_calls(self):
        # The mock answers a prompt that lists tools with a call of the first one.
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        r = self.chat(messages=messages, tools=tools, max_tokens=128)
        c = r.choices[0]
        check(c.finish_reason == "tool_calls", c.finish_reason)
        calls = c.message.tool_calls
        check(calls and calls[0].type == "function" and calls[0].function.name == "get_weather", calls)
        check(json.loads(calls[0].function.arguments) == {"city": "Paris"}, calls[0].function.arguments)
        check(not c.message.content, c.message.content)
        # Streamed: the deltas accumulated by index, as clients do.
        acc = {}
        finish = None
        for chunk in self.chat(messages=messages, tools=tools, max_tokens=128, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = acc.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        check(finish == "tool_calls", finish)
        check(list(acc) == [0] and acc[0]["name"] == "get_weather" and acc[0]["id"], acc)
        check(json.loads(acc[0]["arguments"]) == {"city": "Paris"}, acc)
        # The call and its result go back; the model answers in text.
        messages += [c.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C"}]
        r = self.chat(messages=messages, tools=tools, max_tokens=16)
        check(r.choices[0].message.content and not r.choices[0].message.tool_calls, r.choices[0])
        check(r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)

    def test_responses_api(self):
        # OpenAI's Responses API through the official client: whole, streamed (raw events and
        # the client's accumulating helper), tool calls as function_call items.
        r = self.client.responses.create(model="tokenrouter", input="Say hello.",
                                         instructions="Be brief.", max_output_tokens=64)
        check(r.status == "completed" and r.output_text == SCRIPT, r)
        check(r.usage.output_tokens >= len(SCRIPT.encode()) and r.usage.input_tokens > 0, r.usage)
        lp = self.client.responses.create(model="tokenrouter", input="Say hello.", max_output_tokens=64,
                                          include=["message.output_text.logprobs"], top_logprobs=1)
        entries = lp.output[0].content[0].logprobs
        check(len(entries) == len(SCRIPT.encode()) and entries[0].token == "H", entries[:2])
        check(len(entries[0].top_logprobs) == 1, entries[0])
        cut = self.client.responses.create(model="tokenrouter", input="x", max_output_tokens=5)
        check(cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens", cut)
        check(cut.output_text == SCRIPT[:5], cut.output_text)
        events = list(self.client.responses.create(model="tokenrouter", input="Say hello.",
                                                   max_output_tokens=64, stream=True))
        kinds = [e.type for e in events]
        check(kinds[:2] == ["response.created", "response.in_progress"], kinds)
        check(kinds[-1] == "response.completed", kinds)
        check([e.sequence_number for e in events] == list(range(len(events))), kinds)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        check(text == SCRIPT == events[-1].response.output_text, text)
        with self.client.responses.stream(model="tokenrouter", input="Say hello.",
                                          max_output_tokens=64) as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
        check(final.output_text == SCRIPT, final)
        tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
        r = self.client.responses.create(model="tokenrouter", input="Weather in Paris?",
                                         tools=tools, max_output_tokens=128)
        calls = [o for o in r.output if o.type == "function_call"]
        check(len(calls) == 1 and calls[0].name == "get_weather", r.output)
        check(json.loads(calls[0].arguments) == {"city": "Paris"}, calls[0].arguments)
        # The result goes back as items; the mock answers in text once a tool answered.
        follow = self.client.responses.create(model="tokenrouter", tools=tools, max_output_tokens=64, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
        check(follow.output_text == SCRIPT, follow.output)
        streamed = list(self.client.responses.create(model="tokenrouter", input="Weather in Paris?",
                                                     tools=tools, max_output_tokens=128, stream=True))
        args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
        check(json.loads(args) == {"city": "Paris"}, args)
        # Stored: the tool call's response continued by id, sending only the tool's output
        # (the Agents SDK's way); fetched, its input listed, deleted.
        follow = self.client.responses.create(model="tokenrouter", tools=tools, max_output_tokens=64,
                                              previous_response_id=r.id, input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
        check(follow.output_text == SCRIPT and follow.previous_response_id == r.id, follow)
        check(self.client.responses.retrieve(r.id).output[0].type == "function_call", r.id)
        items = self.client.responses.input_items.list(follow.id, order="asc")
        kinds = [i.type for i in items.data]
        check(kinds == ["message", "function_call", "function_call_output"], kinds)
        self.client.responses.delete(r.id)
        try:
            self.client.responses.retrieve(r.id)
            raise AssertionError("a deleted response was still there")
        except openai.NotFoundError:
            pass

    def test_background_responses(self):
        r = self.client.responses.create(model=ROUTED, input="hi", background=True)
        check(r.status == "queued" and r.background, r)
        for _ in range(1000):
            r = self.client.responses.retrieve(r.id)
            if r.status not in ("queued", "in_progress"):
                break
            time.sleep(0.01)
        check(r.status == "completed" and r.output_text == SCRIPT, r)
        # Cancelled at once; the mock writes for ~0.1 s, so under load it may end first.
        r = self.client.responses.create(model=ROUTED, input="hi", background=True)
        try:
            c = self.client.responses.cancel(r.id)
            check(c.status == "cancelled" and SCRIPT.startswith(c.output_text if c.output else ""), c)
        except openai.BadRequestError as e:
            check("already completed" in str(e), e)
        # Streamed, then read again from a point by the response's id.
        events = list(self.client.responses.create(model=ROUTED, input="hi", background=True, stream=True))
        kinds = [e.type for e in events]
        check(kinds[:3] == ["response.created", "response.queued", "response.in_progress"], kinds)
        check(kinds[-1] == "response.completed" and events[-1].response.output_text == SCRIPT, kinds)
        rid = events[0].response.id
        again = list(self.client.responses.retrieve(rid, stream=True, starting_after=2))
        check([e.sequence_number for e in again] == [e.sequence_number for e in events[3:]], again)
        check([e.type for e in again] == kinds[3:], again)

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
        check(e.status_code == 400, e)
        if self.api_key:
            bad = openai.OpenAI(base_url=self.base_url, api_key="wrong", max_retries=0)
            e = expect(openai.AuthenticationError, lambda: bad.models.list())
            check(e.status_code == 401, e)

    def test_disconnect_aborts(self):
        label = 'reason="client_disconnect"'
        before, _ = metric_sum(self.root, "tokenrouter:requests_aborted_total", label)
        engine_before, _ = metric_sum(self.root, "mock_engine_aborted_total")
        stream = self.client.completions.create(model=ROUTED, prompt="Count forever:", max_tokens=400,
                                                stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        deadline = time.time() + 10
        while time.time() < deadline:
            after, text = metric_sum(self.root, "tokenrouter:requests_aborted_total", label)
            engine_after, _ = metric_sum(self.root, "mock_engine_aborted_total")
            mock = "mock_engine_aborted_total" in text
            if after > before and (not mock or engine_after > engine_before):
                return
            time.sleep(0.05)
        raise AssertionError("the disconnect was not seen as an abort in /metrics")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    suite = Suite(args.base_url, args.api_key)
    tests = [getattr(suite, n) for n in dir(suite) if n.startswith("test_")]
    passed = failed = 0
    for test in tests:
        try:
            test()
            passed += 1
            print(f"ok   {test.__name__}")
        except Exception:  # noqa: BLE001 - report every failure and go on
            failed += 1
            print(f"FAIL {test.__name__}\n{traceback.format_exc()}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
