"""TokenRoutingEngine on the tiny synthetic pair: results, lists, ids, streaming, async,
chat, parameter errors, aborts (close and Ctrl-C) freeing KV, shutdown, two engines."""

import _thread
import asyncio
import json
import re
import signal
import threading
import time

import pytest

import tokenrouter
from tokenrouter import EngineError, TokenRoutingEngine
from tokenrouter.testing import tiny_pair

from conftest import wait_idle

LONG = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def check_result(out, max_new_tokens):
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == max_new_tokens
    assert meta["finish_reason"] == {"type": "length", "length": max_new_tokens}
    assert sum(meta["tokens_by_model"].values()) == max_new_tokens
    assert len(meta["token_sources"]) == max_new_tokens
    sources = meta["token_sources"]
    assert meta["switches"] == sum(a != b for a, b in zip(sources, sources[1:]))
    assert set(sources) <= {"quick", "reference"}


def test_version_and_models(engine):
    assert re.fullmatch(r"\d+\.\d+\.\d+", tokenrouter.__version__)
    assert engine.models == ["quick", "reference"]
    assert engine.context_length > 0


def test_generate_one_prompt(engine):
    out = engine.generate("hello world", LONG)
    check_result(out, 24)
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenize("hello world"))
    # Random routing at p = 0.5 over 24 tokens: both models wrote.
    assert all(n > 0 for n in out["meta_info"]["tokens_by_model"].values())
    assert out["text"] == engine.detokenize(out["output_ids"])


def test_a_list_of_prompts_runs_concurrently(engine):
    def batched_steps():
        text = engine.metrics()
        total = sum(float(v) for v in re.findall(r'model_batch_size_sum\{[^}]*\} (\S+)', text))
        count = sum(float(v) for v in re.findall(r'model_batch_size_count\{[^}]*\} (\S+)', text))
        return total, count

    before = batched_steps()
    outs = engine.generate(["a b", "c d", "e f", "g h"], LONG)
    after = batched_steps()
    assert isinstance(outs, list) and len(outs) == 4
    for o in outs:
        check_result(o, 24)
    rows, steps = after[0] - before[0], after[1] - before[1]
    # One by one would be one row per step; together the engine batches them.
    assert rows / steps > 1.5, (rows, steps)


def test_input_ids_single_and_list(engine):
    ids = engine.tokenize("hello world")
    one = engine.generate(input_ids=ids, sampling_params=LONG, model="quick")
    assert isinstance(one, dict)
    check_result(one, 24)
    assert one["meta_info"]["tokens_by_model"] == {"quick": 24, "reference": 0}
    again = engine.generate("hello world", LONG, model="quick")
    assert again["output_ids"] == one["output_ids"]  # greedy on one model: deterministic
    two = engine.generate(input_ids=[ids, ids[:3]], sampling_params=LONG)
    assert isinstance(two, list) and len(two) == 2


GREEDY2 = {"max_new_tokens": 2, "temperature": 0}


def test_a_repeated_prompt_reports_its_cached_tokens(engine):
    ids = list(range(40, 80))  # 40 tokens: two whole 16-token blocks before the last
    first = engine.generate(input_ids=ids, sampling_params=GREEDY2, model="quick")
    again = engine.generate(input_ids=ids, sampling_params=GREEDY2, model="quick")
    assert again["meta_info"]["cached_tokens"] == 32, again["meta_info"]
    assert first["meta_info"]["cached_tokens"] <= again["meta_info"]["cached_tokens"]
    assert engine.flush_cache() is True
    flushed = engine.generate(input_ids=ids, sampling_params=GREEDY2, model="quick")
    assert flushed["meta_info"]["cached_tokens"] == 0
    assert flushed["output_ids"] == again["output_ids"]


def test_return_logprob_with_logprob_start_len_scores_the_prompt(engine):
    ids = engine.tokenize("Once upon a time there was")
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "return_logprob": True,
              "logprob_start_len": 0, "top_logprobs_num": 2}
    out = engine.generate(input_ids=ids, sampling_params=params, model="quick")
    meta = out["meta_info"]
    scored = meta["input_token_logprobs"]
    assert scored[0] == (None, ids[0])
    assert [i for _, i in scored] == ids
    assert all(lp <= 0 for lp, _ in scored[1:]), scored
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and all(len(t) == 2 and t[0][0] >= t[1][0] for t in tops[1:]), tops
    assert len(meta["output_token_logprobs"]) == 3
    # Scoring leaves the answer as it is; a later start reports the same scores from there.
    plain = engine.generate(input_ids=ids, sampling_params={**params, "logprob_start_len": -1},
                            model="quick")
    assert plain["output_ids"] == out["output_ids"] and "input_token_logprobs" not in plain["meta_info"]
    later = engine.generate(input_ids=ids, sampling_params={**params, "logprob_start_len": 2},
                            model="quick")
    got = later["meta_info"]["input_token_logprobs"]
    assert [i for _, i in got] == ids[2:]
    assert all(abs(a[0] - b[0]) < 1e-5 for a, b in zip(got, scored[2:])), (got, scored)
    # SGLang's Engine takes the logprob fields as keyword arguments too.
    by_kwargs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0,
                                "ignore_eos": True}, model="quick", return_logprob=True,
                                logprob_start_len=2, top_logprobs_num=2)
    assert by_kwargs["meta_info"]["input_token_logprobs"] == got
    other = engine.generate(input_ids=ids, sampling_params=params, model="reference")
    assert other["meta_info"]["input_token_logprobs"] != scored  # the other model's numbers
    # One model's numbers: a routed request cannot ask for them.
    with pytest.raises(ValueError, match="pin"):
        engine.generate(input_ids=ids, sampling_params=params)
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(input_ids=ids, sampling_params={**params, "logprob_start_len": -2}, model="quick")


