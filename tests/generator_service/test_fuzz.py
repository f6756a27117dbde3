"""The wire fuzzer (bench/fuzz_wire.py) against the session's real server, within a budget, and
the inputs it found that once broke a property, each shrunk to a minimal one."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager

import grpc
import pytest
from safetensors.numpy import load_file

from bench.fuzz_wire import WireFuzzer, fuzz_for
from jaxrlhf_wire.chunks import encode_weight_chunks
from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2
from tests.conftest import REPO

# The tests that talk to the session's vLLM server are marked slow one by one; the checks of
# pure functions below them are not.
engine = pytest.mark.slow
pytestmark = pytest.mark.timeout(300)

FUZZ_SECONDS = 20


@contextmanager
def keeping_record(client, served):
    """Keeps the session's record of what the server serves true, whatever the test does."""
    try:
        yield
    finally:
        served.record(client.status().policy_version, served.tensors)


@engine
def test_fuzzed_wire_inputs_get_clear_statuses_and_keep_the_weights(client, served):
    with keeping_record(client, served):
        fuzzer = WireFuzzer(client, served.tensors)
        before = fuzzer.greedy()
        try:
            fuzz_for(fuzzer, FUZZ_SECONDS, seed=0)
        finally:
            fuzzer.close()
        assert fuzzer.greedy() == before
        kinds = fuzzer.summary()["by_kind"]
        assert set(kinds) == {"StreamCase", "SharedCase", "GenerateCase", "RawCase"}, kinds


