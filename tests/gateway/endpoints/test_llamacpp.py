"""A real OpenAI-compatible server behind the gateway: llama-cpp-python's server
on the SmolLM2 GGUF, one process per arm (it keeps one model configuration
loaded), as speculation is deployed today: plain, and prompt-lookup decoding
with 4 and 10 tokens per round. Built by `make test` into .venv-llamacpp."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from engines.loading import default_target_path
from gateway.app import build_app, serve_in_background
from gateway.config import GatewayConfig
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from telemetry.outcomes import STREAM
from tests.helpers import REPO, free_port

PYTHON = os.environ.get("SPECGATE_LLAMACPP_PYTHON", str(REPO / ".venv-llamacpp" / "bin" / "python"))
ARMS = {"plain": None, "ngram:4": 4, "ngram:10": 10}
PROMPTS = ["Repeat this list exactly: apples, pears, plums, apples, pears, plums.",
           "Write a Python function that returns the sum of a list."]


def _server_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not Path(PYTHON).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{PYTHON} missing: `make test` builds llama-cpp-python[server] there")
        pytest.skip(f"{PYTHON} missing (make llamacpp builds it)")
    gguf = default_target_path()
    logs = tmp_path_factory.mktemp("llamacpp")
    procs = {}
    for arm, k in ARMS.items():
        port = free_port()
        argv = [PYTHON, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
                "--n_ctx", "1024", "--n_threads", "1", "--use_mmap", "False", "--verbose", "False",
                # queue a second request instead of cutting the running stream short
                "--interrupt_requests", "False"]
        if k:
            argv += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(k)]
        log = open(logs / f"{arm.replace(':', '-')}.log", "w")
        procs[arm] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), port, log)
    deadline = time.monotonic() + 180
    for arm, (proc, port, log) in procs.items():
        while not _server_ready(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                for p, _, _ in procs.values():
                    p.kill()
                pytest.fail(f"llama.cpp server for {arm} did not start:\n{Path(log.name).read_text()[-2000:]}")
            time.sleep(0.3)
    yield {arm: port for arm, (_, port, _) in procs.items()}, procs
    for proc, _, log in procs.values():
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture(scope="module")
def gateway(servers, tmp_path_factory):
    ports, _ = servers
    rules = tmp_path_factory.mktemp("rules") / "rules.yaml"
    rules.write_text("default: {explore: 0.0}\n")  # requested arms honoured whatever the prompt's category
    config = GatewayConfig.model_validate(dict(
        listen="127.0.0.1:0", embedded_engine=False, health_check_s=0.3, rules_poll_s=60, rules=str(rules),
        openai_engines=[dict(url=f"http://127.0.0.1:{port}", id=f"llamacpp-{arm}", kind="llamacpp", arms=[arm],
                             max_context=1024, read_timeout_s=60, health_path="/openapi.json")
                        for arm, port in ports.items()]))
    serving = serve_in_background(build_app(config))  # private Redis for outcomes, as `specgate serve` does
    channel = grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}")
    yield pb_grpc.GatewayStub(channel), serving.service
    channel.close()
    serving.stop()


def ask(stub, prompt, arm="", **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0.0)
    return stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)], arm=arm, **kw),
                         timeout=120)


def direct(port: int, prompt: str, max_tokens: int = 24) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def settle(port: int) -> None:
    """Put a server's cache in one known state. llama-cpp-python keeps the last
    request's KV cache, reuses its longest common prefix and evaluates the rest in one
    batch; its quantized kernels round a batch and a single token differently on some
    CPUs, so a repeated prompt (only its last token evaluated) can decode differently
    from the first. Two calls compare only from the same state. The same rounding is
    why greedy prompt lookup on llama.cpp is not asserted token-identical to its plain
    output here (on some machines it is not); the built-in engine's is."""
    direct(port, "Hi.", max_tokens=1)  # shares only the chat template with PROMPTS


def test_each_arm_is_served_by_its_own_server_and_says_acceptance_is_unknown(gateway, servers):
    stub, _ = gateway
    ports, _ = servers
    for prompt in PROMPTS:
        for arm in ARMS:
            settle(ports[arm])
            r = ask(stub, prompt, arm)
            assert (r.engine, r.decision.arm) == (f"llamacpp-{arm}", arm)
            settle(ports[arm])
            assert r.text == direct(ports[arm], prompt)  # the gateway passes the server's output through
            assert r.usage.output_tokens > 0
            if arm != "plain":  # its responses carry no acceptance figures
                assert (r.spec.acceptance_source, r.spec.drafted, r.spec.rounds) == ("unknown", 0, 0)


def test_outcomes_record_unknown_acceptance(gateway):
    stub, service = gateway
    r = ask(stub, PROMPTS[0], "ngram:10")
    client = service.sink.client
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        records = [json.loads(f[b"record"]) for _, f in client.xrange(STREAM)]
        mine = [x for x in records if x["request_id"] == r.request_id]
        if mine:
            break
        time.sleep(0.1)
    assert mine, "outcome not written"
    res = mine[0]["result"]
    assert (res["acceptance_source"], sum(res["drafted_per_round"]), res["rounds"], mine[0]["engine"]) == (
        "unknown", 0, 0, "llamacpp-ngram:10")


def test_adaptive_requests_land_on_a_served_arm_and_stream(gateway):
    stub, _ = gateway
    r = ask(stub, PROMPTS[1], temperature=0.7, seed=3)
    assert r.decision.arm in ARMS and r.engine == f"llamacpp-{r.decision.arm}"
    events = list(stub.GenerateStream(pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=PROMPTS[0])], max_tokens=16, arm="ngram:4"), timeout=120))
    chunks = [e.text for e in events if e.WhichOneof("event") == "text"]
    assert len(chunks) > 1 and "".join(chunks) == events[-1].final.text


def test_prompt_over_the_servers_context_fails_cleanly(gateway):
    stub, _ = gateway
    with pytest.raises(grpc.RpcError) as e:
        ask(stub, "word " * 3000, "plain", max_tokens=4)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT)
    assert "llamacpp-plain" in e.value.details() and "Traceback" not in e.value.details()


def test_a_killed_server_leaves_rotation_and_its_arm_falls_back(gateway, servers):
    stub, _ = gateway
    _, procs = servers
    proc = procs["ngram:10"][0]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = {e.id: e.healthy for e in stub.GetStatus(pb.GetStatusRequest()).engines}
        if not status["llamacpp-ngram:10"]:
            break
        time.sleep(0.2)
    assert status == {"llamacpp-plain": True, "llamacpp-ngram:4": True, "llamacpp-ngram:10": False}
    with pytest.raises(grpc.RpcError) as e:  # no longer on the menu
        ask(stub, PROMPTS[0], "ngram:10")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = ask(stub, PROMPTS[0])
    assert r.engine in ("llamacpp-plain", "llamacpp-ngram:4")
