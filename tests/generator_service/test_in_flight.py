"""In-flight weight swaps against a real engine (`--swap-mode in-flight`), per KV-cache policy.

A long greedy generation runs while an update lands, held by a failpoint until every running
request has HOLD_TOKENS tokens (not timed: on 2 shared cores a sleep lands anywhere): its
tokens switch version exactly once, at HOLD_TOKENS or a few steps later, the tokens before the
switch are transformers' greedy tokens on the old weights and the tokens after it
transformers' greedy tokens on the new weights given the prefix (with the KV cache recomputed,
or kept as the engine keeps it: `Reference.greedy_after_swap`), each token's log-prob is that
of the weights that sampled it (in both modes), and UpdateWeights returns before the generation
ends. A refused update and a swap that fails half-way never let a running request
continue on anything but the old weights. A client built from the .proto alone sees the
per-token versions.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from jaxrlhf_wire.build import PROTO_PATH
from jaxrlhf_wire.chunks import encode_weight_chunks
from tests.generator_service.test_senders import split
from tests.generator_service.test_update_weights import perturbed
from tests.generator_service.wire import chunk_messages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# 40 tokens: more than one KV block (BLOCK_SIZE), so a request sharing it reuses a cached block.
LONG_PROMPT = list(range(5, 45))
# vLLM's default on CPU is 128 tokens, longer than any prompt here: nothing would be cached.
BLOCK_SIZE = 32
# Run beside it: slower steps, so that the update lands well inside the generation.
FILLERS = [[11, 12, 13], [100, 101], [7, 8, 9, 10], [50, 51, 52], [300, 301], [3, 2, 1, 0, 4]]
MAX_TOKENS = 200
# Where swaps land: every request has this many tokens when the engine pauses for it.
HOLD_TOKENS = 60
# Engine and reference log-probs, both float32, differ only by summation order (paged against
# eager attention, over up to 240 positions): far below this. A KV cache computed with the
# wrong weights moves them by more than 5x this (the swap test asserts it for its tokens), so
# the check tells the two KV policies apart.
LOGPROB_ATOL = 2e-3
# How long the preloading failpoint holds a preload (the engine generating meanwhile).
PRELOAD_HOLD_S = 1.5
# Requests the engine runs at once: LONG_PROMPT and FILLERS run together, more queue.
MAX_NUM_SEQS = 8


class Server:
    """A server of this module's own, and the weights it serves."""

    def __init__(self, process, client, tensors, failpoints: Path):
        self.process, self.client, self.failpoints = process, client, failpoints
        self.version, self.tensors = 0, tensors

    def push(self, tensors: dict[str, np.ndarray], update_id: str = ""):
        chunks = encode_weight_chunks(tensors, self.version + 1, 1 << 16, update_id=update_id)
        response = self.client.update_weights_encoded(chunks)
        self.version, self.tensors = response.policy_version, tensors
        return response


# (KV policy, preloaded swaps): each test runs once with swaps reloading in the pause and once
# with preloaded swaps (the drain-mode server of the suite preloads too).
@pytest.fixture(scope="module", params=[("recompute", False), ("keep", True)],
                ids=["recompute-no-preload", "keep-preload"])  # fmt: skip
def in_flight(request, tiny_llama, tmp_path_factory, start_generator_server):
    from safetensors.numpy import load_file

    from jaxrlhf.fleet.rpc import GeneratorClient

    kv, preload = request.param
    folder = tmp_path_factory.mktemp(f"in-flight-{kv}")
    failpoints = folder / "failpoints"
    process = start_generator_server(
        tiny_llama, folder / "server.log",
        ["--swap-mode", "in-flight", "--in-flight-kv", kv, "--max-num-seqs", str(MAX_NUM_SEQS),
         "--block-size", str(BLOCK_SIZE), "--preload" if preload else "--no-preload"],
        env={"JAXRLHF_FAILPOINTS": str(failpoints)},
    )  # fmt: skip
    client = GeneratorClient(process.address)
    server = Server(process, client, load_file(tiny_llama / "model.safetensors"), failpoints)
    server.kv, server.preload = kv, preload
    # The engine's first reload is slow (~2 s, set-up); later ones take milliseconds.
    server.push(perturbed(server.tensors, seed=10))
    yield server
    client.close()
    process.terminate()


