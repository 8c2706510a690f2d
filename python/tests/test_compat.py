"""The research system's own examples, verbatim but for paths and ports: its in-process
engine, ``python -m tokenrouter.launch_server --config_path …`` and the OpenAI SDK with
``model="default"``; and the ``tokenrouter`` console script."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_research_system_engine_example(tiny_config):
    # As in the research system's README (config path aside).
    from tokenrouter.entrypoints.engine import TokenRoutingEngine

    engine = TokenRoutingEngine(tiny_config)
    prompt = "What is 1 + 1?"
    sampling_params = {"temperature": 0.0, "max_new_tokens": 32}
    output = engine.generate(prompt, sampling_params)
    print(output["text"])
    engine.shutdown()
    assert output["meta_info"]["completion_tokens"] >= 1
    assert output["meta_info"]["finish_reason"]["type"] in ("stop", "length")


@pytest.fixture(scope="module")
def server(tiny_config):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenrouter.launch_server", "--config_path", tiny_config,
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("launch_server did not become healthy:\n" + proc.stdout.read())
        time.sleep(0.2)
    yield base
    proc.terminate()  # SIGTERM: graceful shutdown, exit 0
    assert proc.wait(timeout=60) == 0


def test_research_system_openai_example(server):
    import openai

    # As in the research system's README (port aside).
    client = openai.Client(base_url=f"{server}/v1", api_key="None")
    response = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "List 3 countries and their capitals."}],
        temperature=0,
        max_tokens=64,
    )
    print(response.choices[0].message.content)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.completion_tokens >= 1


def test_sglang_native_generate_example(server):
    # SGLang's docs' /generate example (requests swapped for urllib), and its streaming one.
    def post(data):
        req = urllib.request.Request(server + "/generate", data=json.dumps(data).encode(),
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=60)

    with post({"text": "What is the capital of France?",
               "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}) as r:
        out = json.load(r)
    assert out["meta_info"]["completion_tokens"] == 16 == len(out["output_ids"])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    prev, text = 0, ""
    with post({"text": "The capital of France is", "stream": True,
               "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}) as r:
        for chunk in r:
            chunk = chunk.decode("utf-8").strip()
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    break
                data = json.loads(chunk[5:].strip("\n"))
                text += data["text"][prev:]
                prev = len(data["text"])
    assert text == data["text"] and data["meta_info"]["completion_tokens"] == 8


def test_models_lists_the_aliases(server):
    with urllib.request.urlopen(server + "/v1/models", timeout=10) as r:
        ids = [m["id"] for m in json.load(r)["data"]]
    assert ids[0] == "tokenrouter"
    assert {"quick", "reference", "default"} <= set(ids)


def test_config_aliases_name_the_routed_model(tmp_path):
    from tokenrouter import TokenRoutingEngine
    from tokenrouter.testing import tiny_pair

    cfg = tiny_pair(tmp_path)
    with open(cfg, "a", encoding="utf-8") as f:
        f.write("  served_model_name: coder\n  served_model_aliases: [default, best]\n")
    with TokenRoutingEngine(cfg) as engine:
        for name in ("coder", "best", "default", None):
            out = engine.generate("x", {"max_new_tokens": 8, "ignore_eos": True}, model=name)
            assert out["meta_info"]["completion_tokens"] == 8
        with pytest.raises(ValueError, match="`coder` to route"):
            engine.generate("x", model="tokenrouter")


def test_console_script_is_the_cli():
    exe = shutil.which("tokenrouter", path=os.path.dirname(sys.executable))
    assert exe, "the package installs a `tokenrouter` console script"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("tokenrouter ")
    bad = subprocess.run([exe, "serve", "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr
    mod = subprocess.run([sys.executable, "-m", "tokenrouter", "plan-batching", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert mod.returncode == 0 and "--latencies" in mod.stdout


def test_launch_server_flags_map_onto_serve():
    from tokenrouter.launch_server import serve_argv

    assert serve_argv(["--config_path", "pair.yaml", "--port", "30001",
                       "--set", "model.quick.scheduler_kwargs.threshold=0.1"]) == [
        "tokenrouter", "serve", "--host", "0.0.0.0", "--port", "30001", "--config", "pair.yaml",
        "--set", "model.quick.scheduler_kwargs.threshold=0.1",
    ]
    assert serve_argv(["--config-path", "a.yaml", "--api-key", "k"])[-4:] == [
        "--config", "a.yaml", "--api-key", "k"]
    # SGLang's launch_server spellings of the parsers.
    assert serve_argv(["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"])[-4:] == [
        "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"]


def test_vllm_run_batch_entrypoint(tiny_config, tmp_path):
    # vLLM's offline batch runner, spelt as vLLM's: one OpenAI batch line in, its answer out.
    from tokenrouter.entrypoints.openai.run_batch import run_batch_argv

    assert run_batch_argv(["-i", "a.jsonl", "-o", "b.jsonl", "--max_concurrency", "8"]) == [
        "tokenrouter", "run-batch", "-i", "a.jsonl", "-o", "b.jsonl", "--max-concurrency", "8"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "default", "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    run = subprocess.run([sys.executable, "-m", "tokenrouter.entrypoints.openai.run_batch",
                          "-i", str(src), "-o", str(dst), "--config", tiny_config],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (answer,) = [json.loads(line) for line in dst.read_text().splitlines()]
    assert answer["custom_id"] == "q1" and answer["error"] is None
    assert answer["response"]["status_code"] == 200
    assert answer["response"]["body"]["usage"]["completion_tokens"] == 4
