#!/usr/bin/env python3
"""The official `anthropic` Python client against tokenrouter's Messages API (the mock
backend of the server tests: it writes a fixed script, or a tool call when tools are offered).

    python3 crates/server/tests/anthropic_client.py --base-url http://127.0.0.1:PORT --api-key KEY

Covers: messages.create (text, stop reasons, usage), messages.stream (text deltas add up to the
final message), a tool_use round trip (tool_use block out, tool_result back in), count_tokens,
and the errors the SDK raises (404 unknown model, 401 wrong key).
Prints one line per test and "N passed, N failed"; exits non-zero on any failure.
"""

import argparse
import sys
import traceback

import anthropic

SCRIPT = "Hello, world! The answer is 42. é日本🙂 END of story."
TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def check(cond, message):
    if not cond:
        raise AssertionError(message)


class Suite:
    def __init__(self, base_url, api_key):
        self.base_url, self.api_key = base_url, api_key
        self.client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)

    def ask(self, **kw):
        kw.setdefault("model", "tokenrouter")
        kw.setdefault("max_tokens", 12)
        kw.setdefault("messages", [{"role": "user", "content": "Say hello."}])
        return self.client.messages.create(**kw)

    def test_create(self):
        r = self.ask()
        check(r.type == "message" and r.role == "assistant", r)
        check(r.content[0].type == "text" and r.content[0].text == SCRIPT[:12], r)
        check(r.stop_reason == "max_tokens" and r.usage.output_tokens == 12, r)
        check(r.usage.input_tokens > 0, r.usage)
        r = self.ask(max_tokens=200, system="Be brief.", stop_sequences=["world"])
        check(r.stop_reason == "stop_sequence" and r.stop_sequence == "world", r)
        check(r.content[0].text == "Hello, ", r)
        check(r.model_extra["tokenrouter"]["tokens_by_model"], r.model_extra)

    def test_stream(self):
        with self.client.messages.stream(model="tokenrouter", max_tokens=20,
                                         messages=[{"role": "user", "content": "Say hello."}]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        check(text == SCRIPT[:20] and final.content[0].text == text, (text, final))
        check(final.stop_reason == "max_tokens" and final.usage.output_tokens == 20, final)

    def test_tool_round_trip(self):
        r = self.ask(max_tokens=200, tools=TOOLS,
                     messages=[{"role": "user", "content": "Weather in Paris?"}])
        check(r.stop_reason == "tool_use", r)
        call = r.content[0]
        check(call.type == "tool_use" and call.name == "get_weather", call)
        check(call.input == {"city": "Paris"}, call.input)
        r = self.ask(max_tokens=200, tools=TOOLS, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": r.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "Sunny, 24 C"}]}])
        check(r.stop_reason == "end_turn" and r.content[0].text == SCRIPT, r)

    def test_count_tokens(self):
        n = self.client.messages.count_tokens(
            model="tokenrouter", messages=[{"role": "user", "content": "Say hello."}])
        check(n.input_tokens > 0, n)

    def test_errors(self):
        try:
            self.ask(model="claude-x")
            check(False, "no error for an unknown model")
        except anthropic.NotFoundError as e:
            check(e.body["error"]["type"] == "not_found_error", e.body)
        wrong = anthropic.Anthropic(base_url=self.base_url, api_key="wrong", max_retries=0)
        try:
            wrong.messages.create(model="tokenrouter", max_tokens=4,
                                  messages=[{"role": "user", "content": "hi"}])
            check(False, "no error for a wrong key")
        except anthropic.AuthenticationError:
            pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    args = parser.parse_args()
    suite = Suite(args.base_url, args.api_key)
    passed = failed = 0
    for name in sorted(n for n in dir(suite) if n.startswith("test_")):
        try:
            getattr(suite, name)()
            passed += 1
            print(f"ok   {name}", flush=True)
        except Exception:  # noqa: BLE001 - report every failure and go on
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
