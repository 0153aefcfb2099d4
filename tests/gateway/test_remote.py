"""Engine workers in their own processes behind one gateway: routing, health
checks, and a worker killed mid-request."""

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from gateway.pb import specgate_pb2 as pb
from gateway.router import RemoteEndpoint, Router
from gateway.server import GatewayDeps, create_server
from gateway.service import GatewayService, PolicyState
from gateway.interceptors import KeyStore
from gateway.config import AuthConfig
from gateway.pb import specgate_pb2_grpc as pb_grpc
from tests.engines.tiny import tiny_hf_model, tiny_tokenizer
from tests.gateway.conftest import RULES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = tiny_hf_model(scale=4.0, dtype=__import__("torch").float32)
    model.save_pretrained(d / "model")
    tiny_tokenizer().save_pretrained(d / "model")
    cfg = d / "engine.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"path": str(d / "model"), "max_context": 96},
                                   "drafts": [{"kind": "ngram", "name": "ngram"}], "gamma_max": 4}))
    return cfg


def start_worker(config, port):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "engine", "--listen", f"127.0.0.1:{port}",
                             "--config", str(config), "--id", f"w{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def wait_listening(proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening" in line:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {proc.stdout.read()}")
    raise TimeoutError("worker did not start")


def test_worker_killed_mid_request_then_routed_around(engine_config):
    pa, pb_port = free_port(), free_port()
    a = start_worker(engine_config, pa)
    b = None
    router = Router([RemoteEndpoint(f"127.0.0.1:{pa}", "a"), RemoteEndpoint(f"127.0.0.1:{pb_port}", "b")],
                    health_check_s=0.3)
    server = None
    try:
        wait_listening(a)
        deadline = time.monotonic() + 10
        while not router.healthy() and time.monotonic() < deadline:
            time.sleep(0.1)
        service = GatewayService(router, PolicyState(RULES))
        server, port, _ = create_server("127.0.0.1:0", GatewayDeps(service, KeyStore(AuthConfig(), env="")))
        server.start()
        stub = pb_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

        ok = stub.Generate(pb.GenerateRequest(prompt="hello world", max_tokens=4), timeout=30)
        assert ok.engine == "a" and ok.usage.output_tokens > 0

        # a long stream on a; kill a once text is flowing
        stream = stub.GenerateStream(pb.GenerateRequest(prompt="hello world", max_tokens=90, stop=["zzz"]),
                                     timeout=60)
        first = next(stream)
        assert first.HasField("text")
        os.kill(a.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        # the gateway is alive and says so; with no worker left, requests are UNAVAILABLE
        assert len(stub.GetStatus(pb.GetStatusRequest()).engines) == 2
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        # a second worker comes up: the health checks put it in rotation
        b = start_worker(engine_config, pb_port)
        wait_listening(b)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                r = stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2), timeout=10)
                break
            except grpc.RpcError:
                time.sleep(0.2)
        assert r.engine == "b"
        status = {e.id: e.healthy for e in stub.GetStatus(pb.GetStatusRequest()).engines}
        assert status == {"a": False, "b": True}
    finally:
        if server:
            server.stop(0)
        router.close()
        for p in (a, b):
            if p and p.poll() is None:
                p.kill()


def test_retry_on_another_worker_when_nothing_was_streamed(engine_config):
    pa, pb_port = free_port(), free_port()
    a, b = start_worker(engine_config, pa), start_worker(engine_config, pb_port)
    router = Router([RemoteEndpoint(f"127.0.0.1:{pa}", "a"), RemoteEndpoint(f"127.0.0.1:{pb_port}", "b")],
                    health_check_s=60)  # the checker must not notice first: the request does
    try:
        wait_listening(a)
        wait_listening(b)
        for e in router.endpoints:
            e.check()
        assert len(router.healthy()) == 2
        a.kill()
        a.wait()
        service = GatewayService(router, PolicyState(RULES))
        from gateway.service import validate
        req = validate("r1", "", "hello world", [], max_tokens=3, temperature=None, top_p=None, top_k=None,
                       seed=None, stop=[], category="", expected_output_tokens=None, arm="",
                       max_prompt_chars=1000)
        # both still look healthy; whichever is tried first, the answer comes from b
        for _ in range(2):
            events = list(service.generate(req, lambda fn: None))
            assert events[-1].engine == "b"
    finally:
        router.close()
        for p in (a, b):
            if p.poll() is None:
                p.kill()