def _assert_fired(server) -> None:
    """Every point armed in the server's failpoint file fired (the file is gone); if not, says
    which are still armed and whether the engine turned preloaded swaps off meanwhile (a preloaded
    update's point then never comes)."""
    try:
        left = server.failpoints.read_text()
    except FileNotFoundError:
        return
    off = server.client.status().preloaded_swaps_off
    pytest.fail(f"the failpoint never fired: still armed {left!r}; preloaded swaps off: {off!r}")


def _greedy(client, prompts, max_tokens=MAX_TOKENS) -> list:
    completions = client.generate(prompts, max_tokens=max_tokens, temperature=0.0,
                                  ignore_eos=True)  # fmt: skip
    return sorted(completions, key=lambda completion: completion.prompt_index)


def _hold_the_next_swap(server) -> None:
    """Arms the failpoint that holds the server's next swap until every running request has
    HOLD_TOKENS tokens."""
    with open(server.failpoints, "a") as armed:
        armed.write(f"pause_for_swap 1 tokens={HOLD_TOKENS}\n")


def _during_long_generation(server, action):
    """Runs `action()` once the long greedy call (LONG_PROMPT beside FILLERS) is generating;
    returns (completions or the RpcError that ended the call, action's result, whether the
    action returned before the call ended)."""
    results: dict[str, object] = {}

    def long_call() -> None:
        try:
            results["long"] = _greedy(server.client, [LONG_PROMPT, *FILLERS])
        except grpc.RpcError as error:
            results["long"] = error
        results["long_done"] = time.monotonic()

    thread = threading.Thread(target=long_call)
    thread.start()
    deadline = time.monotonic() + 30
    while server.client.status().num_requests_running < 1 + len(FILLERS):
        assert time.monotonic() < deadline, "the long call never ran"
        time.sleep(0.002)
    outcome = action()
    returned = time.monotonic()
    thread.join(timeout=300)
    return results["long"], outcome, returned < results["long_done"]


def test_status_reports_the_mode(in_flight):
    status = in_flight.client.status()
    assert (status.swap_mode, status.in_flight_kv) == ("in-flight", in_flight.kv)
    assert status.max_num_seqs == MAX_NUM_SEQS
    assert status.preloaded_swaps == in_flight.preload
    assert status.preloaded_swaps_off == ("" if in_flight.preload else "started with --no-preload")


# How long after its submission a sample may start counting as generating (handing the call's
# requests to the engine, on busy cores).
LAG_S = 0.05


def _over_one_call(client, samples: int, max_tokens: int = 128):
    """One call of `samples` samples of a prompt, between two GetStatus: (the change of
    request_seconds, of idle_seconds, the completions, the client's wall time from before the
    first status to after the second, the statuses)."""
    started = time.monotonic()
    before = client.status()
    completions = list(client.generate([FILLERS[0]], max_tokens=max_tokens, n=samples,
                                       ignore_eos=True))  # fmt: skip
    after = client.status()
    wall = time.monotonic() - started
    return (after.request_seconds - before.request_seconds,
            after.idle_seconds - before.idle_seconds, completions, wall,
            (before, after))  # fmt: skip


