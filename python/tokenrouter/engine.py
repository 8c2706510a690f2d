"""``TokenRoutingEngine``: the routing engine in this Python process, with the research
system's call shape (``TokenRoutingEngine(config).generate(prompt, sampling_params)``) and
SGLang ``Engine``'s conveniences (lists of prompts run concurrently, ``input_ids``,
streaming, ``async_generate``, ``chat``).

Results have SGLang's shape: ``{"text", "output_ids", "meta_info": {...}}``; ``meta_info``
adds which model wrote each token (``token_sources``), the count per model
(``tokens_by_model``) and how often the writer changed (``switches``).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from . import _native

Prompt = Union[str, Sequence[str]]
Params = Optional[Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]]
ConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any], None]


def _config_text(config: ConfigLike) -> "tuple[Optional[str], str]":
    """The config as text for the engine, and the origin naming it in errors."""
    if config is None:
        return None, "<built-in default config>"
    if isinstance(config, Mapping):
        # JSON is YAML: a dict config needs no YAML library.
        return json.dumps(config), os.path.join(os.getcwd(), "<config dict>")
    path = os.fspath(config)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), os.path.abspath(path)
    except OSError as e:
        raise ValueError(f"cannot read the config {path!r}: {e.strerror}") from None


def _with_logprob_args(params: Params, return_logprob, logprob_start_len, top_logprobs_num) -> Params:
    """SGLang's keyword arguments put into each prompt's parameters (a key the dict already
    has wins)."""
    given = {k: v for k, v in (("return_logprob", return_logprob), ("logprob_start_len", logprob_start_len),
                               ("top_logprobs_num", top_logprobs_num)) if v is not None}
    if not given:
        return params
    if params is None or isinstance(params, Mapping):
        return {**given, **dict(params or {})}
    if isinstance(params, (str, bytes)):
        return {**given, **json.loads(params)}
    return [{**given, **dict(p or {})} for p in params]


def _params_json(params: Optional[Mapping[str, Any]]) -> str:
    if params is None:
        return "{}"
    if not isinstance(params, Mapping):
        raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
    return json.dumps(dict(params))


class TokenRoutingEngine:
    """The engine over one config (a YAML path, a dict of the same shape, or None for the
    built-in default CPU pair). Loading blocks until every model is ready.

    Use it as a context manager or call :meth:`shutdown`; several engines may live in one
    process. The GIL is released while the engine works, and Ctrl-C aborts a running
    ``generate`` (its KV is freed).
    """

    def __init__(self, config: ConfigLike = None, *, timeout_s: float = 3600.0) -> None:
        text, origin = _config_text(config)
        self._engine = _native.Engine(text, origin, timeout_s)
        self._names: List[str] = self._engine.model_names()

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "TokenRoutingEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stops the engine; requests still running end with finish reason ``abort``."""
        self._engine.shutdown()

    @property
    def models(self) -> List[str]:
        """Configured model names, entry (small) model first."""
        return list(self._names)

    @property
    def context_length(self) -> int:
        return self._engine.context_length

    # -- text --------------------------------------------------------------------------------

    def tokenize(self, text: str) -> List[int]:
        return self._engine.encode(text)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._engine.decode(list(ids), skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> str:
        return self._engine.apply_chat_template(
            json.dumps([dict(m) for m in messages]),
            add_generation_prompt,
            json.dumps(dict(chat_template_kwargs or {})),
        )

    # -- generation --------------------------------------------------------------------------

    def generate(
        self,
        prompt: Optional[Prompt] = None,
        sampling_params: Params = None,
        *,
        input_ids: Optional[Union[Sequence[int], Sequence[Sequence[int]]]] = None,
        stream: bool = False,
        model: Optional[str] = None,
        return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
    ) -> Any:
        """Generates for one prompt (a dict result), a list of prompts (a list, run
        concurrently), or token ids (``input_ids``: one list or a list of lists).

        ``sampling_params``: SGLang's keys (``max_new_tokens`` (default 128), ``temperature``
        (default 1.0), ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty``, ``stop``, ``stop_token_ids``,
        ``ignore_eos``, ``skip_special_tokens``, ``min_new_tokens``, ``no_stop_trim``, ``n``
        (samples per prompt, sample i seeded ``seed + i``: a list, the prompts once per sample),
        ``seed``/``sampling_seed``, ``logit_bias``,
        ``return_logprob``, and with it ``logprob_start_len`` / ``top_logprobs_num``: the
        prompt's scores from that position on in ``meta_info["input_token_logprobs"]`` as
        ``(logprob, id)``, the first prompt token's logprob None, and their alternatives in
        ``input_top_logprobs``; one model's numbers, so ``model`` must pin one) and ``routing`` (per-request overrides of the routing method's
        kwargs, e.g. ``{"threshold": 0.1}``); a list gives each prompt its own. Unknown keys
        raise ``ValueError`` naming the key. ``model``: a configured model name pins the
        request to that model; None or ``"default"`` routes. ``return_logprob``,
        ``logprob_start_len`` and ``top_logprobs_num`` may also be given as keyword arguments,
        as SGLang's ``Engine.generate`` takes them (for every prompt).

        ``stream=True`` (one prompt) returns an iterator of deltas: ``{"text", "token_ids",
        "sources", "finish_reason"}``, the last one with ``meta_info``.
        """
        sampling_params = _with_logprob_args(sampling_params, return_logprob, logprob_start_len, top_logprobs_num)
        streams, single = self._submit(prompt, sampling_params, input_ids, model)
        if stream:
            return self._deltas(self._only(streams, single))
        try:
            results = [self._collect(s) for s in streams]
        finally:
            for s in streams:
                s.close()
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: Optional[Prompt] = None,
        sampling_params: Params = None,
        *,
        input_ids: Optional[Union[Sequence[int], Sequence[Sequence[int]]]] = None,
        stream: bool = False,
        model: Optional[str] = None,
        return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
    ) -> Any:
        """``generate`` for asyncio: awaits the result without blocking the event loop, or
        with ``stream=True`` returns an async iterator of deltas (``async for d in await
        engine.async_generate(p, stream=True)``). Cancelling the task aborts the request."""
        sampling_params = _with_logprob_args(sampling_params, return_logprob, logprob_start_len, top_logprobs_num)
        streams, single = self._submit(prompt, sampling_params, input_ids, model)
        if stream:
            return self._async_deltas(self._only(streams, single))
        try:
            results = []
            for s in streams:
                results.append(await asyncio.get_running_loop().run_in_executor(None, self._collect, s))
        finally:
            for s in streams:
                s.close()
        return results[0] if single else results

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        sampling_params: Optional[Mapping[str, Any]] = None,
        *,
        stream: bool = False,
        model: Optional[str] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> Any:
        """Applies the model's chat template to ``messages`` and generates the reply."""
        text = self.apply_chat_template(messages, True, chat_template_kwargs)
        return self.generate(
            input_ids=self.tokenize(text), sampling_params=sampling_params, stream=stream, model=model
        )

    def flush_cache(self) -> bool:
        """Every model forgets its cached prefixes: requests after this call reuse nothing
        computed before it (SGLang's ``Engine.flush_cache``). Running requests keep theirs."""
        self._engine.flush_cache()
        return True

    def metrics(self) -> str:
        """The engine's Prometheus metrics (the text ``/metrics`` serves)."""
        return self._engine.metrics_text()

    def stats(self) -> Dict[str, Any]:
        """Requests inside the engine and KV-cache blocks in use per model."""
        active, kv = self._engine.stats()
        return {"active_requests": active, "kv_blocks_used": dict(zip(self._names, kv))}

    # -- internals ---------------------------------------------------------------------------

    @staticmethod
    def _only(streams: list, single: bool) -> "_native.Stream":
        """The one stream of a streamed call; several prompts are refused (and aborted)."""
        if not single:
            for s in streams:
                s.close()
            raise ValueError("stream=True takes one prompt")
        return streams[0]

    def _submit(self, prompt, sampling_params, input_ids, model):
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            ids = [self.tokenize(t) for t in texts]
        else:
            seq = list(input_ids)
            single = not seq or not isinstance(seq[0], (list, tuple))
            ids = [[int(i) for i in seq]] if single else [[int(i) for i in s] for s in seq]
        if sampling_params is None or isinstance(sampling_params, (Mapping, str, bytes)):
            streams = self._engine.submit(ids, _params_json(sampling_params), model)
            # `n` > 1 samples: a list, as SGLang answers.
            return streams, single and len(streams) == 1
        per_prompt = list(sampling_params)
        if len(per_prompt) != len(ids):
            raise ValueError(
                f"{len(per_prompt)} sampling_params for {len(ids)} prompts: give one dict, or one per prompt"
            )
        if len({(p or {}).get("n", 1) for p in per_prompt}) > 1:
            raise ValueError("sampling_params: every prompt's n must be the same")
        each: list = []
        try:
            for p, params in zip(ids, per_prompt):
                each.append(self._engine.submit([p], _params_json(params), model))
        except BaseException:
            for streams in each:
                for s in streams:
                    s.close()
            raise
        # SGLang's order with n samples: the prompts once per sample.
        return [s for sample in zip(*each) for s in sample], single

    def _finish(self, reason: str, s: "_native.Stream", matched: Any = None) -> Dict[str, Any]:
        if reason == "length":
            return {"type": "length", "length": s.max_new_tokens}
        if reason == "stop" and matched is not None:
            # SGLang's: the stop string or stop token id that ended the output.
            return {"type": "stop", "matched": matched}
        return {"type": reason}

    def _meta(self, s: "_native.Stream", ids, sources, logprobs, reason, matched=None) -> Dict[str, Any]:
        by_model = {n: 0 for n in self._names}
        for src in sources:
            by_model[self._names[src]] += 1
        switches = sum(1 for a, b in zip(sources, sources[1:]) if a != b)
        meta: Dict[str, Any] = {
            "id": str(s.request_id),
            "finish_reason": self._finish(reason or "abort", s, matched),
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": s.cached_tokens,
            "tokens_by_model": by_model,
            "switches": switches,
            "token_sources": [self._names[src] for src in sources],
        }
        if s.return_logprob:
            meta["output_token_logprobs"] = list(zip(logprobs, ids))
            scored = s.input_token_logprobs
            if scored is not None:
                meta["input_token_logprobs"] = scored
                meta["input_top_logprobs"] = s.input_top_logprobs
        return meta

    def _collect(self, s: "_native.Stream") -> Dict[str, Any]:
        text, ids, sources, logprobs, reason, matched = [], [], [], [], None, None
        while True:
            chunk = s.next_chunk()
            if chunk is None:
                break
            text.append(chunk["text"])
            ids += chunk["token_ids"]
            sources += chunk["sources"]
            logprobs += chunk["logprobs"]
            reason = chunk["finish_reason"] or reason
            matched = chunk["matched"] if chunk["finish_reason"] else matched
        return {
            "text": "".join(text),
            "output_ids": ids,
            "meta_info": self._meta(s, ids, sources, logprobs, reason, matched),
        }

    def _delta(self, s, chunk, acc) -> Dict[str, Any]:
        ids, sources, logprobs = acc
        ids += chunk["token_ids"]
        sources += chunk["sources"]
        logprobs += chunk["logprobs"]
        reason = chunk["finish_reason"]
        delta: Dict[str, Any] = {
            "text": chunk["text"],
            "token_ids": chunk["token_ids"],
            "sources": [self._names[i] for i in chunk["sources"]],
            "finish_reason": self._finish(reason, s, chunk["matched"]) if reason else None,
        }
        if reason:
            delta["meta_info"] = self._meta(s, ids, sources, logprobs, reason, chunk["matched"])
        return delta

    def _deltas(self, s: "_native.Stream") -> Iterator[Dict[str, Any]]:
        acc: tuple = ([], [], [])
        try:
            while True:
                chunk = s.next_chunk()
                if chunk is None:
                    return
                yield self._delta(s, chunk, acc)
        finally:
            s.close()

    async def _async_deltas(self, s: "_native.Stream") -> AsyncIterator[Dict[str, Any]]:
        acc: tuple = ([], [], [])
        loop = asyncio.get_running_loop()
        try:
            while True:
                chunk = await loop.run_in_executor(None, s.next_chunk)
                if chunk is None:
                    return
                yield self._delta(s, chunk, acc)
        finally:
            s.close()
