"""Fault and load drill (loopback only, bounded in count and time): a gateway
process in front of two `specgate engine` workers on a tiny random model, with
outcomes in a Redis this drill controls, put through

    saturation   more streams than max_concurrent_streams, health probed all along
    malformed    a burst of every kind of bad input the hardening report found
    redis        Redis SIGKILLed while requests run, then brought back
    worker       an engine worker SIGKILLed mid-stream
    sigterm      SIGTERM with requests in flight

Every request is classed as succeeded, refused with the right code, or failed
wrongly; then one table: those counts, health latency under saturation,
outcomes written vs requests served vs drops counted, the gateway's RSS.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KEY = "chaos-key"


def add_arguments(p) -> None:
    p.add_argument("--limit", type=int, default=32, help="the gateway's max_concurrent_streams (default: %(default)s)")
    p.add_argument("--extra", type=int, default=24, help="streams opened beyond the limit (default: %(default)s)")
    p.add_argument("--malformed", type=int, default=20, help="requests of each malformed kind (default: %(default)s)")
    p.add_argument("--out", help="write the counts as JSON here")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Tally:
    """Per phase: ok / refused (the right code) / wrong (anything else)."""

    def __init__(self):
        self.counts: dict[str, Counter] = {}
        self.wrong: list[str] = []
        self._lock = threading.Lock()

    def add(self, phase: str, kind: str, detail: str = "") -> None:
        with self._lock:
            self.counts.setdefault(phase, Counter())[kind] += 1
            if kind == "wrong":
                self.wrong.append(f"{phase}: {detail}"[:300])


class Drill:
    def __init__(self, args, work: Path):
        import grpc

        from telemetry.redis_server import PrivateRedis

        self.args, self.work, self.tally = args, work, Tally()
        self.procs: list[subprocess.Popen] = []
        from bench.tiny import write_tiny_engine

        # long enough streams to hold slots open: a wider tiny model, a long context
        self.engine_cfg = write_tiny_engine(work / "tiny", max_context=1024, hidden=256, layers=4)
        self.redis = PrivateRedis(data_dir=str(work / "redis"))
        env = {**os.environ, "SPECGATE_WORKER_TOKEN": "chaos-worker", "PYTHONUNBUFFERED": "1"}
        self.worker_ports = [free_port(), free_port()]
        self.workers = [self._spawn(["engine", "--listen", f"127.0.0.1:{p}", "--config", str(self.engine_cfg),
                                     "--id", f"w{i}"], env, f"worker{i}") for i, p in enumerate(self.worker_ports)]
        self.port, self.http_port = free_port(), free_port()
        cfg = work / "gateway.yaml"
        import yaml

        cfg.write_text(yaml.safe_dump({
            "listen": f"127.0.0.1:{self.port}", "http_listen": f"127.0.0.1:{self.http_port}",
            "embedded_engine": False, "max_concurrent_streams": args.limit, "drain_grace_s": 30,
            "health_check_s": 0.5, "remote_engines": [{"address": f"127.0.0.1:{p}", "id": f"w{i}"}
                                                      for i, p in enumerate(self.worker_ports)],
            "telemetry": {"redis_url": self.redis.url, "max_queue": 10_000}}))
        self.gateway = self._spawn(["serve", "--config", str(cfg)], {**env, "SPECGATE_API_KEYS": f"chaos:{KEY}",
                                                                    "SPECGATE_ARTIFACT_KEY": "chaos"}, "gateway")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self._wait_ready()

    def _spawn(self, argv, env, name) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "gateway.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                             env=env)
        self.procs.append(p)
        return p

    def _wait_ready(self, timeout: float = 180) -> None:
        from gateway.pb import specgate_pb2 as pb

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                s = self.stub.GetStatus(pb.GetStatusRequest(), timeout=2, metadata=self.meta)
                if sum(e.healthy for e in s.engines) == 2:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.3)
        raise RuntimeError(f"gateway not ready; see {self.work}/gateway.log")

    @property
    def stub(self):
        from gateway.pb import specgate_pb2_grpc as pb_grpc

        return pb_grpc.GatewayStub(self.channel)

    meta = (("authorization", f"Bearer {KEY}"),)

    def request(self, max_tokens=300, **kw):
        from gateway.pb import specgate_pb2 as pb

        return pb.GenerateRequest(prompt="hello world the cat", max_tokens=max_tokens, stop=["never"], **kw)

    def stream(self, phase: str, right=("RESOURCE_EXHAUSTED",), max_tokens=300, first: threading.Event | None = None):
        import grpc

        try:
            n = 0
            for _ in self.stub.GenerateStream(self.request(max_tokens), metadata=self.meta, timeout=120):
                n += 1
                if first is not None and n == 1:
                    first.set()
            self.tally.add(phase, "ok")
            return True
        except grpc.RpcError as e:
            self.tally.add(phase, "refused" if e.code().name in right else "wrong", f"{e.code().name} {e.details()}")
            return False

    # ------------------------------------------------------------------ phases
    def saturation(self) -> list[float]:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        total = self.args.limit + self.args.extra
        health = health_pb2_grpc.HealthStub(self.channel)
        lat, stop = [], threading.Event()

        def probe():
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    lat.append(time.perf_counter() - t0)
                except Exception:  # noqa: BLE001 - a failed probe is the worst latency
                    lat.append(2.0)
                time.sleep(0.02)

        prober = threading.Thread(target=probe)
        prober.start()
        with ThreadPoolExecutor(total) as pool:
            list(pool.map(lambda _: self.stream("saturation", max_tokens=600), range(total)))
        stop.set()
        prober.join()
        return lat

    def malformed(self) -> tuple[float, float]:
        import grpc

        before = rss_mb(self.gateway.pid)
        n = self.args.malformed
        deep = b"[" * 50_000 + b"]" * 50_000
        cases = [  # (raw HTTP head, body, status expected)
            ("POST /v1/completions", {"Content-Length": "-5"}, b"{}", 400),
            ("POST /v1/completions", {"Content-Length": "abc"}, b"{}", 400),
            ("POST /v1/completions", {"Content-Length": str(200 << 20), "Authorization": "Bearer nope"}, b"", 401),
            ("POST /v1/completions", {"Content-Length": str(200 << 20)}, b"", 413),
            ("POST /v1/completions", {"Content-Length": str(len(deep))}, deep, 400),
            ("POST /v1/completions", {"Content-Type": "text/plain"}, b'{"prompt": "x"}', 415),
            ("POST /v1/completions", {}, json.dumps({"prompt": "a\ud800b"}).encode(), 400),
            ("POST /v1/completions", {}, json.dumps({"prompt": "x", "n": 1.0}).encode(), 400),
            ("POST /v1/completions", {}, json.dumps({"prompt": "x", "n": True}).encode(), 400),
            ("POST /v1/completions", {}, json.dumps({"prompt": "x", "specgate": {"arm": "ngram:²"}}).encode(), 400),
            ("POST /v1/completions", {}, json.dumps({"prompt": "x", "top_k": 2**40}).encode(), 400),
            ("GET /metrics", {"Authorization": ""}, b"", 401),
        ]
        for _ in range(n):
            for line, headers, body, want in cases:
                got = self._raw_http(line, headers, body)
                self.tally.add("malformed", "refused" if got == want else "wrong", f"{line} {headers} -> {got}")
        raw = self.channel.unary_unary("/specgate.v1.Gateway/Generate", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
        from gateway.pb import specgate_pb2 as pb

        grpc_cases = [lambda: raw(b"\x0a\x03a\xffb", metadata=self.meta, timeout=10),
                      lambda: self.stub.Generate(pb.GenerateRequest(prompt="x", arm="ngram:²"), metadata=self.meta),
                      lambda: self.stub.Generate(pb.GenerateRequest(prompt="x", temperature=float("nan")),
                                                 metadata=self.meta),
                      lambda: self.stub.Generate(pb.GenerateRequest(prompt="x"), timeout=10)]  # no key
        for _ in range(n):
            for case in grpc_cases:
                try:
                    case()
                    self.tally.add("malformed", "wrong", "accepted")
                except grpc.RpcError as e:
                    ok = e.code().name in ("INVALID_ARGUMENT", "UNAUTHENTICATED")
                    self.tally.add("malformed", "refused" if ok else "wrong", f"{e.code().name} {e.details()}")
        return before, rss_mb(self.gateway.pid)

    def _raw_http(self, line: str, headers: dict, body: bytes) -> int:
        method, path = line.split()
        h = {"Host": "x", "Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
             "Content-Length": str(len(body)), **headers}
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v) + "\r\n"
        try:
            with socket.create_connection(("127.0.0.1", self.http_port), timeout=20) as s:
                s.sendall(head.encode() + body)
                data = s.recv(65536)
            m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
            return int(m.group(1)) if m else 0
        except OSError:
            return 0

    def redis_outage(self) -> None:
        """Requests keep coming while Redis is killed and brought back."""
        results = []

        def unary():
            import grpc

            try:
                self.stub.Generate(self.request(max_tokens=20), metadata=self.meta, timeout=60)
                self.tally.add("redis", "ok")
                results.append(True)
            except grpc.RpcError as e:
                self.tally.add("redis", "wrong", f"{e.code().name} {e.details()}")

        threads = []
        for i in range(60):
            if i == 15:
                self.redis.kill()
            if i == 45:
                self.redis.start()
            t = threading.Thread(target=unary)
            t.start()
            threads.append(t)
            time.sleep(0.1)
        for t in threads:
            t.join()

    def worker_kill(self) -> None:
        n = min(8, self.args.limit)
        first = threading.Event()
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(self.stream, "worker", ("UNAVAILABLE",), 600, first) for _ in range(n)]
            first.wait(30)
            time.sleep(0.2)
            self.workers[0].send_signal(signal.SIGKILL)  # streams on it end UNAVAILABLE: the right code
            for f in futures:
                f.result()
        time.sleep(1.5)  # out of rotation
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda _: self.stream("worker", (), 50), range(n)))  # all on the surviving worker

    def sigterm(self) -> int:
        n = min(6, self.args.limit - 1)
        first = threading.Event()
        with ThreadPoolExecutor(n + 1) as pool:
            futures = [pool.submit(self.stream, "sigterm", (), 300, first) for _ in range(n)]
            first.wait(30)
            self.gateway.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            late = pool.submit(self.stream, "sigterm", ("UNAVAILABLE",), 10)  # refused: draining
            for f in futures + [late]:
                f.result()
        return self.gateway.wait(60)

    def outcomes(self) -> tuple[int, float]:
        """Records in the stream, and the drops the gateway counted (from /metrics)."""
        import redis

        written = redis.Redis.from_url(self.redis.url).xlen("specgate:outcomes")
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        text = conn.getresponse().read().decode()
        m = re.search(r"^specgate_telemetry_dropped(?:_total)?(?:\{[^}]*\})? ([0-9.e+]+)", text, re.M)
        return written, float(m.group(1)) if m else float("nan")

    def close(self) -> None:
        self.channel.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.redis.stop()


def served_so_far(t: Tally) -> int:
    return sum(c["ok"] for c in t.counts.values())


def main(args) -> int:
    from bench import cpu_model

    print(f"machine: {cpu_model()}", flush=True)
    t_start = time.monotonic()
    print("starting the gateway, two workers and Redis ...", flush=True)

    def phase(name, run):
        t0 = time.monotonic()
        out = run()
        print(f"  {name}: {time.monotonic() - t0:.1f} s", flush=True)
        return out

    with tempfile.TemporaryDirectory(prefix="specgate-chaos-") as tmp:
        drill = Drill(args, Path(tmp))
        print(f"  ready in {time.monotonic() - t_start:.1f} s", flush=True)
        try:
            rss0 = rss_mb(drill.gateway.pid)
            lat = phase("saturation", drill.saturation)
            rss_before, rss_after = phase("malformed", drill.malformed)
            phase("redis outage", drill.redis_outage)
            phase("worker kill", drill.worker_kill)
            written, dropped = drill.outcomes()
            deadline = time.monotonic() + 15
            while written < served_so_far(drill.tally) and time.monotonic() < deadline:
                time.sleep(0.5)  # the sink delivers what it held while Redis was away
                written, dropped = drill.outcomes()
            exit_code = phase("sigterm", drill.sigterm)
        finally:
            logs = {p.name: p.read_text()[-2000:] for p in Path(tmp).glob("*.log")}
            drill.close()
    t = drill.tally
    served = sum(c["ok"] for phase, c in t.counts.items() if phase != "sigterm")
    print("\n| phase | sent | succeeded | refused (right code) | failed wrongly |\n|---|---|---|---|---|")
    for phase, c in t.counts.items():
        print(f"| {phase} | {sum(c.values())} | {c['ok']} | {c['refused']} | {c['wrong']} |")
    tot = Counter()
    for c in t.counts.values():
        tot.update(c)
    print(f"| all | {sum(tot.values())} | {tot['ok']} | {tot['refused']} | {tot['wrong']} |")
    lat.sort()
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    print(f"\nhealth under saturation ({args.limit}+{args.extra} streams): {len(lat)} probes, "
          f"p50 {statistics.median(lat) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms")
    print(f"outcomes: {written} written to Redis for {served} requests served before the SIGTERM phase; "
          f"drops counted by the gateway: {dropped:g}")
    print(f"gateway RSS: {rss0:.0f} MB at start, {rss_before:.0f} MB before the malformed burst, {rss_after:.0f} MB "
          f"after it (+{rss_after - rss_before:.0f} MB)")
    print(f"gateway exit code after SIGTERM: {exit_code}; drill took {time.monotonic() - t_start:.0f} s")
    for w in t.wrong[:20]:
        print(f"  wrong: {w}")
    ok = not t.wrong and p99 < 0.1 and rss_after - rss_before < 50 and exit_code == 0 and written >= served
    if args.out:
        Path(args.out).write_text(json.dumps(dict(counts={k: dict(v) for k, v in t.counts.items()}, wrong=t.wrong,
                                                  health_p99_s=p99, written=written, served=served, dropped=dropped,
                                                  rss_mb=[rss0, rss_before, rss_after],
                                                  exit_code=exit_code, cpu=cpu_model()), indent=1))
    if not ok:
        print("FAIL: a target was missed (see above); logs:", file=sys.stderr)
        for name, text in logs.items():
            print(f"--- {name}\n{text}", file=sys.stderr)
    return 0 if ok else 1