def test_request_seconds_count_the_requests_generating(in_flight):
    """GetStatus' request-seconds over one call, against measurements of their own.

    As many samples as the engine runs at once: the change is the sum of the time each sample
    spent in the engine, stamped by the server on its completion (submitted -> finished; the
    count starts just after the one and ends just before the other), and the engine idled at
    most the wall time minus the longest sample. Twice as many, half of them queued at first: at
    most MAX_NUM_SEQS x the wall time the client measured around the two statuses, though the
    samples' own times add up to more (a queued request does not generate, and is not
    counted)."""
    requests, idle, completions, wall, _ = _over_one_call(in_flight.client, MAX_NUM_SEQS)
    in_engine = [c.finished_unix_time - c.submitted_unix_time for c in completions]
    assert len(in_engine) == MAX_NUM_SEQS
    # (A sample's count starts up to a few ms after its stamp, while the call's requests are
    # handed over: LAG_S each.)
    assert sum(in_engine) - MAX_NUM_SEQS * LAG_S <= requests <= sum(in_engine) + 1e-3, (
        requests, in_engine)  # fmt: skip
    assert 0 <= idle <= wall - max(in_engine) + LAG_S, (idle, wall, in_engine)

    requests, _, completions, wall, (before, after) = _over_one_call(in_flight.client,
                                                                     2 * MAX_NUM_SEQS)  # fmt: skip
    in_engine = [c.finished_unix_time - c.submitted_unix_time for c in completions]
    assert sum(in_engine) > MAX_NUM_SEQS * wall, "no request queued: nothing was checked"
    assert requests <= MAX_NUM_SEQS * wall, (requests, wall, in_engine)

    # The span the totals cover, on the server's clock (uptime_seconds), lies within the
    # client's, and bounds them as the client's does: occupancy over an interval is the change
    # of request_seconds / (the change of uptime_seconds x max_num_seqs), at most 1, where the
    # client's own clock adds the difference of the two calls' latencies.
    span = after.uptime_seconds - before.uptime_seconds
    assert 0 < span <= wall and requests <= MAX_NUM_SEQS * span, (span, wall, requests)
    assert after.occupancy == pytest.approx(  # (read a moment later)
        after.request_seconds / (after.uptime_seconds * MAX_NUM_SEQS), rel=1e-3)  # fmt: skip


def test_max_running_is_refused_under_in_flight_swaps(in_flight):
    """A sample submitted late in its call could start after a swap (GenerateRequest.max_running):
    refused by name, and the server goes on serving."""
    with pytest.raises(grpc.RpcError) as caught:
        list(in_flight.client.generate([[5, 6]], max_tokens=2, n=2, max_running=1))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert 'max_running=1 needs "drain" swaps' in caught.value.details()
    assert len(_greedy(in_flight.client, [[5, 6]], max_tokens=2)) == 1


def test_a_swap_lands_in_a_running_generation(in_flight, reference):
    old, old_version = in_flight.tensors, in_flight.version
    new = perturbed(old, seed=11)
    _hold_the_next_swap(in_flight)
    completions, response, early = _during_long_generation(in_flight, lambda: in_flight.push(new))
    assert response.policy_version == old_version + 1
    assert early, "UpdateWeights must return before the running generation finishes"

    for completion, prompt in zip(completions, [LONG_PROMPT, *FILLERS], strict=True):
        tokens, versions = list(completion.token_ids), list(completion.token_policy_versions)
        assert len(tokens) == len(versions) == len(completion.logprobs) == MAX_TOKENS
        switch = versions.index(old_version + 1)  # ValueError: the swap missed this request
        assert HOLD_TOKENS <= switch < MAX_TOKENS
        assert versions == [old_version] * switch + [old_version + 1] * (MAX_TOKENS - switch)
        assert completion.policy_version == old_version  # of the first token
        before, after = tokens[:switch], tokens[switch:]
        assert before == reference.greedy(old, prompt, switch)
        assert after == reference.greedy_after_swap(old, new, prompt, before, len(after),
                                                    in_flight.kv)  # fmt: skip
        # Each token's log-prob is that of the weights that sampled it (and of the KV cache
        # the engine had: computed with the old weights up to the swap, when kept).
        np.testing.assert_allclose(
            completion.logprobs[:switch], reference.logprobs(old, prompt, before, 1.0),
            atol=LOGPROB_ATOL,
        )  # fmt: skip
        expected = reference.logprobs_after_swap(old, new, prompt, before, after, in_flight.kv)
        np.testing.assert_allclose(completion.logprobs[switch:], expected, atol=LOGPROB_ATOL)
        other_kv = {"keep": "recompute", "recompute": "keep"}[in_flight.kv]
        other = reference.logprobs_after_swap(old, new, prompt, before, after, other_kv)
        assert np.abs(other - expected).max() > 5 * LOGPROB_ATOL  # the check tells them apart

    # A new request never reuses prefix-cache entries computed with the old weights: the same
    # 40-token prompt now gives the new weights' greedy tokens exactly.
    (late,) = _greedy(in_flight.client, [LONG_PROMPT], max_tokens=16)
    assert list(late.token_policy_versions) == [old_version + 1] * 16
    assert list(late.token_ids) == reference.greedy(new, LONG_PROMPT, 16)


