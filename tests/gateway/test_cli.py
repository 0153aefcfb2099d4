"""`specgate serve` as a user runs it: a process, a client command, SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time

import yaml

from tests.helpers import CLI, REPO, free_port, wait_listening


def test_serve_generate_decide_status_then_drain_on_sigterm(engine_config, tmp_path):
    port = free_port()
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"listen": f"127.0.0.1:{port}", "drain_grace_s": 5,
                                   "engine": yaml.safe_load(engine_config.read_text())}))
    server = subprocess.Popen(CLI + ["serve", "--config", str(cfg)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_listening(server)
        addr = ["--address", f"127.0.0.1:{port}"]
        out = subprocess.run(CLI + ["generate", "hello world", "--raw", "--max-tokens", "5", "--json"] + addr,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        resp = json.loads(out.stdout)
        assert resp["usage"]["output_tokens"] == 5 and resp["decision"]["arm"]
        out = subprocess.run(CLI + ["decide", "Summarize: a b c", "--category", "summarization"] + addr,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "features: category summarization" in out.stdout
        out = subprocess.run(CLI + ["generate", "hi", "--temperature", "-1"] + addr, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 1 and "INVALID_ARGUMENT: temperature" in out.stderr
        assert "Traceback" not in out.stderr
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        log = server.stdout.read()
        assert "draining" in log and "drained" in log
    finally:
        if server.poll() is None:
            server.kill()


def test_rules_check_exit_codes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: {}\nrules:\n  - name: x\n    then: {forse: plain}\n")
    out = subprocess.run(CLI + ["rules", "check", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "rule #1 'x': field then.forse: unknown key" in out.stderr
    out = subprocess.run(CLI + ["rules", "check", str(REPO / "policy" / "default_rules.yaml")], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "OK" in out.stdout


def test_retrain_refuses_an_engine_config_it_cannot_read(tmp_path):
    """Before touching Redis: the menu it judges candidates on comes from the engines' config."""
    bad = tmp_path / "engine.yaml"
    env = {**os.environ, "SPECGATE_ARTIFACT_KEY": "k" * 32}
    for text, msg in (("drafts: [{kind: ngram, name: plain}]", "not 'plain'"), ("drafts: [", "not YAML")):
        bad.write_text(text)
        out = subprocess.run(CLI + ["retrain", "--redis", "redis://127.0.0.1:1/0", "--once", "--engine-config",
                                    str(bad)], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 2 and "error: --engine-config" in out.stderr and msg in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    # servers configured per arm: what a draft is where its name does not say
    for extra, msg in ((["--arms", "plain,spec:5", "--draft-kind", "spec=wizard"], "KIND one of ngram, eagle"),
                       (["--arms", "plain,spec:5", "--draft-kind", "other=eagle"], "NAME one of ['spec']"),
                       (["--draft-kind", "spec=eagle"], "goes with --arms")):
        out = subprocess.run(CLI + ["retrain", "--redis", "redis://127.0.0.1:1/0", "--once"] + extra,
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 2 and msg in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_health_probe_imports_no_ml_stack():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "gateway.cli",
                          "health", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "--address" in out.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "transformers", "sklearn", "scipy", "numpy"}, sorted(imported)


def test_every_command_has_help(capsys):
    import pytest

    from gateway.cli import COMMANDS, build_parser

    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            build_parser([name, "--help"]).parse_args([name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and f"usage: specgate {name}" in out and len(out) > 200, name


def redis_servers() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "redis-server"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def test_a_refused_start_leaves_no_redis_server_behind(tmp_path):
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"embedded_engine": False, "remote_engines": [{"address": "127.0.0.1:1"}],
                                   "health_check_s": 0.2}))
    before = redis_servers()
    for listen in ("0.0.0.0:0", "999.1.1.1:5", "127.0.0.1:notaport"):  # no keys beyond loopback; bad addresses
        out = subprocess.run(CLI + ["serve", "--config", str(cfg), "--listen", listen], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and "error:" in out.stderr and "Traceback" not in out.stderr, out.stderr[-800:]
    time.sleep(0.5)
    assert redis_servers() <= before


def test_the_config_logged_at_start_carries_no_secrets():
    from gateway.cmd_serve import redacted
    from gateway.config import GatewayConfig

    text = redacted(GatewayConfig.model_validate({"telemetry": {"redis_url": "redis://:s3cr3t@10.0.0.1:6379/0"},
                                                  "auth": {"keys": [{"tenant": "a", "key_sha256": "0" * 64}]}}))
    assert "s3cr3t" not in text and "redis://:***@10.0.0.1" in text and "0" * 64 not in text
