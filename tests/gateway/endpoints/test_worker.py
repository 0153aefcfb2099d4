"""Engine workers in their own processes behind one gateway: routing, health
checks, a worker killed mid-request, and the worker's credentials."""

import asyncio
import os
import signal
import time

import grpc
import pytest

from gateway.config import RemoteEngineConfig
from gateway.endpoints.worker import WorkerEndpoint
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from gateway.validation import validate
from tests.helpers import CLI, free_port, start_gateway, start_worker, wait_listening


def worker(port: int, id_: str, **kw) -> WorkerEndpoint:
    return WorkerEndpoint(RemoteEngineConfig(address=f"127.0.0.1:{port}", id=id_, **kw))


def test_worker_killed_mid_request_then_routed_around(engine_config):
    pa, pb_port = free_port(), free_port()
    a = start_worker(engine_config, pa)
    b = None
    g = None
    try:
        wait_listening(a)
        g = start_gateway(endpoints=[worker(pa, "a"), worker(pb_port, "b")], health_check_s=0.3)
        deadline = time.monotonic() + 10
        while not g.service.router.healthy() and time.monotonic() < deadline:
            time.sleep(0.1)
        stub = g.stub

        ok = stub.Generate(pb.GenerateRequest(prompt="hello world", max_tokens=4), timeout=30)
        assert ok.engine == "a" and ok.usage.output_tokens > 0
        # the worker's built-in engine adapts γ within the bound and says what its drafts are; the gateway knows
        engines = [e for e in stub.GetStatus(pb.GetStatusRequest()).engines if e.healthy]
        assert [e.adaptive_gamma for e in engines] == [True]
        assert [(k.draft, k.kind, k.model) for e in engines for k in e.draft_kinds] == [("ngram", "ngram", "")]
        # and what work costs on its machine: a lone row's step by tokens fed, one per γ up to its bound
        # (prompt lookup drafts for nothing: no drafting price)
        prices = engines[0].load.lone_step_s
        assert len(prices) == engines[0].gamma_max + 1 and all(0 < x <= y for x, y in zip(prices, prices[1:]))
        assert dict(engines[0].load.drafting_s) == {}
        assert g.service.router.endpoints[0].load().lone_step_s == tuple(prices)

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
        if g is not None:
            g.close()
        for p in (a, b):
            if p and p.poll() is None:
                p.kill()


def test_retry_on_another_worker_when_nothing_was_streamed(engine_config):
    pa, pb_port = free_port(), free_port()
    a, b = start_worker(engine_config, pa), start_worker(engine_config, pb_port)
    g = None
    try:
        wait_listening(a)
        wait_listening(b)
        # the checker must not notice first: the request does
        g = start_gateway(endpoints=[worker(pa, "a"), worker(pb_port, "b")], health_check_s=60)
        assert len(g.service.router.healthy()) == 2
        a.kill()
        a.wait()
        req = validate("r1", "", "hello world", [], max_tokens=3, temperature=None, top_p=None, top_k=None,
                       seed=None, stop=[], category="", expected_output_tokens=None, arm="", max_prompt_chars=1000)

        async def serve_one():
            events = [ev async for ev in g.service.generate(req)]
            return events[-1].engine

        # both still look healthy; whichever is tried first, the answer comes from b
        for _ in range(2):
            assert g.serving.io.run(serve_one(), timeout=30) == "b"
    finally:
        if g is not None:
            g.close()
        for p in (a, b):
            if p.poll() is None:
                p.kill()


def test_a_worker_beyond_loopback_needs_credentials(engine_config):
    import subprocess

    out = subprocess.run(CLI + ["engine", "--listen", "0.0.0.0:0", "--config", str(engine_config)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "SPECGATE_WORKER_TOKEN": ""})
    assert out.returncode == 2 and "without credentials" in out.stderr and "Traceback" not in out.stderr


def test_a_worker_with_a_token_refuses_callers_without_it(engine_config):
    port = free_port()
    w = start_worker(engine_config, port, env={"SPECGATE_WORKER_TOKEN": "tok-123"})
    try:
        assert "auth token" in wait_listening(w)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.EngineStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Status(pb.GetStatusRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.Status(pb.GetStatusRequest(), timeout=10, metadata=(("authorization", "Bearer wrong"),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the gateway's endpoint sends the token from its environment
        os.environ["SPECGATE_WORKER_TOKEN_TEST"] = "tok-123"
        try:
            ep = worker(port, "w", token_env="SPECGATE_WORKER_TOKEN_TEST")

            async def probe():
                ok = await ep.check()
                await ep.close()
                return ok

            assert asyncio.run(probe()) is True
            no_token = worker(port, "w2", token_env=None)

            async def probe_without():
                ok = await no_token.check()
                await no_token.close()
                return ok

            assert asyncio.run(probe_without()) is False
        finally:
            del os.environ["SPECGATE_WORKER_TOKEN_TEST"]
    finally:
        w.kill()


def test_result_honours_its_timeout_and_the_worker_frees_the_slot(engine_config):
    from engines.api import GenerationRequest, SamplingParams
    from engines.arms import Arm

    port = free_port()
    w = start_worker(engine_config, port)
    try:
        wait_listening(w)
        ep = worker(port, "w")

        async def go():
            assert await ep.check()
            handle = await ep.submit(GenerationRequest(
                request_id="t", prompt="hello world", arm=Arm("ngram", 1),
                sampling=SamplingParams(max_tokens=90, stop=("never",))))
            with pytest.raises(TimeoutError):
                await handle.result(timeout=0.001)
            for _ in range(100):  # the worker sees the cancellation
                await asyncio.sleep(0.05)
                await ep.check()
                if ep.load().running == 0 and ep.load().waiting == 0:
                    break
            load = ep.load()
            await ep.close()
            return load

        load = asyncio.run(go())
        assert load.running == 0 and load.waiting == 0
    finally:
        w.kill()