def test_a_request_queued_across_a_swap_is_tagged_by_the_cache_it_read(in_flight, reference):
    """Two more copies of LONG_PROMPT queue behind MAX_NUM_SEQS running requests, submitted
    under the old version (salted with it) and first scheduled after the swap. With the KV
    cache kept, they read the LONG_PROMPT blocks the first copy computed with the old weights:
    their first token is tagged old (the sample depends on it), the rest new. With it
    recomputed, the cache was reset at the swap: they are the new weights' greedy tokens,
    tagged new."""
    old, old_version = in_flight.tensors, in_flight.version
    new = perturbed(old, seed=16)
    queued = 2
    prompts = [LONG_PROMPT, *FILLERS, LONG_PROMPT] + [LONG_PROMPT] * queued
    assert len(prompts) == MAX_NUM_SEQS + queued
    _hold_the_next_swap(in_flight)
    results: dict[str, list] = {}
    thread = threading.Thread(
        target=lambda: results.update(done=_greedy(in_flight.client, prompts))
    )
    thread.start()
    deadline = time.monotonic() + 30
    while in_flight.client.status().num_requests_running < MAX_NUM_SEQS:
        assert time.monotonic() < deadline, "the call never ran"
        time.sleep(0.002)
    in_flight.push(new)
    thread.join(timeout=300)
    for completion in results["done"][-queued:]:
        versions = list(completion.token_policy_versions)
        if in_flight.kv == "keep":
            assert versions == [old_version] + [old_version + 1] * (MAX_TOKENS - 1)
        else:
            assert versions == [old_version + 1] * MAX_TOKENS
            assert list(completion.token_ids) == reference.greedy(new, LONG_PROMPT, MAX_TOKENS)


def test_a_refused_update_leaves_running_requests_on_the_old_weights(in_flight, reference):
    old, version = in_flight.tensors, in_flight.version
    chunks = list(chunk_messages(perturbed(old, seed=12), version + 1, 1 << 14))
    truncated = chunks[:-1]

    def refused():
        with pytest.raises(grpc.RpcError) as error:
            in_flight.client.stub.UpdateWeights(iter(truncated))
        return error.value.code()

    completions, code, _ = _during_long_generation(in_flight, refused)
    assert code == grpc.StatusCode.DATA_LOSS
    for completion, prompt in zip(completions, [LONG_PROMPT, *FILLERS], strict=True):
        assert list(completion.token_policy_versions) == [version] * MAX_TOKENS
        assert list(completion.token_ids) == reference.greedy(old, prompt, MAX_TOKENS)
    assert in_flight.client.status().policy_version == version


