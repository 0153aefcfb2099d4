"""What the tests share: tiny random models and a word-level tokenizer built
in-process, the exact distribution a sampler must follow, a real gateway on a
loopback port in front of a tiny engine, and engine worker processes."""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch

from engines.api import GenerationRequest, SamplingParams
from engines.arms import Arm, ArmMenu
from engines.builtin import BuiltinEngine
from engines.config import EngineConfig, NgramDraftConfig, TargetConfig
from engines.errors import EngineError
from engines.llama import LlamaConfig, LlamaModel, LlamaWeights
from engines.loading import LoadedModel
from engines.proposers import NgramProposer
from engines.proposers.base import ProposerBase
from engines.sampling import logits_to_probs
from policy.features import RequestFeatures
from policy.model import expected_tokens_per_round
from policy.train import TrainingRow

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "gateway.cli"]

# ----------------------------------------------------------------------------- tiny models
from bench.tiny import WORDS, tiny_tokenizer, write_tiny_engine  # noqa: E402,F401 - re-exported for the tests
from bench.tiny import tiny_hf_model as _tiny_hf_model  # noqa: E402


def tiny_hf_model(*args, dtype=torch.float64, **kw):
    return _tiny_hf_model(*args, dtype=dtype, **kw)


def lean_from_hf(hf_model, dtype=torch.float64) -> LlamaModel:
    cfg = LlamaConfig.from_hf(hf_model.config)
    weights = LlamaWeights.from_state_dict(cfg, hf_model.state_dict(), hf_model.config, dtype, "cpu")
    return LlamaModel(cfg, weights)


