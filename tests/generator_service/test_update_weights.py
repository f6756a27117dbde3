"""UpdateWeights against the real engine: swaps match transformers, bad streams change nothing,
and an update during a long generation never yields a completion of mixed or wrong version."""

from __future__ import annotations

import threading
import time

import grpc
import ml_dtypes
import numpy as np
import pytest

from jaxrlhf_wire.stubs import generator_pb2
from tests.generator_service.wire import chunk_messages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [[5, 6, 7, 8], [9, 10], [1, 200, 31, 77, 150, 3]]


def perturbed(tensors: dict[str, np.ndarray], seed: int, scale: float = 0.05) -> dict:
    rng = np.random.default_rng(seed)
    return {
        name: (np.asarray(value, np.float32) + rng.normal(0, scale, value.shape)).astype(np.float32)
        for name, value in tensors.items()
    }


def greedy(client, prompts=PROMPTS, max_tokens: int = 12) -> tuple[list[list[int]], set[int]]:
    completions = sorted(
        client.generate(prompts, max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        key=lambda completion: completion.prompt_index,
    )
    return [list(c.token_ids) for c in completions], {c.policy_version for c in completions}


def test_update_swaps_weights_and_version(client, served, reference):
    new = perturbed(served.tensors, seed=1)
    before = client.status()
    response = served.push(client, new, update_id="update-1")
    assert response.policy_version == before.policy_version + 1
    assert response.num_tensors == len(new) == before.num_weight_tensors
    assert response.num_bytes == sum(value.nbytes for value in new.values())
    assert response.seconds >= response.preload_seconds + response.pause_seconds
    assert response.preload_seconds > 0 and response.pause_seconds > 0
    status = client.status()
    # The last swap's parts, reported until the next one.
    assert (status.preload_seconds, status.pause_seconds) == (
        response.preload_seconds, response.pause_seconds)  # fmt: skip
    assert status.policy_version == response.policy_version
    assert status.update_id == "update-1"  # the update that put the served weights in place
    assert status.num_updates == before.num_updates + 1
    assert status.last_update_unix_time > time.time() - 60
    tokens, versions = greedy(client)
    assert versions == {response.policy_version}
    assert tokens == [reference.greedy(new, prompt, 12) for prompt in PROMPTS]
    assert tokens != [list(c.token_ids) for c in served.initial_completions]


def test_bfloat16_update_is_cast_to_the_served_dtype(client, served, reference):
    new = {
        name: value.astype(ml_dtypes.bfloat16)
        for name, value in perturbed(served.tensors, seed=2).items()
    }
    served.push(client, new)
    assert client.status().update_id == ""  # sent without one
    tokens, versions = greedy(client)
    assert versions == {served.policy_version}
    assert tokens == [reference.greedy(new, prompt, 12) for prompt in PROMPTS]


def _chunks(tensors, version, chunk_bytes=1 << 14) -> list[generator_pb2.WeightChunk]:
    return list(chunk_messages(tensors, version, chunk_bytes))


def _stale(tensors, version):
    return _chunks(tensors, version - 1)


def _unknown_name(tensors, version):
    chunks = _chunks(tensors, version)
    chunks[-1].name = "model.layers.9.mlp.up_proj.weight"
    return chunks


def _wrong_shape(tensors, version):
    chunks = _chunks(tensors, version)
    for chunk in chunks:
        if chunk.name == "model.layers.1.mlp.down_proj.weight":
            chunk.shape[:] = [256, 128]
    return chunks


def _wrong_dtype(tensors, version):
    chunks = _chunks(tensors, version)
    chunks[0].dtype = "float64"
    return chunks


def _too_few_tensors(tensors, version):
    return _chunks(dict(list(tensors.items())[:-1]), version)


def _version_changes(tensors, version):
    chunks = _chunks(tensors, version)
    chunks[len(chunks) // 2].policy_version = version + 1
    return chunks


def _duplicated(tensors, version):
    chunks = _chunks(tensors, version)
    norm = [c for c in chunks if c.name == "model.norm.weight"]
    return chunks + norm


def _over_long(tensors, version):
    chunks = _chunks(tensors, version)
    chunks[-1].data += b"\0\0\0\0"
    return chunks


def _truncated(tensors, version):
    chunks = _chunks(tensors, version)
    embed = [c for c in chunks if c.name == "model.embed_tokens.weight"]
    return [c for c in chunks if c is not embed[-1]]


def _missing_tensor(tensors, version):
    chunks = _chunks(tensors, version)
    return [c for c in chunks if c.name != "model.layers.0.self_attn.k_proj.weight"]


MALFORMED = {
    "stale version": (_stale, grpc.StatusCode.FAILED_PRECONDITION, "is not newer than"),
    "unknown name": (_unknown_name, grpc.StatusCode.INVALID_ARGUMENT, "unknown tensor"),
    "wrong shape": (
        _wrong_shape,
        grpc.StatusCode.INVALID_ARGUMENT,
        "tensor model.layers.1.mlp.down_proj.weight has shape [256, 128], expected [128, 256]",
    ),
    "wrong dtype": (_wrong_dtype, grpc.StatusCode.INVALID_ARGUMENT, "dtype 'float64'"),
    "too few tensors": (
        _too_few_tensors,
        grpc.StatusCode.INVALID_ARGUMENT,
        "num_tensors is 19 but the served model has 20",
    ),
    "version changes": (_version_changes, grpc.StatusCode.INVALID_ARGUMENT, "same values"),
    "duplicated": (_duplicated, grpc.StatusCode.INVALID_ARGUMENT, "duplicated data"),
    "over-long": (_over_long, grpc.StatusCode.INVALID_ARGUMENT, "over-long data"),
    "truncated": (
        _truncated,
        grpc.StatusCode.DATA_LOSS,
        "1 incomplete: model.embed_tokens.weight (received 180224 of 196608 bytes)",
    ),
    "missing tensor": (
        _missing_tensor,
        grpc.StatusCode.DATA_LOSS,
        "never started: model.layers.0.self_attn.k_proj.weight",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_stream_changes_nothing(client, served, case):
    build, code, message = MALFORMED[case]
    before_tokens, before_versions = greedy(client)
    version = client.status().policy_version
    chunks = build(perturbed(served.tensors, seed=100), version + 1)
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.UpdateWeights(iter(chunks))
    assert caught.value.code() == code, caught.value.details()
    assert message in caught.value.details()
    status = client.status()
    assert status.policy_version == version and status.serving
    assert greedy(client) == (before_tokens, before_versions)


def test_client_dying_mid_stream_changes_nothing(client, served):
    before = greedy(client)
    version = client.status().policy_version
    chunks = _chunks(perturbed(served.tensors, seed=101), version + 1)

    def dying_stream():
        yield from chunks[: len(chunks) // 2]
        raise ConnectionError("learner crashed")

    with pytest.raises(grpc.RpcError) as caught:
        client.stub.UpdateWeights(dying_stream())
    assert caught.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    assert client.status().policy_version == version
    assert greedy(client) == before


def test_update_during_a_long_generation_never_mixes_versions(client, served, reference):
    old_version, old = served.policy_version, served.tensors
    new = perturbed(old, seed=3)
    long_prompts = [[5, 6, 7, 8], [11, 12, 13], [100, 101], [7]]
    late_prompt = [[42, 43, 44]]
    results: dict[str, object] = {}

    def long_call() -> None:
        results["long"] = list(
            client.generate(long_prompts, max_tokens=240, temperature=0.0, ignore_eos=True)
        )
        results["long_done"] = time.monotonic()

    def update() -> None:
        results["update"] = served.push(client, new)
        results["update_done"] = time.monotonic()

    def late_call() -> None:
        results["late"] = list(
            client.generate(late_prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        )

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    long_thread = threading.Thread(target=long_call)
    long_thread.start()
    wait_for(lambda: client.status().num_requests_running >= 4, "the long call to run")
    update_thread = threading.Thread(target=update)
    update_thread.start()
    wait_for(lambda: client.status().swap_pending, "the swap to be pending")
    assert "long" not in results, "the long call must still run when the swap is requested"
    late_thread = threading.Thread(target=late_call)
    late_thread.start()
    wait_for(
        lambda: client.status().num_calls_waiting >= 1 or "late" in results,
        "the late call to queue behind the swap",
    )
    for thread in (long_thread, update_thread, late_thread):
        thread.join(timeout=300)

    long = sorted(results["long"], key=lambda completion: completion.prompt_index)
    assert [c.policy_version for c in long] == [old_version] * len(long_prompts)
    for completion in long:  # drain mode: every token of it too
        assert list(completion.token_policy_versions) == [old_version] * 240
    for completion, prompt in zip(long, long_prompts, strict=True):
        assert list(completion.token_ids) == reference.greedy(old, prompt, 240)
    assert results["update"].policy_version == old_version + 1
    assert results["update_done"] >= results["long_done"]
    (late,) = results["late"]
    assert late.policy_version == old_version + 1
    assert list(late.token_ids) == reference.greedy(new, late_prompt[0], 12)
