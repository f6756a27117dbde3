"""The same-host weight path (UpdateWeightsShared): the learner's file as the engine maps it, every
refusal rule without an engine, then the real server swapping from a shared file and refusing
bad ones with nothing changed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest

from generator_service.updates.tensors import (
    UPDATE_FILE_ALIGNMENT,
    TensorSpec,
    WeightUpdateError,
    check_shared_layout,
    shared_file_path,
)

SPECS = {
    "model.embed_tokens.weight": TensorSpec("model.embed_tokens.weight", (6, 4), "F32"),
    "model.norm.weight": TensorSpec("model.norm.weight", (4,), "F32"),
}
EMBED, NORM = SPECS


def layout(**changes):
    entries = {EMBED: ["float32", (6, 4), 0], NORM: ["float32", (4,), UPDATE_FILE_ALIGNMENT]}
    for name, entry in changes.items():
        entries[name] = entry
    return [(name, *entry) for name, entry in entries.items() if entry is not None]


def refused(
    entries, file_size=2 * UPDATE_FILE_ALIGNMENT, version=1, current=0
) -> WeightUpdateError:
    with pytest.raises(WeightUpdateError) as caught:
        check_shared_layout(SPECS, current, version, entries, file_size)
    return caught.value


def test_a_valid_layout_is_returned_in_order():
    tensors = check_shared_layout(SPECS, 0, 1, layout(), 2 * UPDATE_FILE_ALIGNMENT)
    assert [(t.name, t.position, t.nbytes) for t in tensors] == [
        (EMBED, 0, 96),
        (NORM, UPDATE_FILE_ALIGNMENT, 16),
    ]


@pytest.mark.parametrize(
    "entries, kwargs, code, message",
    [
        (layout(), dict(version=3, current=3), "FAILED_PRECONDITION", "is not newer than"),
        (layout(**{NORM: None}), {}, "INVALID_ARGUMENT", "num_tensors is 1 but"),
        (
            layout(**{NORM: ["float32", (5,), 4096]}),
            {},
            "INVALID_ARGUMENT",
            "tensor model.norm.weight has shape [5], expected [4]",
        ),
        (layout(**{NORM: ["int8", (4,), 4096]}), {}, "INVALID_ARGUMENT", "dtype 'int8'"),
        (layout(**{NORM: ["float32", (4,), 100]}), {}, "INVALID_ARGUMENT", "not a multiple"),
        (layout(**{NORM: ["float32", (4,), 0]}), {}, "INVALID_ARGUMENT", "overlap"),
        (layout(), dict(file_size=4096 + 8), "DATA_LOSS", "past the end of the shared file"),
        (
            [(EMBED, "float32", (6, 4), 0), (EMBED, "float32", (6, 4), 4096)],
            {},
            "INVALID_ARGUMENT",
            "listed twice",
        ),
        (
            [(EMBED, "float32", (6, 4), 0), ("lm_head.weight", "float32", (6, 4), 4096)],
            {},
            "INVALID_ARGUMENT",
            "unknown tensor 'lm_head.weight'",
        ),
    ],
)
def test_a_bad_layout_is_refused_with_a_named_problem(entries, kwargs, code, message):
    error = refused(entries, **kwargs)
    assert error.code == getattr(grpc.StatusCode, code)
    assert message in error.message


def test_only_regular_files_inside_the_shared_folder_are_mapped(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    inside = shared / "update.bin"
    inside.write_bytes(b"x")
    assert shared_file_path(str(inside), str(shared)) == os.path.realpath(inside)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"x")
    link = shared / "link.bin"
    link.symlink_to(outside)
    nested = shared / "sub"
    nested.mkdir()
    for path, message in [
        (outside, "is not in the server's shared folder"),
        (link, "is not in the server's shared folder"),  # resolved before the check
        (shared / "missing.bin", "does not exist"),
        (nested, "not a regular file"),
    ]:
        with pytest.raises(WeightUpdateError) as caught:
            shared_file_path(str(path), str(shared))
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert message in caught.value.message


def test_only_peers_on_this_host_may_send_shared_updates():
    from generator_service.server import is_local_peer

    for peer in ["ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/tmp/g.sock",
                 "ipv6:[::ffff:127.0.0.1]:5000"]:  # fmt: skip
        assert is_local_peer(peer), peer
    for peer in ["ipv4:10.1.2.3:5000", "ipv6:[2001:db8::1]:5000", "garbage"]:
        assert not is_local_peer(peer), peer


def test_the_learners_file_is_what_the_worker_maps(tmp_path):
    """Strided (transposed) and cast tensors land bit for bit where the request says."""
    import torch

    from generator_service.worker_extension import map_preloaded_tensors
    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile

    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(5, 3)).astype(np.float32)  # written transposed: a strided view
    norm = rng.normal(size=(7,)).astype(np.float32)
    bf16 = ml_dtypes.bfloat16
    specs = [("a.weight", (3, 5), np.float32), ("b.weight", (7,), bf16)]
    with SharedWeightsFile(str(tmp_path), specs) as shared:
        assert shared.write([("a.weight", kernel.T), ("b.weight", norm)]) == 60 + 14
        request = shared.request(policy_version=4)
        assert request.path == shared.path and Path(shared.path).parent == tmp_path
        manifest = [[t.name, t.dtype, list(t.shape), t.position] for t in request.tensors]
        assert [m[3] % UPDATE_FILE_ALIGNMENT for m in manifest] == [0, 0]
        mapped, views = map_preloaded_tensors(shared.path, manifest)
        views = dict(views)
        assert torch.equal(views["a.weight"], torch.from_numpy(np.ascontiguousarray(kernel.T)))
        expected = torch.from_numpy(norm.astype(bf16).view(np.int16)).view(torch.bfloat16)
        assert torch.equal(views["b.weight"], expected)
        del views, mapped
        with pytest.raises(ValueError, match="expected tensor a.weight"):
            shared.write([("b.weight", norm)])
        with pytest.raises(ValueError, match="were not written"):
            shared.write([("a.weight", kernel.T)])
    assert not os.path.exists(shared.path)


def test_forcing_the_shared_file_for_a_remote_generator_fails_clearly():
    from jaxrlhf.fleet.pool import GeneratorError, GeneratorPool

    pool = GeneratorPool(["10.255.0.1:50051"], transport="shared")
    try:
        with pytest.raises(GeneratorError, match="10.255.0.1:50051 are not addressed on this host"):
            pool.publish_weights(lambda: iter(()), 1, 1, specs=[("w", (1,), np.float32)])
    finally:
        pool.close()
    with pytest.raises(ValueError, match="weight transport must be one of"):
        GeneratorPool(["127.0.0.1:1"], transport="carrier-pigeon")


# --- the real server (the suite's session engine) ---------------------------------------------


def _shared_file(client, tensors):
    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile

    folder = client.status().shared_weights_dir
    assert folder and os.path.isdir(folder)
    shared = SharedWeightsFile(folder, [(n, v.shape, v.dtype) for n, v in tensors.items()])
    shared.write(tensors.items())
    return shared


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shared_update_swaps_weights_and_version(client, served, reference):
    from tests.generator_service.test_update_weights import greedy, perturbed

    new = perturbed(served.tensors, seed=11)
    version = served.policy_version + 1
    with _shared_file(client, new) as shared:
        request = shared.request(version)
        request.update_id = "shared-update"
        response = client.update_weights_shared(request)
        served.record(version, new)
    assert response.policy_version == version and response.num_tensors == len(new)
    assert response.num_bytes == sum(value.nbytes for value in new.values())
    assert response.pause_seconds > 0 and response.preload_seconds > 0
    assert response.seconds >= response.preload_seconds + response.pause_seconds
    status = client.status()
    assert (status.preload_seconds, status.pause_seconds) == (
        response.preload_seconds, response.pause_seconds)  # fmt: skip
    assert status.update_id == "shared-update"
    tokens, versions = greedy(client)
    assert versions == {version}
    assert tokens == [reference.greedy(new, prompt, 12) for prompt in served.initial_prompts]


def _truncate(shared, request):
    os.truncate(shared.path, request.tensors[-1].position)
    return request


def _outside(shared, request, tmp_path):
    copy = tmp_path / "update.bin"
    copy.write_bytes(Path(shared.path).read_bytes())
    request.path = str(copy)
    return request


def _wrong_shape(shared, request):
    tensor = next(t for t in request.tensors if len(set(t.shape)) == 2)  # not square
    reversed_shape = list(reversed(tensor.shape))
    del tensor.shape[:]
    tensor.shape.extend(reversed_shape)
    return request


def _missing(shared, request):
    del request.tensors[2]
    return request


def _stale(shared, request):
    request.policy_version -= 1
    return request


def _adapter(shared, request):
    request.lora.rank, request.lora.alpha = 4, 8.0
    request.lora.target_modules.append("q_proj")
    return request


SHARED_MALFORMED = {
    "truncated file": (_truncate, grpc.StatusCode.DATA_LOSS, "past the end of the shared file"),
    "outside the folder": (_outside, grpc.StatusCode.FAILED_PRECONDITION, "shared folder"),
    "wrong shape": (_wrong_shape, grpc.StatusCode.INVALID_ARGUMENT, "has shape"),
    "missing tensor": (_missing, grpc.StatusCode.INVALID_ARGUMENT, "num_tensors is"),
    "stale version": (_stale, grpc.StatusCode.FAILED_PRECONDITION, "is not newer than"),
    "an adapter": (_adapter, grpc.StatusCode.FAILED_PRECONDITION, "takes full weights only"),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(SHARED_MALFORMED))
def test_bad_shared_update_changes_nothing(client, served, case, tmp_path):
    from tests.generator_service.test_update_weights import greedy, perturbed

    build, code, message = SHARED_MALFORMED[case]
    before = greedy(client)
    version = client.status().policy_version
    with _shared_file(client, perturbed(served.tensors, seed=12)) as shared:
        request = shared.request(version + 1)
        args = (shared, request, tmp_path) if build is _outside else (shared, request)
        with pytest.raises(grpc.RpcError) as caught:
            client.update_weights_shared(build(*args))
    assert caught.value.code() == code, caught.value.details()
    assert message in caught.value.details()
    status = client.status()
    assert status.policy_version == version and status.serving
    assert greedy(client) == before


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pool_picks_the_shared_file_for_a_local_server_and_streams_when_told(
    client, served, reference
):
    from jaxrlhf.fleet.pool import GeneratorPool
    from tests.generator_service.test_update_weights import greedy, perturbed

    specs = [(name, value.shape, value.dtype) for name, value in served.tensors.items()]
    for transport, seed in [("auto", 13), ("stream", 14)]:
        new = perturbed(served.tensors, seed=seed)
        pool = GeneratorPool([client.target], transport=transport)
        try:
            version = served.policy_version + 1
            pool.publish_weights(lambda n=new: iter(n.items()), len(new), version, specs=specs)
            served.record(version, new)
            chosen = pool.delivery.transport
            assert chosen.name == ("shared" if transport == "auto" else "stream")
            shared_file = getattr(chosen, "_file", None)
            shared_path = shared_file.path if shared_file is not None else None
        finally:
            pool.close()
        assert shared_path is None or not os.path.exists(shared_path)  # removed on close
        tokens, versions = greedy(client)
        assert versions == {version}
        assert tokens == [reference.greedy(new, prompt, 12) for prompt in served.initial_prompts]


# --- written while the server preloads it (SharedWeights.progressive) ---------------------------


def test_a_progressive_update_keeps_the_first_bytes_for_its_count():
    from generator_service.updates.tensors import check_progress_page

    tensors = check_shared_layout(SPECS, 0, 1, layout(), 2 * UPDATE_FILE_ALIGNMENT)
    with pytest.raises(WeightUpdateError, match="hold the count of tensors written") as caught:
        check_progress_page(tensors)  # the embedding lies at byte 0
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    moved = layout(**{EMBED: ["float32", (6, 4), 2 * UPDATE_FILE_ALIGNMENT]})
    check_progress_page(check_shared_layout(SPECS, 0, 1, moved, 3 * UPDATE_FILE_ALIGNMENT))


def _written_slowly(tensors: dict, pause_after: int, pause: float, fail: bool = False):
    """The tensors, with `pause` seconds after the first `pause_after` (then, if `fail`, an
    error instead of the rest)."""
    for index, item in enumerate(tensors.items()):
        if index == pause_after:
            time.sleep(pause)
            if fail:
                raise RuntimeError("the learner's conversion failed")
        yield item


def _progressive(client, tensors, version, write):
    """Sends a progressive request for a new shared file, then `write(file)`; returns (the
    call's response or error, the status read 0.6 s after the request)."""
    import concurrent.futures

    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile

    folder = client.status().shared_weights_dir
    specs = [(n, v.shape, v.dtype) for n, v in tensors.items()]
    with SharedWeightsFile(folder, specs) as shared, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:  # fmt: skip
        shared.begin_progress()
        call = pool.submit(client.update_weights_shared, shared.request(version, progressive=True))
        mid = pool.submit(lambda: (time.sleep(0.6), client.status())[1])
        try:
            write(shared)
        except RuntimeError:
            pass
        try:
            return call.result(timeout=120), mid.result()
        except grpc.RpcError as error:
            return error, mid.result()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_progressive_shared_update_swaps_only_once_written(client, served, reference):
    """Sent before a word is written: the server preloads what is written and waits for the rest
    (a pause of 1.5 s half-way), swaps the whole update, and generates from it."""
    from tests.generator_service.test_update_weights import greedy, perturbed

    new = perturbed(served.tensors, seed=15)
    version = served.policy_version + 1
    slowly = _written_slowly(new, len(new) // 2, 1.5)
    response, mid = _progressive(client, new, version, lambda f: f.write(slowly, progress=True))
    assert not isinstance(response, grpc.RpcError), response.details()
    served.record(version, new)
    assert mid.policy_version == version - 1  # half written: the old weights still served
    assert response.policy_version == version and response.num_tensors == len(new)
    assert response.seconds >= 1.5
    tokens, versions = greedy(client)
    assert versions == {version}
    assert tokens == [reference.greedy(new, prompt, 12) for prompt in served.initial_prompts]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_progressive_write_that_fails_or_stalls_changes_nothing(client, served):
    from tests.generator_service.conftest import SENDERS_TIMEOUT_S
    from tests.generator_service.test_update_weights import greedy, perturbed

    before = greedy(client)
    version = client.status().policy_version
    new = perturbed(served.tensors, seed=16)
    failing = _written_slowly(new, len(new) // 2, 0.2, fail=True)
    failed, _ = _progressive(client, new, version + 1, lambda f: f.write(failing, progress=True))
    assert failed.code() == grpc.StatusCode.ABORTED and "gave up" in failed.details()
    started = time.monotonic()
    stalled, _ = _progressive(client, new, version + 1, lambda f: f._count(3))  # then nothing
    assert stalled.code() == grpc.StatusCode.ABORTED  # transient: the learner may send it again
    assert "gained no tensor for 5 s (3 of" in stalled.details()
    assert "the served weights are unchanged" in stalled.details()
    assert time.monotonic() - started >= SENDERS_TIMEOUT_S
    wrong, _ = _progressive(client, new, version + 1, lambda f: f._count(len(new) + 1))
    assert wrong.code() == grpc.StatusCode.INVALID_ARGUMENT and "only grows" in wrong.details()
    status = client.status()
    assert status.policy_version == version and status.serving
    assert greedy(client) == before


# 300 tensors: the count crosses 255 -> 256, where a torn read says 0 or 511.
MANY = {f"model.layers.{i}.weight": np.full((2,), i, np.float32) for i in range(300)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first_byte", [0, 1], ids=["low-byte-first", "high-byte-first"])
def test_a_count_caught_half_stored_is_waited_for_not_taken(first_byte):
    """The learner is caught half-way through storing 256 over 255, holding the file's lock
    (`jaxrlhf_wire.files`) for 0.5 s with one byte stored: the file says 0 (a decrease) or 511
    (tensors not written yet). The server (the service's handler, on a real gRPC server) waits
    for the store instead of taking the torn count, and swaps the update once it is written."""
    import concurrent.futures
    import fcntl

    from generator_service.updates.tensors import TensorSpec
    from jaxrlhf.fleet.rpc import GeneratorClient
    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile
    from jaxrlhf_wire.files import PROGRESS_BYTES
    from tests.generator_service.replicas import RecordingReplica

    replica = RecordingReplica({n: TensorSpec(n, v.shape, "F32") for n, v in MANY.items()})
    client = GeneratorClient(replica.address)
    specs = [(n, v.shape, v.dtype) for n, v in MANY.items()]
    try:
        with SharedWeightsFile(replica.engine.update_dir, specs) as shared, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:  # fmt: skip
            shared.begin_progress()
            call = pool.submit(client.update_weights_shared,
                               shared.request(1, progressive=True), 60)  # fmt: skip
            shared.write_slices(
                (name, _whole(value)) for name, value in MANY.items()
            )  # every byte in place; the count alone says what the server may take
            shared._count(255)
            time.sleep(0.5)  # the server reads 255
            fd = os.open(shared.path, os.O_WRONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                stored = (256).to_bytes(PROGRESS_BYTES, "little")
                os.pwrite(fd, stored[first_byte : first_byte + 1], first_byte)
                time.sleep(0.5)  # caught half-way
                os.pwrite(fd, stored, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
            shared._count(len(MANY))
            response = call.result(timeout=60)
        assert response.policy_version == 1 and response.num_tensors == len(MANY)
        received = replica.received(1)
        for name, value in MANY.items():
            assert received[name] == ("float32", value.tobytes()), name
    finally:
        client.close()
        replica.stop()


def _whole(value: np.ndarray):
    from jaxrlhf_wire.chunks import TensorSlice

    return TensorSlice(value.shape, (0,) * value.ndim, value)
