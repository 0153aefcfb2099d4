"""The OpenAI-compatible server adapter behind a real gateway, against scripted
HTTP servers speaking vLLM's response and metrics formats (no vLLM installs on
these machines; test_llamacpp.py runs a real llama.cpp server).
What is under test is the adapter: arms, routing, acceptance, load, errors."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from engines.arms import Arm, ArmMenu, DraftKind, parse_arm_specs
from gateway.config import OpenAIServerConfig
from gateway.endpoints.openai import OpenAIServerEndpoint
from gateway.endpoints.openai_wire import read_acceptance, rounds_from_rate
from gateway.endpoints.prometheus import parse_sums
from gateway.pb import specgate_pb2 as pb
from tests.helpers import start_gateway


class Script:
    """What one fake server does: the words it streams, what it reports, its
    /metrics page, and an HTTP status to fail with."""

    def __init__(self, words=("Hello", " there", "!"), spec=None, running=0, waiting=0, counters=None):
        self.words, self.spec, self.running, self.waiting = list(words), spec, running, waiting
        self.counters = counters  # [drafted, accepted] totals, advanced by `advance` per request
        self.advance = None
        self.fail_status: int | None = None
        self.bodies: list[dict] = []
        self.delay = 0.0  # seconds before each streamed word


def serve(script: Script):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, status, body: bytes, ctype="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": "fake-model"}]}).encode())
            elif self.path == "/metrics":
                lines = ["# HELP vllm:num_requests_running running", "# TYPE vllm:num_requests_running gauge",
                         f'vllm:num_requests_running{{model_name="fake"}} {script.running}',
                         f'vllm:num_requests_waiting{{model_name="fake"}} {script.waiting}']
                if script.counters:
                    lines += [f'vllm:spec_decode_num_draft_tokens_total{{model_name="fake"}} {script.counters[0]}',
                              f'vllm:spec_decode_num_accepted_tokens_total{{model_name="fake"}} {script.counters[1]}']
                self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain")
            else:
                self._send(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            script.bodies.append(body)
            if script.fail_status:
                self._send(script.fail_status, json.dumps({"error": {"message": "scripted failure"}}).encode())
                return
            if script.advance and script.counters:
                script.counters = [script.counters[0] + script.advance[0], script.counters[1] + script.advance[1]]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chat = self.path.endswith("/chat/completions")
            for w in script.words:
                time.sleep(script.delay)
                choice = {"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": len(script.words)}}
            if script.spec:
                last["metrics"] = {"speculative_decoding": script.spec}
            self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@contextmanager
def gateway_over(endpoints, *http_servers, health_check_s=0.2):
    """A real gateway over these endpoints; on exit it and the scripted servers stop.
    Yields the stub, the service and a function running a coroutine on the gateway's loop."""
    g = start_gateway(endpoints=endpoints, health_check_s=health_check_s)
    try:
        yield g.stub, g.service, g.serving.io.run
    finally:
        g.close()
        for h in http_servers:
            h.shutdown()


def endpoint(httpd, arms, id, **kw) -> OpenAIServerEndpoint:
    return OpenAIServerEndpoint(OpenAIServerConfig(url=f"http://127.0.0.1:{httpd.server_port}", id=id, kind="vllm",
                                                   arms=arms, **kw))


@pytest.fixture
def fleet():
    """A vLLM without speculation, one with n-gram K=4 that reports acceptance per
    request, one with a draft model K=5 that exposes only counters."""
    scripts = {"plain": Script(), "ngram4": Script(spec={"num_draft_tokens": 8, "num_accepted_draft_tokens": 6}),
               "draft5": Script(counters=[100, 50])}
    servers = {k: serve(s) for k, s in scripts.items()}
    eps = [endpoint(servers["plain"], ["plain"], "vllm-plain"), endpoint(servers["ngram4"], ["ngram:4"], "vllm-ngram"),
           endpoint(servers["draft5"], ["draft:5"], "vllm-draft", draft_kinds={"draft": "eagle"})]
    with gateway_over(eps, *servers.values()) as (stub, service, on_loop):
        yield scripts, servers, eps, stub, service, on_loop


def ask(stub, arm="", **kw):
    return stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=8,
                                            arm=arm, **kw), timeout=10)


def test_each_arm_goes_to_the_server_configured_for_it(fleet):
    scripts, _, _, stub, _, _ = fleet
    for arm, engine in (("plain", "vllm-plain"), ("ngram:4", "vllm-ngram"), ("draft:5", "vllm-draft")):
        r = ask(stub, arm)
        assert (r.engine, r.decision.arm, r.text) == (engine, arm, "Hello there!")
    assert scripts["plain"].bodies[-1]["model"] == "fake-model"  # taken from /v1/models
    assert scripts["plain"].bodies[-1]["messages"] == [{"role": "user", "content": "hi"}]