def test_a_swap_failing_half_way_aborts_running_requests(in_flight, reference):
    """The engine loaded part of an update, then failed: what it serves is unknown, so running
    requests end (UNAVAILABLE) instead of going on, and new calls are refused until a complete
    update succeeds."""
    in_flight.push(perturbed(in_flight.tensors, seed=22), update_id="before the failure")
    assert in_flight.client.status().update_id == "before the failure"
    version = in_flight.version
    _hold_the_next_swap(in_flight)
    with open(in_flight.failpoints, "a") as armed:
        armed.write("reload_weights 1 fail\n")

    def failing_push():
        with pytest.raises(grpc.RpcError) as error:
            in_flight.push(perturbed(in_flight.tensors, seed=13))
        return error.value

    ended, error, _ = _during_long_generation(in_flight, failing_push)
    _assert_fired(in_flight)
    assert error.code() == grpc.StatusCode.INTERNAL and "unknown state" in error.details()
    assert "failpoint" not in error.details() and "Error" not in error.details(), error.details()
    assert isinstance(ended, grpc.RpcError), "a running request went on after a failed swap"
    assert ended.code() == grpc.StatusCode.UNAVAILABLE
    status = in_flight.client.status()
    assert (status.serving, status.policy_version) == (False, version)
    assert status.update_id == ""  # the weights are unknown: no update put them in place
    with pytest.raises(grpc.RpcError) as refused:
        _greedy(in_flight.client, [LONG_PROMPT], max_tokens=4)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    new = perturbed(in_flight.tensors, seed=14)
    in_flight.push(new)
    assert in_flight.client.status().serving
    (completion,) = _greedy(in_flight.client, [FILLERS[0]], max_tokens=12)
    assert list(completion.token_ids) == reference.greedy(new, FILLERS[0], 12)


def test_an_update_cancelled_mid_swap_completes(in_flight, reference):
    """A client's deadline expiring while the engine is paused with the new weights loaded and
    not yet labelled (held there by a failpoint): the swap still completes, and what is served
    is what the version says; the scheduler runs again. (Drain mode swaps through the same
    `Engine.swap_weights`.)"""
    old_version = in_flight.version
    new = perturbed(in_flight.tensors, seed=15)
    with open(in_flight.failpoints, "a") as armed:
        armed.write("reload_weights 1 sleep=6\n")
    chunks = encode_weight_chunks(new, old_version + 1, 1 << 16, update_id="cancelled")
    with pytest.raises(grpc.RpcError) as error:
        in_flight.client.update_weights_encoded(chunks, timeout=2.5)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not in_flight.failpoints.exists(), "the deadline expired before the swap began"
    deadline = time.monotonic() + 30
    while (status := in_flight.client.status()).policy_version == old_version:
        # (Before the fix: the cancelled swap resumed the engine on the new weights under the
        # old version, serving, for good.)
        assert time.monotonic() < deadline, "the new weights serve under the old version"
        time.sleep(0.05)
    in_flight.version, in_flight.tensors = status.policy_version, new
    assert (status.serving, status.policy_version) == (True, old_version + 1)
    # Its call is gone, but the update is what serves: a retry refused as not newer can tell.
    assert status.update_id == "cancelled"
    (completion,) = _greedy(in_flight.client, [FILLERS[0]], max_tokens=12)
    assert list(completion.token_policy_versions) == [old_version + 1] * 12
    assert list(completion.token_ids) == reference.greedy(new, FILLERS[0], 12)


def test_a_two_sender_update_cancelled_mid_swap_is_answered_live_to_both(in_flight, reference):
    """Two senders; the call of the one whose stream ends last (it runs the swap) passes its
    deadline while the engine is paused with the new weights loaded (a failpoint holds it).
    The swap completes, and the other sender is told it is live: before, it was answered
    ABORTED "cancelled before the update was swapped in" for a version that was serving."""
    old_version = in_flight.version
    new = perturbed(in_flight.tensors, seed=16)
    parts = split(new, 2)
    with open(in_flight.failpoints, "a") as armed:
        armed.write("reload_weights 1 sleep=6\n")

    def stream(sender):
        yield from chunk_messages(parts[sender], old_version + 1, 1 << 16, len(new),
                                      num_senders=2, sender=sender,
                                      update_id="two senders")  # fmt: skip
        if sender == 1:
            time.sleep(0.5)  # ends last: its call swaps

    def call(sender, timeout):
        try:
            return in_flight.client.stub.UpdateWeights(stream(sender), timeout=timeout)
        except grpc.RpcError as error:
            return error

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, second = pool.submit(call, 0, 60), pool.submit(call, 1, 3.0)
        outcomes = [first.result(), second.result()]
    assert not in_flight.failpoints.exists(), "the deadline expired before the swap began"
    assert isinstance(outcomes[1], grpc.RpcError), outcomes[1]
    assert outcomes[1].code() == grpc.StatusCode.DEADLINE_EXCEEDED, outcomes[1].details()
    assert not isinstance(outcomes[0], grpc.RpcError), outcomes[0].details()
    assert outcomes[0].policy_version == old_version + 1
    status = in_flight.client.status()
    in_flight.version, in_flight.tensors = status.policy_version, new
    assert (status.serving, status.policy_version) == (True, old_version + 1)
    assert status.update_id == "two senders"
    (completion,) = _greedy(in_flight.client, [FILLERS[0]], max_tokens=12)
    assert list(completion.token_ids) == reference.greedy(new, FILLERS[0], 12)


