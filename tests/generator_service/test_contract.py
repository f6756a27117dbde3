"""The wire contract (jaxrlhf_wire): the loopback rule, the dtype table, the install-time stubs,
and that the service and the learner share it without the service importing the learner."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxrlhf_wire.build import (
    GENERATED_DIR,
    PROTO_PATH,
    STAMP,
    build_stubs,
    check_stubs,
    stubs_problem,
)
from jaxrlhf_wire.dtypes import (
    SAFETENSORS_TO_WIRE,
    WEIGHT_DTYPES,
    WIRE_DTYPES,
    tensor_nbytes,
    wire_dtype_name,
)
from jaxrlhf_wire.hosts import is_local_peer, is_local_target, is_loopback_host

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_loopback_rule_on_hosts():
    for host in [
        "127.0.0.1",
        "127.5.6.7",
        "::1",
        "[::1]",
        "localhost",
        "LocalHost",
        "::ffff:127.0.0.1",
    ]:
        assert is_loopback_host(host), host
    for host in ["10.0.0.1", "0.0.0.0", "::", "2001:db8::1", "example.com", "", "::ffff:10.0.0.1"]:
        assert not is_loopback_host(host), host


def test_the_loopback_rule_on_grpc_peers():
    """As a server sees its clients; gRPC writes IPv6 peers percent-encoded ("%5B::1%5D")."""
    for peer in [
        "ipv4:127.0.0.1:5000",
        "ipv6:[::1]:5000",
        "ipv6:%5B::1%5D:5000",
        "ipv6:[::ffff:127.0.0.1]:5000",
        "unix:/tmp/g.sock",
        "unix-abstract:g",
    ]:
        assert is_local_peer(peer), peer
    for peer in [
        "ipv4:10.1.2.3:5000",
        "ipv6:[2001:db8::1]:5000",
        "ipv6:%5B2001:db8::1%5D:5",
        "garbage",
        "",
        "localhost:5000",
    ]:
        assert not is_local_peer(peer), peer


def test_the_loopback_rule_on_grpc_targets():
    """As the learner dials its replicas."""
    for target in [
        "127.0.0.1:50051",
        "localhost:50051",
        "localhost",
        "[::1]:5",
        "::1",
        "dns:///localhost:5",
        "ipv4:127.0.0.1:5",
        "ipv4:127.0.0.1:5,127.0.0.2:6",
        "ipv6:[::1]:5",
        "unix:/x",
        "unix-abstract:x",
    ]:
        assert is_local_target(target), target
    for target in [
        "10.255.0.1:50051",
        "example.com:5",
        "[2001:db8::1]:5",
        "dns:///example.com:5",
        "ipv4:127.0.0.1:5,10.0.0.1:5",
        "",
    ]:
        assert not is_local_target(target), target


def test_a_real_ipv6_loopback_peer_is_local():
    """The peer string gRPC itself reports for a client on [::1]."""
    code = """
import asyncio, grpc
from jaxrlhf_wire.hosts import is_local_peer

