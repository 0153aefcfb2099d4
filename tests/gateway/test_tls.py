"""TLS and mutual TLS by config, with certificates made by openssl for the test."""

import shutil
import subprocess

import grpc
import pytest

from gateway.config import TLSConfig
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from tests.helpers import start_gateway

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def sh(*args, cwd):
    subprocess.run(args, cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
       "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
           "-subj", f"/CN={name}", cwd=d)
        sh("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
           "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=d)
    return d


def serve(tls: TLSConfig):
    return start_gateway(tls=tls)


def call(port, creds):
    with grpc.secure_channel(f"localhost:{port}", creds) as ch:
        return pb_grpc.GatewayStub(ch).Decide(pb.GenerateRequest(prompt="hello"), timeout=10)


def test_tls(pki):
    g = serve(TLSConfig(cert=str(pki / "server.pem"), key=str(pki / "server.key")))
    port = g.port
    try:
        ok = call(port, grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes()))
        assert ok.decision.arm
        with grpc.insecure_channel(f"localhost:{port}") as ch, pytest.raises(grpc.RpcError):
            pb_grpc.GatewayStub(ch).Decide(pb.GenerateRequest(prompt="hello"), timeout=3)
    finally:
        g.close()


def test_mutual_tls_requires_a_client_certificate(pki):
    g = serve(TLSConfig(cert=str(pki / "server.pem"), key=str(pki / "server.key"), client_ca=str(pki / "ca.pem")))
    port = g.port
    try:
        ca = (pki / "ca.pem").read_bytes()
        with pytest.raises(grpc.RpcError):
            call(port, grpc.ssl_channel_credentials(ca))  # no client certificate
        ok = call(port, grpc.ssl_channel_credentials(ca, (pki / "client.key").read_bytes(),
                                                     (pki / "client.pem").read_bytes()))
        assert ok.decision.arm
    finally:
        g.close()
