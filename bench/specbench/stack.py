"""The deployment `specgate bench` starts when no gateway address is given:
a private redis-server, `specgate serve` and `specgate retrain` as separate
processes wired as in production (outcomes and signed policy models through
Redis), so what is measured is the product, not a test double."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from telemetry.redis_server import PrivateRedis, free_port


class StackError(RuntimeError):
    pass


class Stack:
    """Redis + gateway + retrainer. `policy`: None (the cold-start prior) or a
    policy model JSON path."""

    def __init__(self, *, policy: str | None, rules: str | None, engine_config: str | None,
                 retrain_every: int, retrain_min_rows: int, log_dir: Path, startup_timeout_s: float = 600):
        self.dir = Path(tempfile.mkdtemp(prefix="specgate-bench-"))
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.key = secrets.token_hex(32)
        (self.dir / "redis").mkdir()
        self.redis = PrivateRedis(data_dir=str(self.dir / "redis"))
        self.port = free_port()
        config: dict = dict(listen=f"127.0.0.1:{self.port}", policy_model=policy, rules=rules,
                            telemetry=dict(redis_url=self.redis.url))
        if engine_config:
            config["engine"] = yaml.safe_load(Path(engine_config).read_text()) or {}
        cfg_path = self.dir / "gateway.yaml"
        cfg_path.write_text(yaml.safe_dump({k: v for k, v in config.items() if v is not None}))
        env = dict(os.environ, SPECGATE_ARTIFACT_KEY=self.key, SPECGATE_REDIS_URL=self.redis.url)
        cli = [sys.executable, "-m", "gateway.cli"]
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self._spawn("gateway", cli + ["serve", "--config", str(cfg_path)], env)
        # the retrainer shares the 2 cores with the engine being timed: at the lowest priority and on one
        # thread, so that a fit runs in the engine's idle moments instead of stalling its OpenMP threads
        # (an engine sharing its cores runs several times slower, not at half speed)
        quiet = dict(env, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._spawn("retrainer", ["nice", "-n", "19"] + cli + ["retrain", "--every", str(retrain_every),
                                                              "--min-rows", str(retrain_min_rows)], quiet)
        self.address = f"127.0.0.1:{self.port}"
        self._wait_ready(startup_timeout_s)

    def _spawn(self, name: str, argv: list[str], env: dict) -> None:
        path = self.log_dir / f"{name}.log"
        with open(path, "w") as f:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    cwd=Path(__file__).resolve().parents[2])
        self.procs.append((name, proc, path))

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.GatewayStub(ch)
            while time.monotonic() < deadline:
                for name, proc, path in self.procs:
                    if proc.poll() is not None:
                        tail = path.read_text()[-3000:]
                        self.close()
                        raise StackError(f"{name} exited with {proc.returncode} while starting:\n{tail}")
                try:
                    status = stub.GetStatus(pb.GetStatusRequest(), timeout=2)
                    if any(e.healthy for e in status.engines):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        self.close()
        raise StackError(f"gateway not ready after {timeout_s:.0f} s (see {self.log_dir}/gateway.log)")

    def live_policy_json(self) -> str | None:
        """The policy model live now, verified with the run's key (None: the prior)."""
        import redis

        from telemetry.artifacts import CURRENT, load_verified

        client = redis.Redis.from_url(self.redis.url)
        version = client.get(CURRENT)
        return None if version is None else load_verified(client, version.decode(), self.key.encode()).to_json()

    def close(self) -> None:
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()
        self.redis.stop()
