"""Generate against the real engine: tags, logprobs, validation, concurrency, health, reflection."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_status_describes_the_served_model(client, tiny_llama):
    status = client.status()
    assert status.model == str(tiny_llama)
    assert status.max_model_len == 256
    assert status.vocab_size == 384
    assert status.dtype == "float32"
    assert status.serving
    assert status.num_weight_tensors == 20  # 2 layers x 9 + embedding + final norm; lm_head tied
    assert (status.swap_mode, status.in_flight_kv) == ("drain", "")  # the default


def test_completions_before_any_update_carry_version_0_and_match_transformers(served, reference):
    initial = served.initial_completions
    assert len(initial) == len(served.initial_prompts)
    assert {completion.policy_version for completion in initial} == {0}
    for completion in initial:
        prompt = served.initial_prompts[completion.prompt_index]
        assert completion.prompt_id == str(completion.prompt_index)
        assert completion.finish_reason == "length"
        assert list(completion.token_ids) == reference.greedy(served.initial_tensors, prompt, 12)


def test_sampled_logprobs_are_those_of_the_tempered_distribution(client, served, reference):
    prompts = [[5, 6, 7, 8], [40, 41]]
    temperature = 0.7
    completions = list(
        client.generate(prompts, max_tokens=10, n=3, temperature=temperature, ignore_eos=True)
    )
    assert sorted((c.prompt_index, c.sample_index) for c in completions) == [
        (p, s) for p in range(2) for s in range(3)
    ]
    for completion in completions:
        assert completion.policy_version == served.policy_version
        tokens = list(completion.token_ids)
        assert len(tokens) == len(completion.logprobs) == 10
        expected = reference.logprobs(
            served.tensors, prompts[completion.prompt_index], tokens, temperature
        )
        np.testing.assert_allclose(completion.logprobs, expected, atol=2e-3)


def test_stop_token_ends_a_completion(client, served):
    first = list(client.generate([[5, 6, 7, 8]], max_tokens=6, temperature=0.0))[0]
    stop = first.token_ids[2]
    stopped = list(
        client.generate([[5, 6, 7, 8]], max_tokens=6, temperature=0.0, stop_token_ids=[stop])
    )[0]
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == list(first.token_ids[: list(first.token_ids).index(stop) + 1])


def _request(prompts, **sampling) -> generator_pb2.GenerateRequest:
    defaults = dict(n=1, temperature=1.0, max_tokens=4)
    return generator_pb2.GenerateRequest(
        prompts=[generator_pb2.Prompt(id=f"p{i}", token_ids=p) for i, p in enumerate(prompts)],
        sampling=generator_pb2.SamplingParams(**{**defaults, **sampling}),
    )


INVALID = {
    "empty prompt": (_request([[1, 2], []]), "prompt 1 (id 'p1') is empty"),
    "over the model length": (
        _request([[1] * 250], max_tokens=10),
        "prompt 0 (id 'p0') has 250 tokens; with max_tokens 10 that is 260, over the model "
        "length 256",
    ),
    "token out of vocab": (
        _request([[1, 384]]),
        "prompt 0 (id 'p0') has token id 384, outside the vocabulary [0, 384)",
    ),
    "negative token": (_request([[-1]]), "has token id -1"),
    "n = 0": (_request([[1]], n=0), "sampling.n must be >= 1, got 0"),
    "max_tokens = 0": (_request([[1]], max_tokens=0), "sampling.max_tokens must be >= 1"),
    "no prompts": (_request([]), "the request has no prompts"),
    "top_p > 1": (_request([[1]], top_p=1.5), "sampling.top_p must be in (0, 1]"),
    "negative temperature": (_request([[1]], temperature=-1), "sampling.temperature must be >= 0"),
    "seed_per_request without a seed": (
        generator_pb2.GenerateRequest(
            prompts=_request([[1]]).prompts,
            sampling=_request([[1]]).sampling,
            seed_per_request=True,
        ),
        "seed_per_request is set but the request has no seed",
    ),
    "a prompt's max_tokens over the model length": (
        generator_pb2.GenerateRequest(
            prompts=[
                generator_pb2.Prompt(id="a", token_ids=[1] * 250, max_tokens=2),
                generator_pb2.Prompt(id="b", token_ids=[1] * 250, max_tokens=7),
            ],
            sampling=generator_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=4),
        ),
        "prompt 1 (id 'b') has 250 tokens; with max_tokens 7 that is 257, over the model",
    ),
    "a prompt's max_tokens below min_tokens": (
        generator_pb2.GenerateRequest(
            prompts=[generator_pb2.Prompt(id="a", token_ids=[1], max_tokens=2)],
            sampling=generator_pb2.SamplingParams(n=1, max_tokens=8, min_tokens=3),
        ),
        "prompt 0 (id 'a') has max_tokens 2, below min_tokens 3",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_request_is_refused_with_a_named_problem(client, case):
    request, message = INVALID[case]
    with pytest.raises(grpc.RpcError) as caught:
        list(client.stub.Generate(request))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()


def test_concurrent_calls_share_the_engine_and_stream_as_they_finish(client):
    """A short call started during a long one finishes first: one engine, continuous batching."""
    finished: dict[str, float] = {}
    long_started = threading.Event()

    def long_call() -> None:
        stream = client.generate([[5, 6, 7]] * 4, max_tokens=200, ignore_eos=True)
        long_started.set()
        list(stream)
        finished["long"] = time.monotonic()

    def short_call(name: str) -> None:
        list(client.generate([[9, 10]], max_tokens=3, n=2))
        finished[name] = time.monotonic()

    long_thread = threading.Thread(target=long_call)
    long_thread.start()
    long_started.wait()
    deadline = time.monotonic() + 30
    while client.status().num_requests_running < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    short_threads = [threading.Thread(target=short_call, args=(f"s{i}",)) for i in range(3)]
    for thread in short_threads:
        thread.start()
    for thread in [long_thread, *short_threads]:
        thread.join(timeout=120)
    assert set(finished) == {"long", "s0", "s1", "s2"}
    assert all(finished[f"s{i}"] < finished["long"] for i in range(3))


def test_health_and_reflection(generator_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(generator_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            response = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert SERVICE_NAME in services and "grpc.health.v1.Health" in services


def test_seeded_calls_are_reproducible_and_report_admission(client, served):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [20, 21]] * 3

    def sample(seed):
        stream = client.generate(prompts, max_tokens=10, n=2, temperature=1.0, seed=seed)
        metadata = dict(stream.initial_metadata())
        completions = list(stream)
        assert metadata["x-jaxrlhf-policy-version"] == str(served.policy_version)
        return sorted((c.prompt_index, c.sample_index, tuple(c.token_ids)) for c in completions)

    first, again, other = sample(123), sample(123), sample(124)
    assert first == again
    assert first != other


def test_per_request_seeds_are_refused_on_the_cpu_backend(client, served):
    """vLLM 0.32's CPU engine dies on a seeded request in a split prefill: the service refuses
    seed_per_request there, by name, and keeps serving."""
    with pytest.raises(grpc.RpcError) as caught:
        list(client.generate([[5, 6, 7]], max_tokens=4, seed=1, seed_per_request=True))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "seed_per_request is not available on vLLM's CPU backend" in caught.value.details()
    assert len(list(client.generate([[5, 6, 7]], max_tokens=4, seed=1))) == 1


def test_each_prompt_may_have_its_own_max_tokens(client, served):
    request = generator_pb2.GenerateRequest(
        prompts=[generator_pb2.Prompt(id="short", token_ids=[5, 6], max_tokens=3),
                 generator_pb2.Prompt(id="call's", token_ids=[7, 8]),
                 generator_pb2.Prompt(id="long", token_ids=[9], max_tokens=11)],
        sampling=generator_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True),
    )  # fmt: skip
    lengths = {(c.prompt_id, c.sample_index): len(c.token_ids)
               for c in client.stub.Generate(request)}  # fmt: skip
    assert lengths == {(p, k): m for p, m in (("short", 3), ("call's", 6), ("long", 11))
                       for k in range(2)}  # fmt: skip


def _most_at_once(completions) -> int:
    """The most of these samples in the engine at one moment, from the spans the server stamps
    on them (submitted to the engine .. finished); a span ending as another starts is not an
    overlap."""
    events = sorted([(c.submitted_unix_time, 1) for c in completions]
                    + [(c.finished_unix_time, -1) for c in completions])  # fmt: skip
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def test_max_running_limits_its_call_and_not_the_engine(client, served):
    """A call with max_running=2 never has more than 2 of its 6 samples in the engine, and
    returns them all, whole; a call without a limit, running beside it, has all 4 of its
    samples in the engine at once."""
    limited: list = []
    thread = threading.Thread(target=lambda: limited.extend(client.generate(
        [[5, 6, 7], [8, 9], [10, 11, 12]], max_tokens=24, n=2, temperature=1.0,
        ignore_eos=True, max_running=2, timeout=300)))  # fmt: skip
    thread.start()
    deadline = time.monotonic() + 60
    while client.status().num_requests_running < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    free = list(client.generate([[13, 14], [15], [16, 17], [18]], max_tokens=8, temperature=1.0,
                                ignore_eos=True, timeout=300))  # fmt: skip
    thread.join(timeout=300)
    assert sorted((c.prompt_index, c.sample_index) for c in limited) == [
        (p, k) for p in range(3) for k in range(2)
    ]
    assert all(len(c.token_ids) == 24 for c in limited)
    assert _most_at_once(limited) == 2
    assert len(free) == 4 and _most_at_once(free) == 4


def test_seeded_calls_with_max_running_are_reproducible(client, served):
    """A seeded call fed to the engine 3 samples at a time (4 groups, each admitted together)
    gives the same tokens for the same seed, other tokens for another."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [20, 21], [22], [23, 24]]

    def sample(seed):
        completions = list(client.generate(prompts, max_tokens=10, n=2, temperature=1.0,
                                           seed=seed, max_running=3))  # fmt: skip
        assert _most_at_once(completions) <= 3
        return sorted((c.prompt_index, c.sample_index, tuple(c.token_ids)) for c in completions)

    first, again, other = sample(7), sample(7), sample(8)
    assert len(first) == 12 and first == again
    assert first != other


def test_completions_that_finish_during_admission_wait_for_it(client, served):
    """Many 1-token requests in one call: the first finish while the last are still being
    submitted, before the call's initial metadata is sent; they are held until it is (two
    writes at once broke the call: GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, then the client's
    deadline; found by the wire fuzzer with n=113)."""
    for _ in range(5):
        stream = client.generate([[5, 6]], max_tokens=1, n=120, temperature=1.0, timeout=60)
        completions = list(stream)
        assert dict(stream.initial_metadata())["x-jaxrlhf-policy-version"] == str(
            served.policy_version
        )
        assert len(completions) == 120