def test_an_arm_no_server_serves_is_refused_with_the_menu(fleet):
    stub = fleet[3]
    with pytest.raises(grpc.RpcError) as e:
        ask(stub, "ngram:3")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ngram:4" in e.value.details() and "draft:5" in e.value.details()


def test_the_policy_chooses_only_among_served_arms(fleet):
    service = fleet[4]
    menu = service.router.arms()
    assert set(a.name for a in menu.all_arms()) == {"plain", "ngram:4", "draft:5"}
    assert not menu.allows(Arm("ngram", 2))
    # what each draft is: as configured, else as its name suggests
    assert (menu.kind_of("draft"), menu.kind_of("ngram")) == (DraftKind("eagle"), DraftKind("ngram"))


def test_reported_acceptance_is_used_and_marked(fleet):
    r = ask(fleet[3], "ngram:4")
    assert (r.spec.drafted, r.spec.accepted, r.spec.acceptance_source) == (8, 6, "reported")
    assert r.spec.rounds == 2  # 8 drafts at K=4


def test_counter_deltas_give_an_estimate_marked_as_such(fleet):
    scripts, _, eps, stub, _, on_loop = fleet
    scripts["draft5"].advance = (10, 5)  # this request moved the counters by 10 drafted, 5 accepted
    on_loop(eps[2].check())
    r = ask(stub, "draft:5")
    assert r.spec.acceptance_source == "estimated"
    assert r.spec.acceptance_rate == pytest.approx(0.5, abs=0.1)
    assert r.spec.rounds == rounds_from_rate(3, 5, 0.5)


def test_no_figures_means_unknown_not_invented(fleet):
    scripts, _, eps, stub, _, _ = fleet
    scripts["draft5"].counters = None  # a server without speculation counters
    eps[2].forget_counters()
    r = ask(stub, "draft:5")
    assert (r.spec.acceptance_source, r.spec.drafted, r.spec.rounds) == ("unknown", 0, 0)


def test_load_comes_from_the_servers_gauges(fleet):
    scripts, _, eps, stub, _, on_loop = fleet
    scripts["plain"].running, scripts["plain"].waiting = 5, 3
    on_loop(eps[0].check())
    status = {e.id: e for e in stub.GetStatus(pb.GetStatusRequest()).engines}
    assert (status["vllm-plain"].load.running, status["vllm-plain"].load.waiting) == (5, 3)
    assert list(status["vllm-ngram"].arms) == ["ngram:4"]
    assert [(k.draft, k.kind) for k in status["vllm-draft"].draft_kinds] == [("draft", "eagle")]


