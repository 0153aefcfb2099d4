"""What an outside tester probes: bounded input before authentication, limits
that answer at once, health that never starves, bad input that never becomes a
500 or INTERNAL, metrics behind the key, HTTP held to the drain grace."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import AuthConfig
from gateway.pb import specgate_pb2 as pb
from tests.helpers import SLOW, key, request, slow_engine, start_gateway

KEYS = AuthConfig(keys=[key("acme", "sk-good"), key("unary", "sk-unary", methods=["Generate"]),
                        key("streamer", "sk-stream", methods=["GenerateStream"])])
GOOD = {"Authorization": "Bearer sk-good", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def gw():
    g = start_gateway(keys=KEYS, http=True, metrics_text=lambda: b"# metrics\n")
    yield g
    g.close()


def raw_http(port: int, head: bytes, body: bytes = b"", read_timeout: float = 10.0) -> tuple[int, bytes]:
    """Send bytes as they are (no client library fixing them up); the status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
        header, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in header.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        while length is not None and len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, rest


def post_head(path: str, length: str | None, auth: str = "sk-good", ctype: str = "application/json",
              extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Type: {ctype}"]
    if auth:
        lines.append(f"Authorization: Bearer {auth}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines + ([extra] if extra else [])) + "\r\n\r\n").encode()


# ------------------------------------------------------------------ 1: bounded input before auth
def test_a_wrong_key_is_refused_before_any_body_byte_is_read(gw):
    t0 = time.perf_counter()
    status, body = raw_http(gw.http_port, post_head("/v1/completions", "200000000", auth="sk-wrong"))
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert time.perf_counter() - t0 < 2  # answered without waiting for 200 MB that never came


def test_bodies_are_bounded_whatever_the_headers_say(gw):
    status, body = raw_http(gw.http_port, post_head("/v1/completions", "200000000"))
    assert status == 413 and "body larger" in json.loads(body)["error"]["message"]
    # no Content-Length, chunked: cut off at the bound
    chunk = b"x" * 65536
    stream = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(140)) + b"0\r\n\r\n"  # ~9 MB
    status, body = raw_http(gw.http_port, post_head("/v1/completions", None, extra="Transfer-Encoding: chunked"),
                            stream)
    assert status == 413
    for bad in ("-5", "abc", "1e3"):
        status, _ = raw_http(gw.http_port, post_head("/v1/completions", bad), b"{}")
        assert status == 400, bad


def test_memory_stays_flat_when_a_large_body_comes_with_a_wrong_key(gw):
    def rss_mb() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    before = rss_mb()
    with socket.create_connection(("127.0.0.1", gw.http_port), timeout=10) as s:
        s.sendall(post_head("/v1/completions", str(64 << 20), auth="sk-wrong"))
        try:
            for _ in range(1024):  # 64 MB offered; the gateway answers and closes early
                s.sendall(b"y" * 65536)
        except OSError:
            pass
    assert rss_mb() - before < 50


# ------------------------------------------------------------------ 2: limits and health under load
def test_beyond_the_limit_calls_are_refused_at_once_and_health_stays_fast():
    g = start_gateway(slow_engine(step_s=0.05, max_queue=512, max_batch=256), max_concurrent_streams=200)
    try:
        streams = [g.stub.GenerateStream(pb.GenerateRequest(**SLOW), timeout=60) for _ in range(200)]
        deadline = time.monotonic() + 20
        while g.service.active < 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert g.service.active == 200
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            g.stub.Generate(request(), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.perf_counter() - t0 < 1.0
        h = health_pb2_grpc.HealthStub(g.channel)
        lat = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert h.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                health_pb2.HealthCheckResponse.SERVING
            g.stub.GetStatus(pb.GetStatusRequest(), timeout=1)
            lat.append(time.perf_counter() - t0)
        assert max(lat) < 0.2 and sorted(lat)[len(lat) // 2] < 0.1, lat
        for s in streams:
            s.cancel()
    finally:
        g.close()


# ------------------------------------------------------------------ 7: the method follows the body
def test_a_tenant_allowed_only_generate_may_ask_for_a_whole_completion(gw):
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    auth = {"Authorization": "Bearer sk-unary", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body, auth)
    assert conn.getresponse().status == 200
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 2, "stream": True}), auth)
    r = conn.getresponse()
    assert r.status == 403 and "GenerateStream" in json.loads(r.read())["error"]["message"]
    conn.close()


