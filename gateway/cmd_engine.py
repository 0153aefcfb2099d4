"""Serve a built-in engine to gateways over the internal gRPC API (`specgate
engine --listen HOST:PORT`), listed in a gateway's `remote_engines`.

Beyond loopback a worker needs credentials: the shared token in
$SPECGATE_WORKER_TOKEN (the gateway sends the same), or mTLS (--tls-cert,
--tls-key, --tls-client-ca); otherwise a caller could bypass the gateway's keys,
rules and telemetry."""

from __future__ import annotations

import os
import sys
import threading


def add_arguments(e) -> None:
    e.add_argument("--listen", required=True, help="HOST:PORT")
    e.add_argument("--config", help="engine config YAML (EngineConfig; default: SmolLM2 with its drafts)")
    e.add_argument("--id", help="name in gateway status (default: the listen address)")
    e.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key)")
    e.add_argument("--tls-key", help="PEM private key")
    e.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates signed by it (mTLS)")


def main(args) -> int:
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from gateway.app import EventLoopThread, install_sigterm
    from gateway.auth import WorkerToken
    from gateway.config import TLSConfig
    from gateway.grpc_server import create_engine_server, drain

    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            print("error: --tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        tls = TLSConfig(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)
    token = WorkerToken(os.environ.get("SPECGATE_WORKER_TOKEN", ""))
    try:
        config = load_engine_config(args.config)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = BuiltinEngine.from_config(config, start_worker=False)
    io = EventLoopThread()
    try:
        server, port, health = io.run(create_engine_server(args.listen, engine, args.id or args.listen, token, tls))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        io.stop()
        engine.close()
        return 2
    auth = "token" if token.enabled else ("mTLS" if tls and tls.client_ca else "none (loopback)")
    print(f"specgate engine listening on {args.listen.rsplit(':', 1)[0]}:{port}; drafts {list(engine.arms().drafts)}; "
          f"auth {auth}", flush=True)
    stopped = threading.Event()

    def on_term():
        io.run(drain(server, health, 10))
        engine.close()
        io.stop()
        stopped.set()

    install_sigterm(on_term)
    engine.serve_forever()
    stopped.wait()
    return 0
