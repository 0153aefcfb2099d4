"""gateway: the front ends, routing and the composition root (imports engines, policy, telemetry).

    app.py            the composition root: builds everything from config; the servers' event loop
    config.py         GatewayConfig and its sections
    validation.py     client input -> a validated GatewayRequest
    service.py        admit, decide, route, generate, record (no protobuf, no HTTP)
    policy_state.py   the live model, rules and classifier; the rules-file watcher
    router.py         which endpoint serves a request; health checks
    endpoints/        the built-in engine, engine workers, OpenAI-compatible servers behind one protocol
    grpc_server.py    the gRPC servers (asyncio): limits, TLS, drain
    servicer.py       one method per RPC: protobuf <-> domain, errors -> status codes
    pbconv.py         protobuf <-> domain conversions
    interceptors.py   request ids, API keys, undecodable messages, worker tokens
    auth.py           tenant API keys and worker tokens
    context.py        the call being served (request id, tenant, trace), for logs and spans
    http_api.py       the OpenAI-compatible HTTP API (FastAPI on uvicorn)
    http_guard.py     what HTTP checks before reading a body: key, route, type, size
    cli.py            the `specgate` command table; cmd_*.py one command each; client.py their shared options
    logs.py           log format; protogen.py regenerates pb/ from proto/
"""