def as_gguf(weights: LlamaWeights) -> LlamaWeights:
    """The weights through GGUF's own quantizers and back, in place, as a GGUF model
    loads: the layers' matmuls Q4_1, the head Q8_0 (float32)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from engines.layouts import MATMULS

    def through(w: torch.Tensor, qtype) -> torch.Tensor:
        a = w.detach().to(torch.float32).numpy()
        return torch.from_numpy(dequantize(quantize(a, qtype), qtype).reshape(a.shape).copy())

    for lw in weights.layers:
        for name in MATMULS:
            setattr(lw, name, through(getattr(lw, name), Q.Q4_1))
    weights.lm_head = through(weights.lm_head, Q.Q8_0)
    return weights


def tiny_loaded(seed=0, scale=1.0, words=WORDS, dtype=torch.float64, **kw) -> LoadedModel:
    hf = tiny_hf_model(vocab=len(words), seed=seed, scale=scale, **kw)
    return LoadedModel(lean_from_hf(hf, dtype), tiny_tokenizer(words), hf.config, "tiny")


# ----------------------------------------------------------------------------- engine runs
def engine_over(target: LlamaModel, words=WORDS, *, max_context: int = 128, gamma_max: int = 8, cost=None,
                max_step_stretch: float | None = None, coupled_sampling: bool = False, **drafts) -> BuiltinEngine:
    """The built-in engine over a lean target and a tiny tokenizer (EOS id 1), with
    these proposer factories as drafts; its loop is not started (`run_together` serves it)."""
    cfg = EngineConfig(target=TargetConfig(max_context=max_context), drafts=[], gamma_max=gamma_max,
                       max_queue=4096, max_batch=64, max_step_stretch=max_step_stretch,
                       coupled_sampling=coupled_sampling)
    hf_config = type("C", (), {"eos_token_id": 1})()
    return BuiltinEngine(LoadedModel(target, tiny_tokenizer(words), hf_config, "t"), drafts, cfg,
                         start_worker=False, cost=cost)


def run_together(engine: BuiltinEngine, requests: list[GenerationRequest], timeout: float = 120,
                 errors: bool = False):
    """Submit all before the loop starts, so that they share steps; serve them on
    a thread; return their results in order (with `errors`, the EngineError a
    request ended with in its place, instead of raising it)."""
    handles = [engine.submit(r) for r in requests]
    t = threading.Thread(target=engine.serve_forever, daemon=True)
    t.start()
    try:
        return [_result(h, timeout, errors) for h in handles]
    finally:
        engine.close()
        t.join(10)


def _result(handle, timeout: float, errors: bool):
    try:
        return handle.wait(timeout)
    except EngineError as e:
        if not errors:
            raise
        return e


def token_request(i, ids, arm="plain", **sampling) -> GenerationRequest:
    return GenerationRequest(request_id=str(i), prompt_token_ids=tuple(ids), arm=Arm.parse(arm),
                             sampling=SamplingParams(**{"max_tokens": 20, **sampling}))


def exact_joint_of_first_tokens(target: LlamaModel, prompt: list[int], sp: SamplingParams, n: int) -> dict:
    """P(t_1..t_n) under plain sampling, by enumerating every prefix."""
    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in dist.items():
            logits = target.forward(torch.tensor(prompt + list(prefix)), target.new_cache(64), all_logits=False)
            probs = logits_to_probs(logits, sp)[0]
            for tok in probs.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = pr * float(probs[tok])
        dist = nxt
    return dist


def assert_follows(exact: dict, counts: dict, trials: int, label: str = "") -> None:
    """Chi-square on the joint of each pair of consecutive speculative positions
    (the full joint has too many cells for a few thousand samples)."""
    from scipy.stats import chisquare

    assert set(counts) <= set(exact), f"{label}: sequences the target gives probability 0"
    for pos in [(1, 2), (2, 3)]:
        me, mo = {}, {}
        for seq, pr in exact.items():
            k = tuple(seq[i] for i in pos)
            me[k] = me.get(k, 0.0) + pr
            mo[k] = mo.get(k, 0) + counts.get(seq, 0)
        big = [k for k in me if me[k] * trials >= 5]
        rest = [k for k in me if me[k] * trials < 5]
        obs = [mo[k] for k in big] + ([sum(mo[k] for k in rest)] if rest else [])
        exp = [me[k] * trials for k in big] + ([sum(me[k] for k in rest) * trials] if rest else [])
        assert len(obs) >= 5
        stat, p = chisquare(obs, exp, sum_check=False)
        assert p > 1e-3, f"{label} positions {pos}: output does not follow the target (chi2={stat:.1f}, p={p:.2g})"


# ----------------------------------------------------------------------------- a real gateway
ENGINE_CONFIG = EngineConfig(target=TargetConfig(max_context=96), drafts=[NgramDraftConfig()], gamma_max=6,
                             max_queue=8)


def rules(text: str = "default: {explore: 0.0}"):
    from policy.rules import parse_rules

    return parse_rules(text)


def tiny_engine(config: EngineConfig = ENGINE_CONFIG, **drafts) -> BuiltinEngine:
    target = tiny_loaded(scale=4.0)
    drafts = drafts or {"ngram": lambda cap: NgramProposer(1, 3)}
    return BuiltinEngine(target, drafts, config)


class RaisingDraft(ProposerBase):
    """A draft whose every proposal raises."""

    def propose(self, *a):
        raise RuntimeError("boom")


def slow_engine(step_s=0.02, **kw) -> BuiltinEngine:
    """A tiny engine whose every step takes step_s: requests last long enough to
    cancel, time out or drain."""

    class Slow(ProposerBase):
        def propose(self, context, gamma, sampling, generator):
            time.sleep(step_s)
            return NgramProposer(1, 3).propose(context, gamma, sampling, generator)

    cfg = EngineConfig(target=TargetConfig(max_context=96), drafts=[NgramDraftConfig(name="slow")], gamma_max=2, **kw)
    return tiny_engine(cfg, slow=lambda cap: Slow())


SLOW = dict(prompt="hello world", max_tokens=80, arm="slow:1", stop=["nevermatches"])


@dataclass
class Gateway:
    serving: object  # gateway.app.ServingApp
    engine: BuiltinEngine | None
    channel: grpc.Channel

    @property
    def service(self):
        return self.serving.service

    @property
    def port(self) -> int:
        return self.serving.grpc_port

    @property
    def http_port(self) -> int:
        return self.serving.http_port

    @property
    def stub(self):
        from gateway.pb import specgate_pb2_grpc as pb_grpc

        return pb_grpc.GatewayStub(self.channel)

    def close(self, grace_s: float = 0.0):
        self.channel.close()
        self.serving.stop(grace_s)
        if self.engine is not None:
            self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_gateway(engine: BuiltinEngine | None = None, keys=None, rules_=None, endpoints=None, http: bool = False,
                  sink=None, instrumentation=None, acceptance=None, metrics_text=None, **config) -> Gateway:
    """A real gateway on loopback ports (gRPC, and HTTP with `http`) over a tiny
    engine (or `endpoints`), with in-memory telemetry unless a sink is given."""
    from gateway.app import build_app, serve_in_background
    from gateway.auth import KeyStore
    from gateway.config import AuthConfig, GatewayConfig
    from gateway.policy_state import PolicyState
    from telemetry.otel import Instrumentation
    from telemetry.outcomes import MemoryOutcomeSink
    from telemetry.runtime import Telemetry

    if endpoints is None:
        engine = engine or tiny_engine()
    sink = sink if sink is not None else MemoryOutcomeSink()
    telemetry = Telemetry(sink, instrumentation or Instrumentation(sink=sink), acceptance, metrics_text)
    cfg = GatewayConfig(**{"listen": "127.0.0.1:0", "http_listen": "127.0.0.1:0" if http else None, **config})
    app = build_app(cfg, engine, endpoints=endpoints, policy=PolicyState(rules_ or rules()),
                    keys=KeyStore(keys, env="") if keys is not None else KeyStore(AuthConfig(), env=""),
                    telemetry=telemetry)
    serving = serve_in_background(app)
    return Gateway(serving, engine, grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}"))


def key(tenant: str, secret: str, methods=None):
    from gateway.config import TenantKey

    return TenantKey(tenant=tenant, key_sha256=hashlib.sha256(secret.encode()).hexdigest(), methods=methods)


def request(prompt="hello world the cat", **kw):
    from gateway.pb import specgate_pb2 as pb

    kw.setdefault("max_tokens", 8)
    return pb.GenerateRequest(prompt=prompt, **kw)


def wait_idle(engine: BuiltinEngine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ld = engine.load()
        if ld.running == 0 and ld.waiting == 0:
            return True
        time.sleep(0.02)
    return False


# ----------------------------------------------------------------------------- a synthetic policy world
# Outcomes of a world whose best arm depends on category, temperature and load:
# what learning is tested on.
WORLD_ARMS = ArmMenu(("ngram", "draft"), 1, 8).all_arms()
# true per-token acceptance at T = 0
BASE_ALPHA = {
    "ngram": {"summarization": 0.85, "rag": 0.75, "code": 0.45, "translation": 0.3, "chat": 0.1, "qa": 0.15,
              "math": 0.35},
    "draft": {"summarization": 0.6, "rag": 0.55, "code": 0.75, "translation": 0.8, "chat": 0.6, "qa": 0.55,
              "math": 0.7},
}
COPY = {"summarization": 0.8, "rag": 0.7, "code": 0.3, "translation": 0.4, "chat": 0.1, "qa": 0.1, "math": 0.2}
DRAFT_COST = {"ngram": 0.03, "draft": 0.25}  # plain steps per drafted token
LOAD_COST = 0.02  # per drafted token per request in the engine


def world_alpha(draft, f):
    return BASE_ALPHA[draft][f.category] * (1 - 0.6 * min(f.temperature, 1.0))


def world_cost(draft, gamma, load):
    return 1 + DRAFT_COST[draft] * gamma + LOAD_COST * gamma * load


def world_speedup(arm, f):
    if arm.is_plain:
        return 1.0
    return expected_tokens_per_round(world_alpha(arm.draft, f), arm.gamma) / world_cost(arm.draft, arm.gamma, f.load)


def world_context(rng):
    cat = rng.choice(list(COPY))
    return RequestFeatures(category=cat, temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), top_p=1.0,
                           prompt_tokens=rng.randint(20, 1500), expected_output_tokens=200,
                           copy_signal=COPY[cat], running=1, waiting=rng.choice([0, 0, 1, 3, 7, 15, 31]))


def world_outcomes(n, seed, step_s=0.05, arms=WORLD_ARMS, undrafted=False):
    """Uniformly random `arms` (propensity 1/|arms|), noisy outcomes, a plain step of
    `step_s` when idle; `undrafted`: each row says what its rounds took undrafted."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        f = world_context(rng)
        arm = rng.choice(arms)
        out = 200
        step = step_s * (1 + 0.03 * f.load) * nrng.lognormal(0, 0.05)
        if arm.is_plain:
            rounds, secs = out - 1, (out - 1) * step
        else:
            tau = expected_tokens_per_round(world_alpha(arm.draft, f), arm.gamma) * nrng.lognormal(0, 0.08)
            rounds = max(1, round((out - 1) / tau))
            secs = rounds * world_cost(arm.draft, arm.gamma, f.load) * step
        rows.append(TrainingRow(f, arm, 1 / len(arms), out, rounds, secs, request_id=f"w{seed}-{len(rows)}",
                                plain_s=rounds * step if undrafted else None))
    return rows


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(config: Path, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(CLI + ["engine", "--listen", f"127.0.0.1:{port}", "--config", str(config), "--id",
                                   f"w{port}", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, text=True)


def wait_listening(proc: subprocess.Popen, timeout: float = 60) -> str:
    """Read the process's output until it says it listens; returns what it printed."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if "listening" in line:
            return "".join(seen)
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}): {''.join(seen)}{proc.stdout.read()}")
    raise TimeoutError(f"did not start: {''.join(seen)}")