def test_a_shared_update_cancelled_mid_swap_completes_under_its_id(in_flight, reference):
    """As above, through a shared file: the learner's deadline passes while the engine is
    paused with the new weights loaded; the swap completes, and the status names the update."""
    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile

    old_version = in_flight.version
    new = perturbed(in_flight.tensors, seed=23)
    specs = [(name, value.shape, value.dtype) for name, value in new.items()]
    folder = in_flight.client.status().shared_weights_dir
    with open(in_flight.failpoints, "a") as armed:
        armed.write("reload_weights 1 sleep=6\n")
    with SharedWeightsFile(folder, specs) as shared:
        shared.write(new.items())
        request = shared.request(old_version + 1)
        request.update_id = "shared, cancelled"
        with pytest.raises(grpc.RpcError) as error:
            in_flight.client.update_weights_shared(request, timeout=2.5)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not in_flight.failpoints.exists(), "the deadline expired before the swap began"
        deadline = time.monotonic() + 30
        while (status := in_flight.client.status()).policy_version == old_version:
            assert time.monotonic() < deadline, "the swap never completed"
            time.sleep(0.05)
    in_flight.version, in_flight.tensors = status.policy_version, new
    assert (status.serving, status.policy_version) == (True, old_version + 1)
    assert status.update_id == "shared, cancelled"
    (completion,) = _greedy(in_flight.client, [FILLERS[0]], max_tokens=12)
    assert list(completion.token_ids) == reference.greedy(new, FILLERS[0], 12)


def _preloaded_only(server) -> None:
    if not server.preload:
        pytest.skip("a test of preloaded swaps (this server reloads in the pause)")


def test_generation_goes_on_while_an_update_is_preloaded(in_flight, reference):
    """The worker's preloading thread is held for PRELOAD_HOLD_S (a slow preload): the engine keeps
    generating meanwhile, and pauses only for the commit."""
    _preloaded_only(in_flight)
    old, old_version = in_flight.tensors, in_flight.version
    new = perturbed(old, seed=17)
    with open(in_flight.failpoints, "a") as armed:
        armed.write(f"preload_weights 1 sleep={PRELOAD_HOLD_S}\n")
    completions, response, _ = _during_long_generation(in_flight, lambda: in_flight.push(new))
    _assert_fired(in_flight)
    assert response.preload_seconds >= PRELOAD_HOLD_S
    # A preload that blocked the engine would let no token through while it ran.
    assert response.preload_tokens >= 10, response
    assert response.pause_seconds < 0.25 * response.preload_seconds, response
    assert in_flight.client.status().preload_tokens == response.preload_tokens
    for completion, prompt in zip(completions, [LONG_PROMPT, *FILLERS], strict=True):
        versions, tokens = list(completion.token_policy_versions), list(completion.token_ids)
        switch = versions.index(old_version + 1) if old_version + 1 in versions else len(tokens)
        assert versions == [old_version] * switch + [old_version + 1] * (len(tokens) - switch)
        assert tokens[:switch] == reference.greedy(old, prompt, switch)
    assert any(old_version in c.token_policy_versions for c in completions)
    (late,) = _greedy(in_flight.client, [FILLERS[1]], max_tokens=12)
    assert list(late.token_ids) == reference.greedy(new, FILLERS[1], 12)


