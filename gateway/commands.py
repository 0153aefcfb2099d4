"""`specgate serve`, `specgate engine`, and the client commands `generate`,
`decide`, `status`."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

log = logging.getLogger("specgate")


def add_commands(sub) -> None:
    s = sub.add_parser("serve", help="run the gateway (default: built-in engine on SmolLM2, loopback, no keys)")
    s.add_argument("--config", help="gateway config YAML (see README); flags below override it")
    s.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:50051)")
    s.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI-compatible HTTP API and /metrics")
    s.add_argument("--rules", help="operator rules YAML (default: policy/default_rules.yaml)")
    s.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                   help="a remote engine worker to route to (repeatable)")
    s.add_argument("--no-embedded-engine", action="store_true", help="route only to --engine workers")
    s.set_defaults(func=cmd_serve)

    e = sub.add_parser("engine", help="serve a built-in engine to gateways over the internal gRPC API")
    e.add_argument("--listen", required=True, help="HOST:PORT")
    e.add_argument("--config", help="engine config YAML (EngineConfig; default: SmolLM2 with ngram and selfspec)")
    e.add_argument("--id", help="name in gateway status (default: the listen address)")
    e.set_defaults(func=cmd_engine)

    for name, helptext in (("generate", "call a gateway and print the text, decision and stats"),
                           ("decide", "ask a gateway which arm it would choose, and why")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("prompt", help="the user message (sent as chat; --raw sends plain text)")
        c.add_argument("--address", default=os.environ.get("SPECGATE_ADDRESS", "127.0.0.1:50051"),
                       help="gateway HOST:PORT (default: $SPECGATE_ADDRESS or %(default)s)")
        c.add_argument("--api-key", default=os.environ.get("SPECGATE_API_KEY"),
                       help="API key (default: $SPECGATE_API_KEY)")
        c.add_argument("--raw", action="store_true", help="send prompt text without the chat template")
        c.add_argument("--max-tokens", type=int)
        c.add_argument("--temperature", type=float)
        c.add_argument("--top-p", type=float)
        c.add_argument("--top-k", type=int)
        c.add_argument("--seed", type=int)
        c.add_argument("--stop", action="append", default=[])
        c.add_argument("--category", default="", help="category hint")
        c.add_argument("--expected-tokens", type=int, help="expected output length hint")
        c.add_argument("--arm", default="", help="request an arm (honoured if the rules allow)")
        c.add_argument("--timeout", type=float, default=600, help="deadline in seconds (default: %(default)s)")
        c.add_argument("--json", action="store_true", help="print the response as JSON")
        if name == "generate":
            c.add_argument("--stream", action="store_true", help="print text as it is generated")
        c.set_defaults(func=cmd_generate if name == "generate" else cmd_decide)

    r = sub.add_parser("retrain", help="learn policy models from the outcome stream and promote the better ones")
    r.add_argument("--redis", default=os.environ.get("SPECGATE_REDIS_URL"), required=not os.environ.get(
        "SPECGATE_REDIS_URL"), help="redis://HOST:PORT/DB (default: $SPECGATE_REDIS_URL)")
    r.add_argument("--once", action="store_true", help="read what is there, retrain once, exit")
    r.add_argument("--every", type=int, default=500, help="retrain after this many new outcomes (default: %(default)s)")
    r.add_argument("--interval", type=float, help="also retrain every this many seconds when anything is new")
    r.add_argument("--window", type=int, default=50_000, help="outcomes kept for training (default: %(default)s)")
    r.add_argument("--min-rows", type=int, default=200,
                   help="outcomes needed before the first retraining (default: %(default)s)")
    r.add_argument("--arms", default="ngram,selfspec:1-8", help="arms the engines serve (default: %(default)s)")
    r.set_defaults(func=cmd_retrain)

    rb = sub.add_parser("rollback", help="make an earlier policy model version live again")
    rb.add_argument("version", nargs="?", help="version to restore (default: the one before the current)")
    rb.add_argument("--redis", default=os.environ.get("SPECGATE_REDIS_URL"), required=not os.environ.get(
        "SPECGATE_REDIS_URL"), help="redis://HOST:PORT/DB (default: $SPECGATE_REDIS_URL)")
    rb.set_defaults(func=cmd_rollback)

    from telemetry import bench as tbench

    tb = sub.add_parser("bench-telemetry", help="retraining time, publish-to-live latency, outcome write cost")
    tbench.add_arguments(tb)
    tb.set_defaults(func=lambda args: tbench.main(args))

    from gateway import bench

    b = sub.add_parser("bench-gateway", help="gateway added latency and echo-engine throughput",
                       description=bench.__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    bench.add_arguments(b)
    b.set_defaults(func=lambda args: bench.main(args))

    from gateway.specbench import cli as specbench

    sb = sub.add_parser("bench", help="end to end on Spec-Bench: every fixed arm, adaptive, the oracle, the "
                                      "learning curve; JSON, Markdown and plots",
                        description=specbench.__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    specbench.add_arguments(sb)
    sb.set_defaults(func=lambda args: specbench.main(args))

    h = sub.add_parser("health", help="exit 0 if a gateway or engine worker answers the gRPC health check "
                                      "as SERVING (for container and orchestrator probes; needs no API key)")
    h.add_argument("--address", default=os.environ.get("SPECGATE_ADDRESS", "127.0.0.1:50051"))
    h.add_argument("--timeout", type=float, default=5.0, help="seconds (default: %(default)s)")
    h.set_defaults(func=cmd_health)

    st = sub.add_parser("status", help="engines, arms, load and versions of a gateway")
    st.add_argument("--address", default=os.environ.get("SPECGATE_ADDRESS", "127.0.0.1:50051"))
    st.add_argument("--api-key", default=os.environ.get("SPECGATE_API_KEY"))
    st.set_defaults(func=cmd_status)


def cmd_serve(args) -> int:
    from engines.builtin import BuiltinEngine
    from gateway.config import RemoteEngineConfig, load_gateway_config
    from gateway.server import build_gateway, create_server, drain, install_sigterm

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
    config = config.model_copy(update=update)
    log.info("config: %s", config.model_dump_json(exclude={"auth"}))
    engine = BuiltinEngine.from_config(config.engine, start_worker=False) if config.embedded_engine else None
    service, deps, closers = build_gateway(config, engine)
    try:
        server, port, health = create_server(config.listen, deps)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server.start()
    httpd = None
    if config.http_listen:
        from gateway.http_api import create_http_server

        try:
            httpd, http_port = create_http_server(config.http_listen, service, deps.keys, deps.metrics_text,
                                                  config.max_prompt_chars)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            server.stop(0)
            return 2
        threading.Thread(target=httpd.serve_forever, name="specgate-http", daemon=True).start()
        print(f"OpenAI-compatible HTTP API on http://{config.http_listen.rsplit(':', 1)[0]}:{http_port}/v1 "
              f"(metrics at /metrics)", flush=True)
    host = config.listen.rsplit(":", 1)[0]
    print(f"specgate gateway listening on {host}:{port} ({'TLS' if config.tls else 'plaintext'}); "
          f"engines: {', '.join(e.id for e in service.router.endpoints)}; rules {service.policy.rules.digest}; "
          f"policy {service.policy.model.version}", flush=True)
    if not deps.keys.enabled:
        print("no API keys configured: listening on loopback only, every caller is the anonymous tenant",
              flush=True)
    stopped = threading.Event()

    def on_term():
        if httpd is not None:
            httpd.shutdown()
        drain(server, health, config.drain_grace_s).wait()
        for close in reversed(closers):  # telemetry flushes what it holds before Redis goes
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down regardless
                log.exception("error while closing")
        if engine is not None:
            engine.close()
        stopped.set()
        log.info("drained; exiting")

    install_sigterm(on_term)
    if engine is not None:
        engine.serve_forever()  # on the main thread: see engines/builtin.py
    stopped.wait()
    return 0


def cmd_engine(args) -> int:
    from pathlib import Path

    import yaml

    from engines.builtin import BuiltinEngine
    from engines.config import EngineConfig
    from gateway.server import create_engine_server, install_sigterm

    config = EngineConfig.model_validate(yaml.safe_load(Path(args.config).read_text()) or {}) if args.config \
        else EngineConfig()
    engine = BuiltinEngine.from_config(config, start_worker=False)
    server, port = create_engine_server(args.listen, engine, args.id or args.listen)
    server.start()
    print(f"specgate engine listening on {args.listen.rsplit(':', 1)[0]}:{port}; drafts {list(engine.arms().drafts)}",
          flush=True)

    def on_term():
        server.stop(10).wait()
        engine.close()

    install_sigterm(on_term)
    engine.serve_forever()
    return 0


def _request(args):
    from gateway.pb import specgate_pb2 as pb

    req = pb.GenerateRequest(stop=args.stop, category=args.category, arm=args.arm)
    if args.raw:
        req.prompt = args.prompt
    else:
        req.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    for field, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                         ("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed),
                         ("expected_output_tokens", args.expected_tokens)):
        if value is not None:
            setattr(req, field, value)
    return req


def _stub(args):
    import grpc

    from gateway.pb import specgate_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(args.address)
    meta = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    return pb_grpc.GatewayStub(channel), meta


def _fail(e) -> int:
    print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def _summary(resp) -> str:
    d, s, t = resp.decision, resp.spec, resp.timings
    return (f"arm {d.arm} ({d.source}{', rule ' + d.rule if d.rule else ''}; policy {d.policy_version}; "
            f"predicted {d.predicted_speedup:.2f}x) — {d.reason}\n"
            f"{resp.usage.output_tokens} tokens, finish {resp.finish_reason}; drafted {s.drafted}, accepted "
            f"{s.accepted} ({s.acceptance_rate:.2f}), mean accepted length {s.mean_accepted_length:.2f}; "
            f"ttft {t.ttft_s * 1e3:.0f} ms, total {t.total_s:.2f} s; engine {resp.engine}; request {resp.request_id}")


def cmd_generate(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    stub, meta = _stub(args)
    try:
        if args.stream:
            final = None
            for ev in stub.GenerateStream(_request(args), metadata=meta, timeout=args.timeout):
                if ev.HasField("final"):
                    final = ev.final
                elif not args.json:
                    print(ev.text, end="", flush=True)
            resp = final
            if not args.json:
                print()
        else:
            resp = stub.Generate(_request(args), metadata=meta, timeout=args.timeout)
            if not args.json:
                print(resp.text)
    except grpc.RpcError as e:
        return _fail(e)
    if args.json:
        print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True)))
    else:
        print("---\n" + _summary(resp), file=sys.stderr)
    return 0


def cmd_decide(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    stub, meta = _stub(args)
    try:
        resp = stub.Decide(_request(args), metadata=meta, timeout=args.timeout)
    except grpc.RpcError as e:
        return _fail(e)
    if args.json:
        print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True)))
    else:
        d, f = resp.decision, resp.features
        print(f"{d.arm} ({d.source}) — {d.reason}")
        print(f"features: category {f.category}, T={f.temperature:g}, ~{f.prompt_tokens} prompt tokens, "
              f"~{f.expected_output_tokens} output tokens, load {f.running + f.waiting}")
        for arm, s in sorted(d.predicted_speedups.items(), key=lambda kv: -kv[1])[:6]:
            print(f"  {arm:<14} {s:.2f}x")
    return 0


def cmd_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_status(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from gateway.pb import specgate_pb2 as pb

    stub, meta = _stub(args)
    try:
        resp = stub.GetStatus(pb.GetStatusRequest(), metadata=meta, timeout=10)
    except grpc.RpcError as e:
        return _fail(e)
    print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True), indent=1))
    return 0


def _artifact_key() -> bytes:
    key = os.environ.get("SPECGATE_ARTIFACT_KEY", "").encode()
    if not key:
        raise SystemExit("error: set SPECGATE_ARTIFACT_KEY (the HMAC key gateways verify policy models with)")
    return key


def cmd_retrain(args) -> int:
    import redis

    from policy.cli import parse_arms
    from telemetry.retrainer import Retrainer

    client = redis.Redis.from_url(args.redis)
    r = Retrainer(client, _artifact_key(), window=args.window, every=args.every, min_rows=args.min_rows,
                  arms=parse_arms(args.arms))
    log.info("retrainer on %s: every %d outcomes, window %d", args.redis, args.every, args.window)
    r.run(once=args.once, interval_s=args.interval)
    if args.once:
        print(f"{len(r.rows)} outcomes; promoted: {r.promoted or 'none'}")
    return 0


def cmd_rollback(args) -> int:
    import redis

    from telemetry.artifacts import ArtifactError, rollback

    try:
        version = rollback(redis.Redis.from_url(args.redis), args.version)
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"live policy model: {version}")
    return 0
