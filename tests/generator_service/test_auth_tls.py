"""A second real server off loopback (0.0.0.0): shared-secret auth, TLS, and SIGTERM shutdown."""

from __future__ import annotations

import datetime
import ipaddress
import threading
import time

import grpc
import numpy as np
import pytest

from jaxrlhf.fleet.rpc import GeneratorClient
from tests.generator_service.wire import chunk_messages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "s3cret-token-for-tests"


def self_signed_certificate(directory) -> tuple:
    """A throwaway CA-less certificate for localhost/127.0.0.1 (key and cert PEM paths)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "server.key", directory / "server.crt"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def secure_server(tiny_llama, tmp_path_factory, start_generator_server):
    directory = tmp_path_factory.mktemp("secure_server")
    key_path, cert_path = self_signed_certificate(directory)
    # A grace far longer than the last test's calls take (its 2 x 200 tokens ran past the
    # default 10 s once on a loaded machine, and were cancelled as the grace demands).
    args = ["--host", "0.0.0.0", "--tls-cert", str(cert_path), "--tls-key", str(key_path),
            "--shutdown-grace", "120"]  # fmt: skip
    server = start_generator_server(
        tiny_llama, directory / "server.log", args, env={"JAXRLHF_GENERATOR_AUTH_TOKEN": TOKEN}
    )
    server.root_certificates = cert_path.read_bytes()
    server.target = "localhost:" + server.address.rsplit(":", 1)[1]
    yield server
    if server.process.poll() is None:
        server.terminate()


def secure_client(server, token: str | None) -> GeneratorClient:
    return GeneratorClient(
        server.target, auth_token=token, root_certificates=server.root_certificates
    )


def test_health_is_open_without_a_token(secure_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with secure_client(secure_server, None) as client:
        response = health_pb2_grpc.HealthStub(client.channel).Check(
            health_pb2.HealthCheckRequest(service="")
        )
    assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_every_call_without_the_right_token_is_unauthenticated(secure_server, token):
    with secure_client(secure_server, token) as client:
        calls = {
            "GetStatus": lambda: client.status(),
            "Generate": lambda: list(client.generate([[1, 2, 3]], max_tokens=2)),
            "UpdateWeights": lambda: client.stub.UpdateWeights(
                chunk_messages({"x": np.ones(1, np.float32)}, 99), metadata=client.metadata
            ),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            expected = "missing" if token is None else "wrong auth token"
            assert expected in caught.value.details(), name


def test_the_right_token_over_tls_generates(secure_server):
    with secure_client(secure_server, TOKEN) as client:
        status = client.status()
        completions = list(client.generate([[5, 6, 7, 8]], max_tokens=4, n=2))
    assert status.serving and status.policy_version == 0
    assert len(completions) == 2 and {c.policy_version for c in completions} == {0}
    assert all(len(c.token_ids) == len(c.logprobs) >= 1 for c in completions)


def test_a_plaintext_client_gets_nothing_from_the_tls_port(secure_server):
    with GeneratorClient(secure_server.target, auth_token=TOKEN) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.status(timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_lets_in_flight_calls_finish_then_exits_cleanly(secure_server):
    """Runs last in this module: it stops the server."""
    results: dict[str, object] = {}
    client = secure_client(secure_server, TOKEN)

    def long_call() -> None:
        try:
            results["completions"] = list(
                client.generate([[5, 6, 7]] * 2, max_tokens=200, ignore_eos=True)
            )
        except grpc.RpcError as error:
            results["error"] = error

    thread = threading.Thread(target=long_call)
    thread.start()
    deadline = time.monotonic() + 30
    while client.status().num_requests_running < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    returncode = secure_server.terminate(timeout=150)
    thread.join(timeout=30)
    client.close()
    assert returncode == 0, secure_server.log_tail()
    assert "error" not in results, results.get("error")
    assert [len(c.token_ids) for c in results["completions"]] == [200, 200]
    assert "shutting down" in secure_server.log_path.read_text()
