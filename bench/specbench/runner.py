"""Sending the workload through a gateway and recording what came back.

Concurrency 1 interleaves the modes per request (request i under every mode,
back to back, the order rotated per request), so slow drift of a shared
machine hits every mode alike. Above 1, each mode runs the whole workload with
that many clients in flight, modes one after another.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc

from bench.specbench.workload import ADAPTIVE, BenchRequest
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc


class Progress:
    """One line on stderr: done/total, rate, ETA. Redrawn in place on a
    terminal, printed every 10% otherwise (CI logs)."""

    def __init__(self, total: int, label: str, stream=sys.stderr):
        self.total, self.label, self.stream = max(total, 1), label, stream
        self.done, self.t0, self._lock = 0, time.monotonic(), threading.Lock()
        self._tty = hasattr(stream, "isatty") and stream.isatty()
        self._next_pct = 10

    def step(self, note: str = "") -> None:
        with self._lock:
            self.done += 1
            elapsed = time.monotonic() - self.t0
            eta = elapsed / self.done * (self.total - self.done)
            pct = 100 * self.done // self.total
            width = 24
            bar = "#" * (width * self.done // self.total)
            line = (f"{self.label} [{bar:<{width}}] {self.done}/{self.total} {elapsed:5.0f}s "
                    f"eta {eta:4.0f}s {note}")
            if self._tty:
                self.stream.write("\r" + line[:160].ljust(160))
                if self.done == self.total:
                    self.stream.write("\n")
            elif pct >= self._next_pct or self.done == self.total:
                self.stream.write(line + "\n")
                self._next_pct = pct // 10 * 10 + 10
            self.stream.flush()


def make_request(r: BenchRequest, mode: str, max_tokens: int, category_hint: bool,
                 seed_offset: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=r.prompt)], max_tokens=max_tokens,
        temperature=r.temperature, seed=r.seed + seed_offset, arm="" if mode == ADAPTIVE else mode,
        category=r.category if category_hint else "")


def call(stub: pb_grpc.GatewayStub, r: BenchRequest, mode: str, max_tokens: int, *, category_hint: bool = False,
         timeout_s: float = 600.0, seed_offset: int = 0, metadata=None) -> dict:
    """One request; a measurement dict (errors are recorded, not raised)."""
    req = make_request(r, mode, max_tokens, category_hint, seed_offset)
    t0 = time.perf_counter()
    m = dict(idx=r.idx, mode=mode, category=r.category, temperature=r.temperature, start_s=time.time())
    try:
        resp = stub.Generate(req, timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as e:
        m.update(latency_s=time.perf_counter() - t0, error=f"{e.code().name}: {e.details()}")
        return m
    m.update(
        latency_s=time.perf_counter() - t0, output_tokens=resp.usage.output_tokens,
        prompt_tokens=resp.usage.prompt_tokens, arm=resp.decision.arm, source=resp.decision.source,
        explored=resp.decision.explored, policy_version=resp.decision.policy_version,
        predicted_speedup=round(resp.decision.predicted_speedup, 4), drafted=resp.spec.drafted,
        accepted=resp.spec.accepted, rounds=resp.spec.rounds, ttft_s=resp.timings.ttft_s,
        server_s=resp.timings.total_s, queue_s=resp.timings.queue_s, finish_reason=resp.finish_reason,
        text_sha=hashlib.sha256(resp.text.encode()).hexdigest()[:16], text_head=resp.text[:80])
    return m


def engine_prices(stub: pb_grpc.GatewayStub, metadata=None) -> list[dict]:
    """What each engine behind the gateway prices work at on its machine, as its
    status says: a lone row's step by tokens fed (a decode step, then verifying 1,
    2, ... drafts) and each model draft's seconds per drafted token. Recorded with
    a run, so that a prior fit to it can be priced by the machine it ran on; an
    engine that does not say gives empty figures, a gateway that does not answer
    none."""
    try:
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=metadata)
    except grpc.RpcError:
        return []
    return [dict(id=e.id, lone_step_s=[round(x, 6) for x in e.load.lone_step_s],
                 drafting_s={d: round(x, 6) for d, x in sorted(e.load.drafting_s.items())})
            for e in status.engines if e.healthy]


def rotated(modes: list[str], k: int) -> list[str]:
    k %= len(modes)
    return modes[k:] + modes[:k]


def run_interleaved(send: Callable[[BenchRequest, str, int], dict], requests: list[BenchRequest],
                    modes: list[str], repeats: int, progress: Progress) -> list[dict]:
    """Concurrency 1: every request under every mode back to back."""
    out = []
    for rep in range(repeats):
        for r in requests:
            for mode in rotated(modes, r.idx + rep):
                m = send(r, mode, rep)
                m.update(concurrency=1, repeat=rep)
                out.append(m)
                progress.step(f"{mode} {r.category}")
    return out


def run_concurrent(send: Callable[[BenchRequest, str, int], dict], requests: list[BenchRequest], mode: str,
                   concurrency: int, rep: int, progress: Progress) -> tuple[float, list[dict]]:
    """One mode over the whole workload with `concurrency` requests in flight.
    Returns (wall seconds from first send to last answer, measurements)."""
    t0 = time.perf_counter()

    def one(r: BenchRequest) -> dict:
        m = send(r, mode, rep)
        m.update(concurrency=concurrency, repeat=rep)
        progress.step(f"{mode} c={concurrency}")
        return m

    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, requests))
    return time.perf_counter() - t0, out


def run_stream(send: Callable[[BenchRequest, str, int], dict], requests: Iterable[tuple[int, BenchRequest]],
               progress: Progress) -> list[dict]:
    """The learning curve: adaptive requests one after another, in order."""
    out = []
    for k, r in requests:
        m = send(r, ADAPTIVE, 1_000 + k)  # a seed of its own per served request
        m.update(concurrency=1, served=k)
        out.append(m)
        progress.step(f"{m.get('arm', 'error')} {r.category}")
    return out
