"""A generator in LoRA mode (`--max-lora-rank`) on a real vLLM engine serving `tiny_llama`: each
update is an adapter, loaded with no pause; its greedy tokens are those of the merged model
(transformers, W + s B A); every token is tagged with its adapter's version; a malformed adapter
is refused with the served one untouched; a call running when the next adapter is published
finishes on its own, which is unloaded (and its folder deleted) once the call has ended. The
same adapter written into a shared file (UpdateWeightsShared with `lora`, as the learner's
shared-file transport writes it, progressively too) serves the same tokens as streamed, and a
malformed one is refused there as well.

One server for the module (an engine start is ~25 s); the tests publish versions in turn, each
one newer than the served version it reads first."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from generator_service.updates.adapter import LORA_TARGETS, LoraSettings, adapter_specs
from generator_service.updates.tensors import expected_tensors
from jaxrlhf_wire import ADMITTED_VERSION_HEADER
from jaxrlhf_wire.chunks import encode_weight_chunks
from jaxrlhf_wire.stubs import generator_pb2
from tests.generator_service.conftest import GREEDY_PROMPTS
from tests.generator_service.test_adapter_specs import merge
from tests.generator_service.test_shared_weights import SHARED_MALFORMED, _outside, _shared_file

pytestmark = pytest.mark.timeout(300)

MAX_LORA_RANK = 8
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lora_server(start_generator_server, tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    (folder / "updates").mkdir()
    args = ["--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", "3",
            "--update-dir", str(folder / "updates")]  # fmt: skip
    server = start_generator_server(tiny_llama, folder / "server.log", args)
    server.update_dir = folder / "updates"
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def lora_client(lora_server):
    from jaxrlhf.fleet.rpc import GeneratorClient

    with GeneratorClient(lora_server.address) as client:
        client.wait_until_serving(timeout=60)
        yield client


@pytest.fixture(scope="module")
def base_weights(tiny_llama) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(tiny_llama / "model.safetensors")


def random_adapter(tiny_llama, settings: LoraSettings, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    specs = adapter_specs(expected_tensors(tiny_llama), settings, MAX_LORA_RANK)
    return {n: (rng.standard_normal(s.shape) * 0.3).astype(np.float32) for n, s in specs.items()}


def lora_message(settings: LoraSettings) -> generator_pb2.LoraAdapter:
    return generator_pb2.LoraAdapter(rank=settings.rank, alpha=settings.alpha,
                                     target_modules=settings.target_modules,
                                     use_rslora=settings.use_rslora)  # fmt: skip


def publish(client, tensors, settings: LoraSettings, version: int, **header):
    chunks = encode_weight_chunks(tensors, version, 1 << 14, lora=lora_message(settings), **header)
    return client.update_weights_encoded(chunks)


def greedy(client, prompts=GREEDY_PROMPTS, max_tokens=MAX_TOKENS) -> list:
    completions = list(client.generate(prompts, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True))  # fmt: skip
    return sorted(completions, key=lambda c: (c.prompt_index, c.sample_index))


def assert_served(client, reference, weights, version: int) -> list[list[int]]:
    """Greedy tokens of every GREEDY_PROMPTS are `weights`' (transformers), all tagged
    `version`; returns them."""
    completions = greedy(client)
    tokens = [list(c.token_ids) for c in completions]
    expected = [reference.greedy(weights, prompt, MAX_TOKENS) for prompt in GREEDY_PROMPTS]
    assert tokens == expected
    for completion in completions:
        assert completion.policy_version == version
        assert list(completion.token_policy_versions) == [version] * MAX_TOKENS
    return tokens


def wait_for_adapters(client, versions: list[int], timeout: float = 30.0):
    """GetStatus once the loaded adapters are `versions` (within `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.status()
        if list(status.adapter_versions) == versions:
            return status
        assert time.monotonic() < deadline, f"adapters loaded: {list(status.adapter_versions)}"
        time.sleep(0.1)


def test_the_status_says_lora_and_the_base_serves_as_version_0(
    lora_client, reference, base_weights
):
    status = lora_client.status()
    assert (status.swap_mode, status.max_lora_rank, status.max_loras) == ("lora", 8, 3)
    assert status.num_weight_tensors == 0 and not status.preloaded_swaps
    assert "LoRA mode" in status.preloaded_swaps_off
    assert status.policy_version == 0 and list(status.adapter_versions) == []
    assert_served(lora_client, reference, base_weights, 0)
    # Full weights are refused by a LoRA server, streamed or shared.
    with pytest.raises(grpc.RpcError) as refused:
        lora_client.update_weights(base_weights, 1)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "takes LoRA adapters only" in refused.value.details()
    with _shared_file(lora_client, base_weights) as shared:
        with pytest.raises(grpc.RpcError) as refused:
            lora_client.update_weights_shared(shared.request(1))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "takes LoRA adapters only" in refused.value.details()
    assert lora_client.status().policy_version == 0


def test_an_adapter_serves_the_merged_model_tagged_with_its_version(
    lora_client, reference, base_weights, tiny_llama
):
    version = lora_client.status().policy_version + 1
    settings = LoraSettings(4, 8.0, tuple(LORA_TARGETS))
    adapter = random_adapter(tiny_llama, settings, seed=version)
    response = publish(lora_client, adapter, settings, version)
    assert (response.policy_version, response.num_tensors) == (version, 2 * 7 * 2)
    assert response.pause_seconds == 0.0
    tokens = assert_served(lora_client, reference, merge(base_weights, adapter, settings), version)
    base = [reference.greedy(base_weights, prompt, MAX_TOKENS) for prompt in GREEDY_PROMPTS]
    assert tokens != base  # the adapter matters
    status = wait_for_adapters(lora_client, [version])  # the one before it (if any) unloaded
    assert status.policy_version == version and status.num_updates >= 1


V_PROJ_B = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


def serving_an_adapter(client, reference, base_weights, tiny_llama) -> int:
    """The served version, once an adapter serves (published here when the base still serves:
    a test run alone)."""
    if client.status().policy_version == 0:
        test_an_adapter_serves_the_merged_model_tagged_with_its_version(
            client, reference, base_weights, tiny_llama
        )
    return client.status().policy_version


def with_value(tensors: dict, name: str, value: float) -> dict:
    """`tensors` with the first element of tensor `name` (a copy) set to `value`."""
    changed = {**tensors, name: tensors[name].copy()}
    changed[name][0, 0] = value
    return changed


def _refused(client, tensors, settings, version, code, problem) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        publish(client, tensors, settings, version)
    assert refused.value.code() == code, refused.value.details()
    assert problem in refused.value.details()


def test_a_malformed_adapter_is_refused_and_the_served_one_keeps_serving(
    lora_client, reference, base_weights, tiny_llama
):
    served = serving_an_adapter(lora_client, reference, base_weights, tiny_llama)
    before = greedy(lora_client)
    version = served + 1
    settings = LoraSettings(4, 8.0, ("q_proj", "v_proj"))
    good = random_adapter(tiny_llama, settings, seed=version)
    name = V_PROJ_B
    missing = {k: v for k, v in good.items() if k != name}
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    nan = with_value(good, name, np.nan)
    cases = [
        (good, LoraSettings(16, 8.0, settings.target_modules), invalid, "adapter rank 16"),
        (good, LoraSettings(4, 8.0, ("q_proj", "embed_tokens")), invalid, "'embed_tokens'"),
        ({**good, name: good[name].T.copy()}, settings, invalid, f"tensor {name} has shape"),
        (missing, settings, invalid, "num_tensors is 7 but"),
        (nan, settings, invalid, f"tensor {name} holds non-finite"),
    ]
    for tensors, header, code, problem in cases:
        _refused(lora_client, tensors, header, version, code, problem)
        status = lora_client.status()
        assert status.policy_version == served and list(status.adapter_versions) == [served]
    _refused(lora_client, good, settings, served, grpc.StatusCode.FAILED_PRECONDITION,
             f"policy_version {served} is not newer")  # fmt: skip
    after = greedy(lora_client)
    assert [list(c.token_ids) for c in after] == [list(c.token_ids) for c in before]
    assert {v for c in after for v in c.token_policy_versions} == {served}
    # The next good one (rsLoRA, a subset of the targets) serves.
    settings = LoraSettings(8, 4.0, ("q_proj", "v_proj", "down_proj"), use_rslora=True)
    good = random_adapter(tiny_llama, settings, seed=version)
    assert publish(lora_client, good, settings, version).policy_version == version
    assert_served(lora_client, reference, merge(base_weights, good, settings), version)


def test_a_call_running_at_a_publish_finishes_on_its_adapter_which_is_unloaded_after(
    lora_server, lora_client, reference, base_weights, tiny_llama
):
    settings = LoraSettings(4, 8.0, ("q_proj", "k_proj", "up_proj"))
    old = lora_client.status().policy_version + 1
    old_adapter = random_adapter(tiny_llama, settings, seed=old)
    publish(lora_client, old_adapter, settings, old)
    # A long call: its samples go in one at a time (max_running=1), so most are submitted after
    # the publish below; every one must run on the adapter the call was admitted under.
    prompt, count, length = [5, 6, 7, 8], 12, 64
    call = lora_client.generate([prompt] * count, max_tokens=length, temperature=0.0,
                                ignore_eos=True, max_running=1)  # fmt: skip
    assert dict(call.initial_metadata())[ADMITTED_VERSION_HEADER] == str(old)
    new = old + 1
    new_adapter = random_adapter(tiny_llama, settings, seed=new)
    assert publish(lora_client, new_adapter, settings, new).pause_seconds == 0.0
    published = time.time()
    during = lora_client.status()
    checked = time.time()
    short = greedy(lora_client, [[9, 10]], max_tokens=4)
    assert list(short[0].token_policy_versions) == [new] * 4
    completions = list(call)
    assert len(completions) == count
    assert max(c.finished_unix_time for c in completions) > checked  # it ran across the publish
    assert any(c.submitted_unix_time > published for c in completions)
    assert sorted(during.adapter_versions) == [old, new]  # the old one held by the call
    expected = reference.greedy(merge(base_weights, old_adapter, settings), prompt, length)
    for completion in completions:
        assert list(completion.token_policy_versions) == [old] * length
        assert list(completion.token_ids) == expected
    # Once the call is over, the old adapter is unloaded and its folder deleted.
    status = wait_for_adapters(lora_client, [new])
    assert status.policy_version == new
    (root,) = lora_server.update_dir.glob("jaxrlhf-lora-*")
    deadline = time.monotonic() + 10
    while list(root.glob(f"v{old}-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p.name.split("-")[0] for p in root.iterdir()] == [f"v{new}"]


def test_an_adapter_in_the_shared_file_serves_as_the_same_adapter_streamed(
    lora_client, reference, base_weights, tiny_llama
):
    """UpdateWeightsShared with `lora`: the file's adapter serves the merged model, the same
    tokens as the same adapter streamed; and as the learner's transport writes it (the request
    first, the file counted as it is written: `progressive`)."""
    from jaxrlhf.fleet.transport import SharedFileTransport, WeightUpdate

    version = lora_client.status().policy_version + 1
    settings = LoraSettings(4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
    adapter = random_adapter(tiny_llama, settings, seed=100 + version)
    with _shared_file(lora_client, adapter) as shared:
        request = shared.request(version, update_id="shared-adapter", lora=lora_message(settings))
        response = lora_client.update_weights_shared(request)
    assert (response.policy_version, response.num_tensors) == (version, 2 * 5 * 2)
    assert response.num_bytes == sum(tensor.nbytes for tensor in adapter.values())
    assert response.pause_seconds == 0.0
    assert lora_client.status().update_id == "shared-adapter"
    tokens = assert_served(lora_client, reference, merge(base_weights, adapter, settings), version)
    assert tokens != [reference.greedy(base_weights, p, MAX_TOKENS) for p in GREEDY_PROMPTS]
    assert publish(lora_client, adapter, settings, version + 1).policy_version == version + 1
    assert [list(c.token_ids) for c in greedy(lora_client)] == tokens
    specs = [(name, tensor.shape, tensor.dtype) for name, tensor in adapter.items()]
    folder = lora_client.status().shared_weights_dir
    transport = SharedFileTransport(folder, specs, progressive=True)
    update = WeightUpdate(version + 2, len(adapter), lora=lora_message(settings))
    try:
        outcomes = transport.send([lora_client], lambda: iter(adapter.items()), update, 60)
    finally:
        transport.close()
    assert not isinstance(outcomes[lora_client], grpc.RpcError), outcomes[lora_client]
    assert outcomes[lora_client].policy_version == version + 2
    assert [list(c.token_ids) for c in greedy(lora_client)] == tokens
    assert wait_for_adapters(lora_client, [version + 2]).policy_version == version + 2


def _gave_up(shared, request):
    from jaxrlhf_wire.files import PROGRESS_ABANDONED

    shared._count(PROGRESS_ABANDONED)
    request.progressive = True
    return request


def test_a_malformed_shared_adapter_is_refused_and_the_served_one_keeps_serving(
    lora_server, lora_client, reference, base_weights, tiny_llama, tmp_path
):
    served = serving_an_adapter(lora_client, reference, base_weights, tiny_llama)
    before = greedy(lora_client)
    version = served + 1
    settings = LoraSettings(4, 8.0, ("q_proj", "v_proj"))
    good = random_adapter(tiny_llama, settings, seed=200 + version)
    inf = with_value(good, V_PROJ_B, np.inf)
    invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    layouts = ("truncated file", "outside the folder", "wrong shape", "missing tensor",
               "stale version")  # fmt: skip
    cases = [(good, settings, *SHARED_MALFORMED[case]) for case in layouts]
    cases += [
        (inf, settings, None, invalid, f"tensor {V_PROJ_B} holds non-finite"),
        (good, LoraSettings(16, 8.0, settings.target_modules), None, invalid, "adapter rank 16"),
        (good, LoraSettings(4, 8.0, ("q_proj", "lm_head")), None, invalid, "'lm_head'"),
        (good, None, None, precondition, "takes LoRA adapters only"),
        (good, settings, _gave_up, grpc.StatusCode.ABORTED, "gave up"),
    ]
    for tensors, header, build, code, problem in cases:
        with _shared_file(lora_client, tensors) as shared:
            lora = lora_message(header) if header else None
            request = shared.request(version, lora=lora)
            if build is not None:
                args = (shared, request, tmp_path) if build is _outside else (shared, request)
                request = build(*args)
            with pytest.raises(grpc.RpcError) as refused:
                lora_client.update_weights_shared(request)
        assert refused.value.code() == code, refused.value.details()
        assert problem in refused.value.details()
        status = lora_client.status()
        assert status.policy_version == served and list(status.adapter_versions) == [served]
    (root,) = lora_server.update_dir.glob("jaxrlhf-lora-*")
    assert [p.name.split("-")[0] for p in root.iterdir()] == [f"v{served}"]  # nothing left
    after = greedy(lora_client)
    assert [list(c.token_ids) for c in after] == [list(c.token_ids) for c in before]
    assert {v for c in after for v in c.token_policy_versions} == {served}
    with _shared_file(lora_client, good) as shared:
        request = shared.request(version, lora=lora_message(settings))
        assert lora_client.update_weights_shared(request).policy_version == version
    assert_served(lora_client, reference, merge(base_weights, good, settings), version)


def test_a_rollback_to_an_older_version_serves_the_adapter_it_carries(
    lora_client, reference, base_weights, tiny_llama
):
    """A resumed run rolls its replicas back (`allow_rollback`, trainer.begin): an adapter for a
    version not newer than the served one is refused without it; with it, it loads as a new
    adapter (a fresh engine id, never the version) and serves its own weights, tagged with that
    version, while a call still holds the adapter that version had before (so the engine still
    has it loaded: an id reused would serve the old weights)."""
    settings = LoraSettings(4, 8.0, tuple(LORA_TARGETS))
    older = serving_an_adapter(lora_client, reference, base_weights, tiny_llama) + 1
    first = random_adapter(tiny_llama, settings, seed=7000)
    publish(lora_client, first, settings, older)
    held = lora_client.generate([[5, 6, 7, 8]] * 8, max_tokens=64, temperature=0.0,
                                ignore_eos=True, max_running=1)  # fmt: skip
    assert dict(held.initial_metadata())[ADMITTED_VERSION_HEADER] == str(older)
    newer = older + 1
    publish(lora_client, random_adapter(tiny_llama, settings, seed=7001), settings, newer)
    back = random_adapter(tiny_llama, settings, seed=7002)  # the rolled-back run's weights
    _refused(lora_client, back, settings, older, grpc.StatusCode.FAILED_PRECONDITION,
             f"policy_version {older} is not newer than the served version {newer}")  # fmt: skip
    response = publish(lora_client, back, settings, older, allow_rollback=True)
    rolled_back = time.time()
    assert response.policy_version == older and response.pause_seconds == 0.0
    # Two adapters of that version loaded: the held call's, and the rolled-back one.
    assert list(lora_client.status().adapter_versions).count(older) == 2
    merged = merge(base_weights, back, settings)
    assert_served(lora_client, reference, merged, older)
    before = merge(base_weights, first, settings)
    assert [reference.greedy(before, p, MAX_TOKENS) for p in GREEDY_PROMPTS] != [
        reference.greedy(merged, p, MAX_TOKENS) for p in GREEDY_PROMPTS
    ]  # the version's earlier adapter would serve other tokens
    completions = list(held)
    assert len(completions) == 8 and max(c.finished_unix_time for c in completions) > rolled_back
    expected = reference.greedy(before, [5, 6, 7, 8], 64)
    assert all(list(c.token_ids) == expected for c in completions)  # it kept its adapter
