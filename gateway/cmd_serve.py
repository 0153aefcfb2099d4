"""Run the gateway: the gRPC API (and, with --http, the OpenAI-compatible HTTP
API) in front of the built-in engine on SmolLM2 and/or remote engines.

With no config it serves 127.0.0.1:50051 with the built-in engine and the
shipped rules; with no Redis configured it starts a private, supervised
redis-server and retrains in-process; with no API keys it listens on loopback
only. SIGTERM drains: health turns NOT_SERVING, new calls are refused, calls in
flight get `drain_grace_s` to finish.
"""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger("specgate")


def add_arguments(s) -> None:
    s.add_argument("--config", help="gateway config YAML (see README); flags below override it")
    s.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:50051)")
    s.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI-compatible HTTP API and /metrics")
    s.add_argument("--rules", help="operator rules YAML (default: policy/default_rules.yaml)")
    s.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                   help="a remote engine worker to route to (repeatable)")
    s.add_argument("--no-embedded-engine", action="store_true", help="route only to --engine workers")


def load_config(args):
    from gateway.config import RemoteEngineConfig, load_gateway_config

    config = load_gateway_config(args.config)
    update = {}
    if args.listen:
        update["listen"] = args.listen
    if args.http:
        update["http_listen"] = args.http
    if args.rules:
        update["rules"] = args.rules
    if args.engine:
        update["remote_engines"] = list(config.remote_engines) + [RemoteEngineConfig(address=a) for a in args.engine]
    if args.no_embedded_engine:
        update["embedded_engine"] = False
    return config.model_copy(update=update)


def redacted(config) -> str:
    """The config as JSON for the log, without secrets (keys, passwords in URLs)."""
    import re

    text = config.model_dump_json(exclude={"auth"})
    return re.sub(r"(redis://[^:/@\s\"]*:)[^@\s\"]+@", r"\1***@", text)


def main(args) -> int:
    from pydantic import ValidationError

    from gateway.app import EventLoopThread, build_app, install_sigterm
    from policy.rules import RulesError

    try:
        config = load_config(args)
    except (OSError, ValueError, ValidationError) as e:
        print(f"error: config: {e}", file=sys.stderr)
        return 2
    log.info("config: %s", redacted(config))
    engine = None
    if config.embedded_engine:
        from engines.builtin import BuiltinEngine

        engine = BuiltinEngine.from_config(config.engine, start_worker=False)
    try:
        app = build_app(config, engine)
    except (OSError, ValueError, RulesError) as e:
        print(f"error: {e}", file=sys.stderr)
        if engine is not None:
            engine.close()
        return 2
    io = EventLoopThread()
    try:
        io.run(app.start(), timeout=120)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        app.close()
        io.stop()
        if engine is not None:
            engine.close()
        return 2
    if app.http_port:
        host = config.http_listen.rsplit(":", 1)[0]
        print(f"OpenAI-compatible HTTP API on http://{host}:{app.http_port}/v1 (metrics at /metrics)", flush=True)
    host = config.listen.rsplit(":", 1)[0]
    svc = app.service
    print(f"specgate gateway listening on {host}:{app.grpc_port} ({'TLS' if config.tls else 'plaintext'}); "
          f"engines: {', '.join(e.id for e in svc.router.endpoints)}; rules {svc.policy.rules.digest}; "
          f"policy {svc.policy.model.version}", flush=True)
    if not app.keys.enabled:
        print("no API keys configured: listening on loopback only, every caller is the anonymous tenant", flush=True)
    stopped = threading.Event()

    def on_term():
        try:
            io.run(app.drain(config.drain_grace_s))
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.exception("error while draining")
        app.close()
        if engine is not None:
            engine.close()
        io.stop()
        stopped.set()
        log.info("drained; exiting")

    install_sigterm(on_term)
    if engine is not None:
        engine.serve_forever()  # on the main thread: see engines/builtin.py
    stopped.wait()
    return 0
