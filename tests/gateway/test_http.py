"""The OpenAI-compatible endpoint through the official openai client and raw HTTP."""

import http.client
import json

import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider

from gateway.config import AuthConfig
from telemetry.otel import Instrumentation, prometheus_reader
from tests.helpers import key, start_gateway


@pytest.fixture(scope="module")
def http_gw():
    reader, render = prometheus_reader()
    instr = Instrumentation(meter_provider=MeterProvider(metric_readers=[reader]))
    keys = AuthConfig(keys=[key("acme", "sk-good"), key("reader", "sk-read", methods=["Decide"]),
                            key("unary", "sk-unary", methods=["Generate"])])
    g = start_gateway(keys=keys, http=True, instrumentation=instr, metrics_text=render)
    yield g.http_port
    g.close()


def client(port, api_key="sk-good"):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=30)


def test_completion(http_gw):
    r = client(http_gw).completions.create(model="specgate", prompt="hello world the cat", max_tokens=6,
                                           extra_body={"specgate": {"arm": "ngram:3"}})
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    extra = r.model_extra["specgate"]
    assert extra["decision"]["arm"] == "ngram:3" and extra["decision"]["source"] == "request"
    assert r.usage.model_extra["num_draft_tokens"] == extra["spec"]["drafted"]
    assert "num_accepted_draft_tokens" in r.usage.model_extra


def test_chat_completion(http_gw):
    r = client(http_gw).chat.completions.create(model="specgate", max_tokens=5,
                                                messages=[{"role": "user", "content": "hello world"}])
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content is not None
    assert r.object == "chat.completion"


def test_streaming_chat_equals_non_streaming_and_carries_decision_headers(http_gw):
    c = client(http_gw)
    msgs = [{"role": "user", "content": "hello world the cat"}]
    full = c.chat.completions.create(model="specgate", max_tokens=10, messages=msgs).choices[0].message.content
    raw = c.chat.completions.with_raw_response.create(model="specgate", max_tokens=10, messages=msgs, stream=True)
    assert raw.headers["x-specgate-arm"] and raw.headers["x-specgate-source"] and raw.headers["x-request-id"]
    chunks = list(raw.parse())
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].model_extra["specgate"]["decision"]["arm"] == raw.headers["x-specgate-arm"]


def test_streaming_completion(http_gw):
    chunks = list(client(http_gw).completions.create(model="specgate", prompt="hello world", max_tokens=8,
                                                     stream=True))
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason


def test_auth_failures(http_gw):
    with pytest.raises(openai.AuthenticationError):
        client(http_gw, "sk-wrong").completions.create(model="specgate", prompt="hi", max_tokens=2)
    with pytest.raises(openai.PermissionDeniedError):
        client(http_gw, "sk-read").completions.create(model="specgate", prompt="hi", max_tokens=2)


@pytest.mark.parametrize("kwargs,param", [
    (dict(prompt="hi", max_tokens=2, temperature=-1), "temperature"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=2, n=2), "n"),
    (dict(prompt="hi", max_tokens=2, top_p=0), "top_p"),
    (dict(prompt="", max_tokens=2), "prompt"),
])
def test_bad_fields(http_gw, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(http_gw).completions.create(model="specgate", **kwargs)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def raw(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def test_error_shape_over_raw_http(http_gw):
    auth = {"Authorization": "Bearer sk-good", "Content-Type": "application/json"}
    for body, status in [(b"{not json", 400), (json.dumps({"prompt": 3}).encode(), 400),
                         (json.dumps({"prompt": "x", "stop": [1]}).encode(), 400)]:
        code, headers, data = raw(http_gw, "POST", "/v1/completions", body, auth)
        err = json.loads(data)["error"]
        assert code == status and set(err) == {"message", "type", "param", "code"} and err["message"]
        assert headers["content-type"] == "application/json"
    code, _, data = raw(http_gw, "POST", "/v1/completions", b"{}", {"Content-Type": "application/json"})
    assert code == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    code, _, data = raw(http_gw, "GET", "/v2/nothing")
    assert code == 404 and json.loads(data)["error"]["code"] == "not_found"


def test_models_and_metrics(http_gw):
    models = client(http_gw).models.list()
    assert [m.id for m in models.data] == ["specgate"]
    client(http_gw).completions.create(model="specgate", prompt="hello", max_tokens=2)
    code, headers, data = raw(http_gw, "GET", "/metrics", headers={"Authorization": "Bearer sk-read"})
    assert code == 200 and headers["content-type"].startswith("text/plain")
    assert b"specgate_requests" in data and b"specgate_decision_duration" in data