def test_a_preload_that_fails_leaves_the_old_weights_serving(in_flight, reference):
    """Preloading fails in the worker (after loading part of the update into its shadow): the
    update is refused, running requests go on untouched on the old weights, and the service
    stays SERVING; the next update works."""
    _preloaded_only(in_flight)
    in_flight.push(perturbed(in_flight.tensors, seed=24), update_id="serving")
    old, version = in_flight.tensors, in_flight.version
    with open(in_flight.failpoints, "a") as armed:
        armed.write("preload_weights 1 fail\n")

    def refused():
        with pytest.raises(grpc.RpcError) as error:
            in_flight.push(perturbed(old, seed=18))
        return error.value

    completions, error, _ = _during_long_generation(in_flight, refused)
    assert error.code() == grpc.StatusCode.INTERNAL, error
    assert "preloading" in error.details() and "unchanged" in error.details()
    # The worker's error (here the failpoint's FailpointError) is the server's log's, not the
    # client's.
    assert "failpoint" not in error.details() and "Error" not in error.details(), error.details()
    for completion, prompt in zip(completions, [LONG_PROMPT, *FILLERS], strict=True):
        assert list(completion.token_policy_versions) == [version] * MAX_TOKENS
        assert list(completion.token_ids) == reference.greedy(old, prompt, MAX_TOKENS)
    status = in_flight.client.status()
    assert (status.serving, status.policy_version) == (True, version)
    assert status.update_id == "serving"  # refused: the served weights' update is unchanged
    new = perturbed(old, seed=19)
    assert in_flight.push(new).policy_version == version + 1
    (completion,) = _greedy(in_flight.client, [FILLERS[0]], max_tokens=12)
    assert list(completion.token_ids) == reference.greedy(new, FILLERS[0], 12)


def test_an_update_cancelled_while_preloaded_changes_nothing(in_flight, reference):
    """A client's deadline expiring while the update is being preloaded: the preload is dropped,
    nothing was paused or swapped, and the next update works."""
    _preloaded_only(in_flight)
    old, version = in_flight.tensors, in_flight.version
    with open(in_flight.failpoints, "a") as armed:
        armed.write("preload_weights 1 sleep=4\n")
    with pytest.raises(grpc.RpcError) as error:
        in_flight.client.update_weights(perturbed(old, seed=20), version + 1,
                                        chunk_bytes=1 << 16, timeout=2.0)  # fmt: skip
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(4)  # the held preload ends (and is dropped)
    status = in_flight.client.status()
    assert (status.serving, status.policy_version, status.swap_pending) == (True, version, False)
    (completion,) = _greedy(in_flight.client, [FILLERS[0]], max_tokens=12)
    assert list(completion.token_ids) == reference.greedy(old, FILLERS[0], 12)
    new = perturbed(old, seed=21)
    assert in_flight.push(new).policy_version == version + 1
    (completion,) = _greedy(in_flight.client, [FILLERS[0]], max_tokens=12)
    assert list(completion.token_ids) == reference.greedy(new, FILLERS[0], 12)


CLIENT = """
import sys
sys.path.insert(0, sys.argv[1])
import grpc
import generator_pb2, generator_pb2_grpc

stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(sys.argv[2]))
request = generator_pb2.GenerateRequest(
    prompts=[generator_pb2.Prompt(id="p", token_ids=[5, 6, 7])],
    sampling=generator_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=9),
)
for completion in stub.Generate(request):
    print(len(completion.token_ids), len(completion.token_policy_versions),
          completion.policy_version, min(completion.token_policy_versions))
"""


def test_a_client_built_from_the_proto_alone_sees_token_versions(in_flight, tmp_path):
    # As a user of another codebase would: protoc on the .proto, nothing of this repository.
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_PATH.parent}",
         f"--python_out={stubs}", f"--grpc_python_out={stubs}", str(PROTO_PATH)],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", CLIENT, str(stubs), in_flight.process.address],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert len(rows) == 2
    for tokens, versions, first, oldest in rows:
        assert tokens == versions == "9"
        assert first == oldest == str(in_flight.version)
