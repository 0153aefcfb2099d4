"""A private redis-server on a loopback port: the embedded default when no Redis
is configured, and what the tests run against.

It listens on 127.0.0.1 only, with a random password made at each start and
passed in a config file only this user can read (a command-line argument would
show in `ps`), and dies with the process that started it. With `supervise`, a
redis-server that dies is restarted with backoff on the same port, password and
data directory (append-only file: what was written survives).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Outage:
    """Logs that `what` lost Redis once when it happens and once when it ends,
    and paces the retries (exponential backoff)."""

    def __init__(self, what: str, logger: logging.Logger, first_s: float = 0.2, cap_s: float = 2.0):
        self.what, self.log, self.first, self.cap = what, logger, first_s, cap_s
        self.down_since: float | None = None
        self._delay = first_s

    def begin(self, error: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.log.warning("%s: Redis unavailable (%s: %s); retrying until it returns", self.what,
                             type(error).__name__, str(error)[:200])

    def over(self) -> None:
        if self.down_since is not None:
            self.log.info("%s: Redis is back after %.1f s", self.what, time.monotonic() - self.down_since)
            self.down_since, self._delay = None, self.first

    def backoff(self) -> float:
        d = self._delay
        self._delay = min(self._delay * 2, self.cap)
        return d


def _with_parent_death_signal(argv: list[str]) -> list[str]:
    """argv under `setpriv --pdeathsig TERM` (util-linux), so that the server dies
    with this process. Not a preexec_fn: Python code between fork and exec in a
    process with gRPC's threads can abort the child (Python documents it unsafe)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *argv] if setpriv else argv


class PrivateRedis:
    def __init__(self, port: int | None = None, data_dir: str | None = None, supervise: bool = False,
                 password: str | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.dir = Path(data_dir or tempfile.mkdtemp(prefix="specgate-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.password = password if password is not None else secrets.token_urlsafe(24)
        self._binary = binary
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self.start()
        if supervise:
            threading.Thread(target=self._supervise, name="specgate-redis-supervisor", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def _config(self) -> Path:
        conf = self.dir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            # appendonly: a restart keeps what was written before
            f.write(f"port {self.port}\nbind 127.0.0.1\nprotected-mode yes\ndir {self.dir}\n"
                    f"appendonly yes\nsave \"\"\nrequirepass {self.password}\n"
                    f"logfile {self.dir / 'redis.log'}\n")
        return conf

    def _log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join((self.dir / "redis.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 10.0, attempts: int = 3) -> None:
        """Start redis-server and wait for its port. A start that dies is tried
        again (after a SIGKILL the data directory can need a moment); the last
        failure raises with the tail of redis.log."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))

    def _start_once(self, timeout: float) -> None:
        self.proc = subprocess.Popen(_with_parent_death_signal([self._binary, str(self._config())]),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start (code {self.proc.returncode}) on port "
                                   f"{self.port}; {self.dir / 'redis.log'} ends:\n{self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.proc.kill()
        raise TimeoutError(f"redis-server did not start on port {self.port}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _supervise(self) -> None:
        outage = Outage("private redis-server", log)
        while not self._stopping.wait(0.5):
            if self.alive:
                continue
            outage.begin(RuntimeError(f"redis-server exited with code {self.proc.returncode if self.proc else '?'}"))
            while not self._stopping.wait(outage.backoff()):
                try:
                    self.start()
                except (OSError, RuntimeError, TimeoutError):
                    continue
                self.restarts += 1
                outage.over()
                break

    def kill(self) -> None:
        """SIGKILL the server (tests and fault drills); a supervised one comes back."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self._stopping.set()
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