def test_max_new_tokens_none_runs_to_the_context(engine):
    ids = engine.tokenize("hello world") * 4
    ids = (ids * (engine.context_length // len(ids) + 1))[: engine.context_length - 5]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": None,
                                                          "temperature": 0, "ignore_eos": True})
    check_result(out, 5)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.generate(input_ids=ids + ids[:5], sampling_params={"max_new_tokens": None})


def test_per_prompt_sampling_params(engine):
    outs = engine.generate(["a", "b"], [{"max_new_tokens": 3, "ignore_eos": True},
                                         {"max_new_tokens": 5, "ignore_eos": True}])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        engine.generate(["a", "b", "c"], [{}, {}])


def test_streaming_deltas_carry_their_sources(engine):
    whole = engine.generate("stream me", LONG, model="reference")
    deltas = list(engine.generate("stream me", LONG, model="reference", stream=True))
    assert "".join(d["text"] for d in deltas) == whole["text"]
    assert [t for d in deltas for t in d["token_ids"]] == whole["output_ids"]
    assert all(s == "reference" for d in deltas for s in d["sources"])
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    last = deltas[-1]
    assert last["finish_reason"] == {"type": "length", "length": 24}
    assert last["meta_info"]["tokens_by_model"] == {"quick": 0, "reference": 24}
    routed = list(engine.generate("stream me", LONG, stream=True))
    sources = [s for d in routed for s in d["sources"]]
    assert len(sources) == 24 and set(sources) == {"quick", "reference"}


def test_async_generate_and_async_stream(engine):
    async def main():
        one, many = await asyncio.gather(
            engine.async_generate("async one", LONG),
            engine.async_generate(["x", "y", "z"], LONG),
        )
        deltas = [d async for d in await engine.async_generate("async s", LONG, stream=True)]
        return one, many, deltas

    one, many, deltas = asyncio.run(main())
    check_result(one, 24)
    assert len(many) == 3
    assert sum(len(d["token_ids"]) for d in deltas) == 24
    assert deltas[-1]["meta_info"]["completion_tokens"] == 24