@engine
def test_the_fuzz_bench_runs_and_counts_its_inputs(client, served, generator_server, tiny_llama):
    with keeping_record(client, served):
        served.push(client, load_file(tiny_llama / "model.safetensors"))
        result = subprocess.run(
            [
                sys.executable, "bench/fuzz_wire.py", "--address", generator_server.address,
                "--model", str(tiny_llama), "--seconds", "3", "--seed", "1",
            ],
            cwd=REPO, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        row = json.loads(result.stdout.strip().splitlines()[-1])
        assert row["failure"] is None and row["inputs"] > 0, row
        assert sum(row["by_kind"].values()) == row["inputs"], row


# --- what the fuzzer found, shrunk ------------------------------------------------------------


def _raw_unary(client, method: str):
    return client.channel.unary_unary(f"/{SERVICE_NAME}/{method}", request_serializer=None)


@engine
@pytest.mark.parametrize("method", ["Generate", "UpdateWeightsShared", "GetStatus"])
def test_undecodable_request_bytes_get_invalid_argument(client, method):
    # A string field (1, then Prompt.id / SharedWeights.path) holding invalid UTF-8: gRPC
    # answered UNKNOWN ("Unexpected DecodeError") from the deserializer.
    call = (
        client.channel.unary_stream(f"/{SERVICE_NAME}/{method}", request_serializer=None)
        if method == "Generate"
        else _raw_unary(client, method)
    )
    data = {"Generate": b"\x0a\x03\x0a\x01\xff", "UpdateWeightsShared": b"\x12\x01\xff",
            "GetStatus": b"\x0a\x05"}[method]  # fmt: skip
    with pytest.raises(grpc.RpcError) as raised:
        list(call(data, timeout=30)) if method == "Generate" else call(data, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid" in raised.value.details()
    assert client.status().serving


@engine
def test_a_version_that_completions_cannot_carry_is_refused(client, served):
    # Completion.token_policy_versions is int64: a swap to 2**63 was accepted, and every
    # Generate after it failed to serialise its completions.
    with keeping_record(client, served):
        before = client.status()
        try:
            with pytest.raises(grpc.RpcError) as raised:
                client.update_weights(served.tensors, 2**63, chunk_bytes=1 << 20)
        finally:
            if client.status().policy_version != before.policy_version:  # the defect: undo it
                chunks = encode_weight_chunks(
                    served.tensors, before.policy_version + 1, allow_rollback=True
                )
                client.update_weights_encoded(chunks)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2**63 - 1" in raised.value.details()
        assert client.status().num_updates == before.num_updates


@engine
def test_a_shared_path_with_a_nul_byte_is_refused(client, served):
    # os.path.realpath raised ValueError ("embedded null byte"): UNKNOWN.
    request = generator_pb2.SharedWeights(
        policy_version=served.policy_version + 1,
        path=client.status().shared_weights_dir + "/weights\x00.bin",
    )
    with pytest.raises(grpc.RpcError) as raised:
        client.update_weights_shared(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "NUL" in raised.value.details()


@engine
def test_a_temperature_above_the_engines_limit_is_invalid_argument(client):
    # vLLM refuses temperatures over 2 when the request is built, outside the checks: UNKNOWN.
    with pytest.raises(grpc.RpcError) as raised:
        list(client.generate([[5, 6]], max_tokens=2, temperature=2.5, timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in raised.value.details()


@engine
def test_a_call_for_more_samples_than_a_call_may_hold_is_refused_at_once(client):
    # n = 2**32 - 1: the server went on submitting engine requests until the call timed out.
    with pytest.raises(grpc.RpcError) as raised:
        list(client.generate([[5, 6]], max_tokens=1, n=2**32 - 1, timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "samples" in raised.value.details()
    assert client.status().num_requests_running == 0


# --- the same rules, without a server ----------------------------------------------------------


def test_request_rules_refuse_what_the_engine_cannot_take():
    from generator_service.requests import GenerateError, Sampling, validate_request

    def refusal(n: int = 1, temperature: float = 1.0) -> str:
        sampling = Sampling(n=n, temperature=temperature, top_p=1.0, top_k=0, max_tokens=1)
        with pytest.raises(GenerateError) as raised:
            validate_request([("a", [1]), ("b", [2])], sampling, vocab_size=10, max_model_len=8)
        assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
        return raised.value.message

    assert "2.5" in refusal(temperature=2.5)
    assert "131072 samples" in refusal(n=1 << 16)
    validate_request(
        [("a", [1])],
        Sampling(n=1 << 16, temperature=2.0, top_p=1.0, top_k=0, max_tokens=1),
        vocab_size=10,
        max_model_len=8,
    )


def test_update_rules_refuse_versions_over_int64_and_nul_paths(tmp_path):
    from generator_service.updates.tensors import (
        WeightUpdateError,
        check_update_header,
        shared_file_path,
    )

    check_update_header({}, 0, 2**63 - 1, 0, False)
    with pytest.raises(WeightUpdateError, match=r"over 2\*\*63 - 1") as raised:
        check_update_header({}, 0, 2**63, 0, False)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(WeightUpdateError, match="NUL") as raised:
        shared_file_path(str(tmp_path / "weights\x00.bin"), str(tmp_path))
    assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION


class _AnsweringServicer:
    """Answers every call with an empty message: what reaches it was decoded."""

    async def Generate(self, request, context):
        yield generator_pb2.Completion()

    async def UpdateWeights(self, request_iterator, context):
        return generator_pb2.UpdateWeightsResponse()

    async def UpdateWeightsShared(self, request, context):
        return generator_pb2.UpdateWeightsResponse()

    async def GetStatus(self, request, context):
        return generator_pb2.GeneratorStatus()


UNDECODABLE = {"Generate": b"\x0a\x03\x0a\x01\xff", "UpdateWeightsShared": b"\x12\x01\xff",
               "GetStatus": b"\x0a\x05"}  # fmt: skip


def test_the_service_table_answers_undecodable_bytes_with_invalid_argument():
    import asyncio

    from generator_service.server import add_generator_service

    async def codes() -> dict[str, grpc.StatusCode]:
        server = grpc.aio.server()
        add_generator_service(_AnsweringServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        found = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for method, data in UNDECODABLE.items():
                    path = f"/{SERVICE_NAME}/{method}"
                    try:
                        if method == "Generate":
                            [_ async for _ in channel.unary_stream(path)(data)]
                        else:
                            await channel.unary_unary(path)(data)
                        found[method] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as error:
                        found[method] = error.code()
        finally:
            await server.stop(0)
        return found

    assert asyncio.run(codes()) == dict.fromkeys(UNDECODABLE, grpc.StatusCode.INVALID_ARGUMENT)