async def main():
    peers = []

    async def handler(request, context):
        peers.append(context.peer())
        return b""

    server = grpc.aio.server()
    handlers = {"M": grpc.unary_unary_rpc_method_handler(handler)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))
    port = server.add_insecure_port("[::1]:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"[::1]:{port}") as channel:
        await channel.unary_unary("/t.S/M")(b"", timeout=10)
    await server.stop(0)
    print(peers[0], is_local_peer(peers[0]))

asyncio.run(main())
"""
    try:
        peer, local = _run(code).split()
    except AssertionError as error:
        if "Cannot assign requested address" in str(error) or "Failed to bind" in str(error):
            pytest.skip("no IPv6 loopback here")
        raise
    assert peer.startswith("ipv6:") and local == "True", peer


def test_the_dtype_table():
    assert WEIGHT_DTYPES == ("float32", "bfloat16", "float16")
    assert {name: (d.itemsize, d.safetensors) for name, d in WIRE_DTYPES.items()} == {
        "float32": (4, "F32"),
        "bfloat16": (2, "BF16"),
        "float16": (2, "F16"),
    }
    assert SAFETENSORS_TO_WIRE == {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    for name, dtype in WIRE_DTYPES.items():
        assert np.dtype(dtype.view).itemsize == dtype.itemsize, name
    # A wire name is numpy's name of the dtype: the learner sends its arrays' dtypes as they are.
    assert wire_dtype_name(np.float32) == "float32"
    assert wire_dtype_name(ml_dtypes.bfloat16) == "bfloat16"
    assert wire_dtype_name(np.dtype("float16")) == "float16"
    assert wire_dtype_name(np.float64) is None and wire_dtype_name(np.int32) is None
    assert tensor_nbytes("bfloat16", (3, 4)) == 24 and tensor_nbytes("float32", (0, 4)) == 0


def test_missing_stubs_name_the_command_that_builds_them(tmp_path):
    assert stubs_problem() == ""  # the installed ones are current
    with pytest.raises(ImportError, match="are missing from") as caught:
        check_stubs(tmp_path / "_generated", PROTO_PATH)
    assert "make install" in str(caught.value)
    assert "python -m jaxrlhf_wire.build" in str(caught.value)


def test_stubs_of_another_proto_are_refused_until_rebuilt(tmp_path):
    generated = tmp_path / "_generated"
    shutil.copytree(GENERATED_DIR, generated, ignore=shutil.ignore_patterns("__pycache__"))
    check_stubs(generated, PROTO_PATH)
    proto = tmp_path / "generator.proto"
    proto.write_text(PROTO_PATH.read_text() + "\n// changed\n")
    with pytest.raises(ImportError, match="built from another version") as caught:
        check_stubs(generated, proto)
    assert "make install" in str(caught.value)
    (generated / STAMP).unlink()  # a set never completed counts as stale too
    with pytest.raises(ImportError, match="built from another version"):
        check_stubs(generated, PROTO_PATH)
    build_stubs(generated, proto)
    check_stubs(generated, proto)
    assert "from . import generator_pb2 as" in (generated / "generator_pb2_grpc.py").read_text()


def test_importing_stale_stubs_raises_instead_of_regenerating(tmp_path):
    """The import checks the real folder: with a changed .proto it fails and writes nothing."""
    before = (GENERATED_DIR / STAMP).read_text()
    code = f"""
from pathlib import Path
import jaxrlhf_wire.build as build
build.PROTO_PATH = Path({str(tmp_path / "generator.proto")!r})
build.PROTO_PATH.write_text(Path({str(PROTO_PATH)!r}).read_text() + "// changed")
try:
    import jaxrlhf_wire.stubs
except ImportError as error:
    print(error)
"""
    message = _run(code)
    assert "built from another version" in message and "make install" in message
    assert (GENERATED_DIR / STAMP).read_text() == before


def test_wire_imports_neither_jax_nor_vllm_nor_torch():
    code = (
        "import sys, jaxrlhf_wire, jaxrlhf_wire.stubs, jaxrlhf_wire.chunks, jaxrlhf_wire.dtypes,"
        " jaxrlhf_wire.files, jaxrlhf_wire.hosts;"
        "print(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('vllm', 'jax', 'torch', 'jaxrlhf', 'generator_service')))"
    )
    assert _run(code) == "[]"


def test_the_service_does_not_import_the_learner():
    code = (
        "import sys, generator_service.server, generator_service.__main__;"
        "print(sorted(m for m in sys.modules if m == 'jaxrlhf' or m.startswith('jaxrlhf.')))"
    )
    assert _run(code) == "[]"


def test_both_sides_share_one_contract():
    import generator_service.auth
    import generator_service.server
    import generator_service.updates.tensors
    import jaxrlhf.fleet.rpc.client
    import jaxrlhf.fleet.rpc.weights_file
    import jaxrlhf_wire
    import jaxrlhf_wire.chunks
    import jaxrlhf_wire.files
    import jaxrlhf_wire.stubs

    assert generator_service.server.generator_pb2 is jaxrlhf_wire.stubs.generator_pb2
    assert jaxrlhf.fleet.rpc.client.generator_pb2 is jaxrlhf_wire.stubs.generator_pb2
    assert generator_service.server.CHANNEL_OPTIONS is jaxrlhf.fleet.rpc.client.CHANNEL_OPTIONS
    assert (
        generator_service.updates.tensors.UPDATE_FILE_ALIGNMENT
        == jaxrlhf.fleet.rpc.weights_file.ALIGNMENT
    )
    assert generator_service.auth.AUTH_HEADER == jaxrlhf.fleet.rpc.client.AUTH_HEADER
    assert jaxrlhf_wire.READY_LINE == "GENERATOR_SERVICE_READY"