def test_server_errors_map_to_statuses(fleet):
    scripts, _, _, stub, _, _ = fleet
    for status, code in ((400, grpc.StatusCode.INVALID_ARGUMENT), (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
                         (500, grpc.StatusCode.UNAVAILABLE)):
        scripts["plain"].fail_status = status
        with pytest.raises(grpc.RpcError) as e:
            ask(stub, "plain")
        assert e.value.code() == code, status
        assert "scripted failure" in e.value.details()
        assert "Traceback" not in e.value.details()
    scripts["plain"].fail_status = None


def test_a_dead_server_is_retried_elsewhere_then_leaves_rotation():
    live_srv, dying = serve(Script(words=("ok",))), serve(Script())
    eps = [endpoint(live_srv, ["plain"], "live"), endpoint(dying, ["plain"], "dead")]
    with gateway_over(eps, live_srv, health_check_s=60) as (stub, service, _):
        assert eps[1].healthy  # it passed its check at start
        dying.shutdown()
        dying.server_close()  # nothing listens there now; no check has noticed yet
        service.router.track("live", 100)  # make the dead one look least loaded
        r = ask(stub, "plain")
        assert (r.engine, r.text) == ("live", "ok")  # connection refused: retried on the live server
        assert not eps[1].healthy


def test_streaming_and_completions_path():
    script = Script(words=("a", "b", "c"))
    httpd = serve(script)
    with gateway_over([endpoint(httpd, ["plain"], "p")], httpd) as (stub, service, _):
        events = list(stub.GenerateStream(pb.GenerateRequest(prompt="raw text", max_tokens=3, temperature=0.5,
                                                             seed=9, stop=["zz"]), timeout=10))
        assert [e.text for e in events if e.WhichOneof("event") == "text"] == ["a", "b", "c"]
        assert events[-1].final.text == "abc"
        body = script.bodies[-1]
        assert (body["prompt"], body["seed"], body["stop"], body["temperature"]) == ("raw text", 9, ["zz"], 0.5)


def test_gamma_field_lets_one_server_serve_a_range():
    script = Script()
    httpd = serve(script)
    ep = endpoint(httpd, ["plain", "ngram:2-6"], "llama", gamma_field="speculative.n_max")
    with gateway_over([ep], httpd) as (stub, service, _):
        ask(stub, "ngram:5")
        assert script.bodies[-1]["speculative.n_max"] == 5
        ask(stub, "plain")
        assert "speculative.n_max" not in script.bodies[-1]


def test_arm_specs_and_config_errors():
    assert parse_arm_specs(["plain", "ngram:2-4"]) == {Arm(), Arm("ngram", 2), Arm("ngram", 3), Arm("ngram", 4)}
    for bad, msg in ((["ngram:2-4"], "needs gamma_field"), (["ngram:x"], "DRAFT:GAMMA"), (["ngram:5-2"], "LO <= HI")):
        with pytest.raises(ValueError, match=msg):
            OpenAIServerConfig(url="http://h:1", arms=bad)
    with pytest.raises(ValueError):
        OpenAIServerConfig(url="h:1")
    with pytest.raises(ValueError, match=r"no arm serves: \['spec'\]"):
        OpenAIServerConfig(url="http://h:1", arms=["ngram:4"], draft_kinds={"spec": "eagle"})
    with pytest.raises(ValueError, match="draft_kinds.spec"):
        OpenAIServerConfig(url="http://h:1", arms=["spec:4"], draft_kinds={"spec": "wizard"})
    assert DraftKind.parse("spec=eagle", ["spec"]) == ("spec", DraftKind("eagle"))
    menu = ArmMenu.of([Arm("ngram", 4)])
    assert not menu.allows(Arm()) and menu.all_arms() == [Arm("ngram", 4)]


def test_acceptance_fields_of_each_server_kind():
    assert read_acceptance({"metrics": {"speculative_decoding": {"num_draft_tokens": 10,
                                                                 "num_accepted_draft_tokens": 7}}}) == (10, 7)
    assert read_acceptance({"timings": {"draft_n": 12, "draft_n_accepted": 3}}) == (12, 3)
    assert read_acceptance({"meta_info": {"spec_draft_token_num": 20, "spec_accept_rate": 0.25}}) == (20, 5)
    assert read_acceptance({"choices": []}) is None


def test_prometheus_sums_over_labels_and_skips_junk():
    text = ('# HELP x\nvllm:num_requests_running{model_name="a"} 2\nvllm:num_requests_running{model_name="b"} 3\n'
            'vllm:num_requests_waiting 1 1700000000\nbroken line\nother 5\nvllm:num_requests_waiting NaN\n')
    assert parse_sums(text, {"vllm:num_requests_running", "vllm:num_requests_waiting", "absent"}) == {
        "vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 1.0}


def test_with_no_plain_server_plain_decisions_fall_back_to_a_served_arm():
    httpd = serve(Script(spec={"num_draft_tokens": 4, "num_accepted_draft_tokens": 1}))
    ep = endpoint(httpd, ["ngram:4"], "only-spec")
    # a hot request: the prior picks plain, which nobody serves here
    with gateway_over([ep], httpd) as (stub, service, _):
        r = ask(stub, "", temperature=1.5)
        assert (r.engine, r.decision.arm, r.decision.source) == ("only-spec", "ngram:4", "fallback")
        assert "plain is served by no healthy engine" in r.decision.reason


def test_a_server_that_ignores_stream_true_still_works():
    class Whole(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"},
                                            "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 3, "completion_tokens": 1}}, indent=1).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Whole)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    ep = OpenAIServerEndpoint(OpenAIServerConfig(url=f"http://127.0.0.1:{httpd.server_port}", model="m"))
    with gateway_over([ep], httpd) as (stub, service, _):
        r = ask(stub, "plain")
        assert (r.text, r.usage.output_tokens, r.finish_reason) == ("whole", 1, "stop")


def test_result_honours_its_timeout_and_frees_the_slot():
    from engines.api import GenerationRequest, SamplingParams

    script = Script(words=["w"] * 40)
    script.delay = 0.05  # two seconds in all
    httpd = serve(script)
    ep = endpoint(httpd, ["plain"], "slow")

    async def go():
        await ep.check()
        call = await ep.submit(GenerationRequest(request_id="t", prompt="x", sampling=SamplingParams(max_tokens=40)))
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            await call.result(timeout=0.3)
        waited = time.perf_counter() - t0
        await ep.close()
        return waited

    try:
        assert asyncio.run(go()) < 1.5
        assert ep.load().running == 0  # the in-flight count came back down
    finally:
        httpd.shutdown()