def test_chat_applies_the_template(engine):
    messages = [{"role": "user", "content": "hi there"}]
    out = engine.chat(messages, {"max_new_tokens": 6, "ignore_eos": True})
    check_result(out, 6)
    rendered = engine.apply_chat_template(messages)
    assert "hi there" in rendered
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenize(rendered))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"max_tokens": 3}, "unknown field `max_tokens`"),
        ({"temperature": "hot"}, "invalid type"),
        ({"top_k": -5}, "top_k"),
        ({"temperature": -1.0}, "temperature"),
        ({"routing": {"no_such_knob": 1.0}}, "no_such_knob"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": "{}", "regex": "a"}, "give one of"),
        ({"ebnf": "root ::= missing"}, "never defined"),
        ({"regex": "(unclosed"}, "invalid output constraint"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_key(engine, params, match):
    with pytest.raises(ValueError, match=match):
        engine.generate("x", params)


def test_structured_output_keeps_to_the_schema_or_regex(engine):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False,
              # The tiny random models would pad flexible whitespace up to the limit.
              "x-guidance": {"whitespace_flexible": False}}
    for seed in range(4):
        params = {"max_new_tokens": 64, "temperature": 1.0, "seed": seed}
        out = engine.generate("answer in JSON", dict(params, json_schema=json.dumps(schema)))
        value = json.loads(out["text"])
        assert value["answer"] in ("yes", "no") and 0 <= value["n"] <= 9, out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        out = engine.generate("a code", dict(params, regex="[A-Z]{2}-[0-9]{2}"))
        assert re.fullmatch("[A-Z]{2}-[0-9]{2}", out["text"]), out["text"]
        # SGLang's `ebnf` (GBNF, as xgrammar reads it).
        grammar = 'root ::= "id-" digit{2,3} ("," ws "id-" digit{2,3})?\ndigit ::= [0-9]\nws ::= " "?'
        out = engine.generate("ids", dict(params, ebnf=grammar))
        assert re.fullmatch(r"id-[0-9]{2,3}(, ?id-[0-9]{2,3})?", out["text"]), out["text"]


def test_n_samples_each_prompt(engine):
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": 3, "n": 3}
    outs = engine.generate("hello world", params)
    assert isinstance(outs, list) and len(outs) == 3
    # Sample i is seeded seed + i: the first is the n = 1 answer with the same seed.
    one = engine.generate("hello world", {**params, "n": 1})
    assert outs[0]["output_ids"] == one["output_ids"]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    # A batch comes back once per sample, in SGLang's order.
    batch = engine.generate(input_ids=[[5, 6], [7]], sampling_params={**params, "n": 2})
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [2, 1, 2, 1]
    each = engine.generate(input_ids=[[5, 6], [7]], sampling_params=[{**params, "n": 2}] * 2)
    assert [o["output_ids"] for o in each] == [o["output_ids"] for o in batch]
    with pytest.raises(ValueError, match="n must be at least 1"):
        engine.generate("x", {"n": 0})
    with pytest.raises(ValueError, match="n must be the same"):
        engine.generate(["a", "b"], [{"n": 2}, {"n": 1}])


def test_min_new_tokens_and_no_stop_trim(engine):
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "seed": 4}
    base = engine.generate("hello world", params)["output_ids"]
    stop = base[3]
    cut = base.index(stop)
    out = engine.generate("hello world", dict(params, stop_token_ids=[stop]))
    assert out["output_ids"] == base[: cut + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # The stop token's text is left out (SGLang trims it) unless no_stop_trim.
    assert out["text"] == engine.detokenize(base[:cut])
    kept = engine.generate("hello world", dict(params, stop_token_ids=[stop], no_stop_trim=True))
    assert kept["text"] == engine.detokenize(base[: cut + 1])
    late = engine.generate("hello world", dict(params, stop_token_ids=[stop], min_new_tokens=8))
    ids = late["output_ids"]
    assert len(ids) >= 8 and stop not in ids[:8], (ids, stop)


def test_other_bad_inputs(engine):
    with pytest.raises(ValueError, match="unknown model `huge`"):
        engine.generate("x", LONG, model="huge")
    with pytest.raises(ValueError, match="exactly one of prompt and input_ids"):
        engine.generate()
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[])
    with pytest.raises(ValueError, match="maximum context length"):
        engine.generate("x", {"max_new_tokens": 10**7})
    with pytest.raises(ValueError, match="sampling_params must be a dict"):
        engine.generate("x", "greedy")


def test_the_engine_serves_after_errors(engine):
    for bad in ({"nope": 1}, {"temperature": -1.0}):
        with pytest.raises(ValueError):
            engine.generate("x", bad)
    check_result(engine.generate("still alive", LONG), 24)
    assert wait_idle(engine)["active_requests"] == 0


def test_closing_a_stream_aborts_and_frees_kv(engine):
    it = engine.generate("abort me", {"max_new_tokens": 2000, "ignore_eos": True}, stream=True)
    first = next(it)
    assert first["finish_reason"] is None
    assert engine.stats()["active_requests"] >= 1
    it.close()  # the generator's finally closes the engine stream
    stats = wait_idle(engine)
    assert stats["active_requests"] == 0
    assert all(v == 0 for v in stats["kv_blocks_used"].values()), stats


def test_ctrl_c_aborts_a_running_generate_and_frees_kv(engine):
    # A shell starting this process in the background ignores SIGINT, and then
    # interrupt_main() does nothing: install Python's own handler, as an interactive run has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(["ctrl", "c"], {"max_new_tokens": 3000, "ignore_eos": True})
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 5
    stats = wait_idle(engine)
    assert stats["active_requests"] == 0
    assert all(v == 0 for v in stats["kv_blocks_used"].values()), stats
    check_result(engine.generate("after ctrl-c", LONG), 24)


def test_context_manager_shuts_down(tiny_config):
    with TokenRoutingEngine(tiny_config) as e:
        check_result(e.generate("inside", LONG), 24)
    with pytest.raises(EngineError, match="not ready"):
        e.generate("after", LONG)


def test_two_engines_in_one_process(tmp_path):
    a_cfg = tiny_pair(tmp_path / "a", p=0.0)
    b_cfg = tiny_pair(tmp_path / "b", p=1.0)
    with TokenRoutingEngine(a_cfg) as a, TokenRoutingEngine(b_cfg) as b:
        results = {}

        def run(name, eng):
            results[name] = eng.generate(["one", "two"], LONG)

        threads = [threading.Thread(target=run, args=(n, e)) for n, e in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # p = 0: the small model writes everything; p = 1: the large one rewrites every token.
    assert all(o["meta_info"]["tokens_by_model"]["reference"] == 0 for o in results["a"])
    assert all(o["meta_info"]["tokens_by_model"]["quick"] == 0 for o in results["b"])


def test_bad_configs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read the config"):
        TokenRoutingEngine(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="entry_model"):
        TokenRoutingEngine({"model": {"quick": {"model_path": "x"}}, "system": {}})
    with pytest.raises(EngineError):
        TokenRoutingEngine({"model": {"quick": {"model_path": str(tmp_path / "nothing")}},
                            "system": {"entry_model": "quick"}})