# ------------------------------------------------------------------ 8: bad input
@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "specgate": {"arm": "ngram:²"}}, "arm"),
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": "hi", "top_k": 2**40}, "top_k"),
    ({"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "hi", "n": 1.0}, "n"),
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
])
def test_bad_fields_over_http_are_400_naming_them(gw, body, param):
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), GOOD)
    r = conn.getresponse()
    err = json.loads(r.read())["error"]
    conn.close()
    assert r.status == 400 and err["param"] == param and err["message"], err


def test_malformed_bodies_and_types_are_refused_cleanly(gw):
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    for head, body, status in [
        (post_head("/v1/completions", str(len(deep))), deep, 400),
        (post_head("/v1/completions", "8", ctype="text/plain"), b"{\"a\": 1}", 415),
        (post_head("/v1/chat/completions", "2"), b"{}", 400),
        (post_head("/v1/nothing", "2"), b"{}", 404),
    ]:
        got, data = raw_http(gw.http_port, head, body)
        assert got == status, (head, got, data[:200])
        assert set(json.loads(data)["error"]) == {"message", "type", "param", "code"}


def test_bad_grpc_input_is_invalid_argument_never_internal(gw):
    meta = (("authorization", "Bearer sk-good"),)
    with pytest.raises(grpc.RpcError) as e:
        gw.stub.Generate(request(arm="ngram:²"), metadata=meta)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("arm:")
    # a string field that is not UTF-8, sent as raw bytes
    raw = gw.channel.unary_unary("/specgate.v1.Gateway/Generate", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\x0a\x03a\xffb", metadata=meta, timeout=10)  # field 1 (prompt), 3 bytes, invalid UTF-8
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in e.value.details()


# ------------------------------------------------------------------ 9: metrics behind the key
def test_metrics_need_a_key_when_keys_are_configured(gw):
    status, _ = raw_http(gw.http_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 401
    status, body = raw_http(gw.http_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-unary\r\n\r\n")
    assert status == 200 and body.startswith(b"# metrics")


def test_metrics_can_be_served_openly_when_the_operator_says_so():
    g = start_gateway(keys=AuthConfig(keys=[key("a", "k")], protect_metrics=False), http=True,
                      metrics_text=lambda: b"# open\n")
    try:
        status, body = raw_http(g.http_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and body == b"# open\n"
    finally:
        g.close()


# ------------------------------------------------------------------ 10: HTTP held to the drain grace
def test_http_requests_in_flight_finish_during_the_drain(caplog):
    g = start_gateway(slow_engine(step_s=0.02), http=True)
    results = []

    def call():
        conn = http.client.HTTPConnection("127.0.0.1", g.http_port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hello world", "max_tokens": 30,
                                                             "stop": ["nevermatches"],
                                                             "specgate": {"arm": "slow:1"}}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        results.append((r.status, json.loads(r.read())))
        conn.close()

    threads = [threading.Thread(target=call) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while g.service.active < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        g.serving.stop(20)
        for t in threads:
            t.join(30)
        assert [s for s, _ in results] == [200] * 3
        assert all(r["usage"]["completion_tokens"] == 30 for _, r in results)
        with pytest.raises(OSError):  # no longer listening
            socket.create_connection(("127.0.0.1", g.http_port), timeout=2)
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
    finally:
        g.channel.close()
        g.engine.close()
