"""The preloading thread's CUDA device (generator_service/updates/worker_preload.py), on a machine
without a GPU.

torch's current CUDA device belongs to a thread, and a new thread's is GPU 0: a preload of a
tensor-parallel rank above 0 made its stream and ran its kernels on GPU 0 unless its thread set
the worker's device first. Covered here: which device a worker's device makes current
(`preloading_cuda_device`, from the worker's own thread), and that the preloading thread makes it
current, and makes its stream there, before it preloads anything (torch.cuda replaced by a
recorder, as there is no GPU). Not covered: kernels really running on that GPU, which needs a
machine with two.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from generator_service.updates import worker_preload as preloading


def test_only_a_cuda_worker_has_a_device_to_make_current(monkeypatch):
    assert preloading.preloading_cuda_device(torch.device("cpu")) is None
    assert preloading.preloading_cuda_device("cuda:3") == torch.device("cuda", 3)
    # "cuda" alone is the worker thread's current device, resolved there (not in the preloading
    # thread, whose current device is GPU 0).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert preloading.preloading_cuda_device("cuda") == torch.device("cuda", 2)


class RecordedCuda:
    """torch.cuda's calls that a preload makes, each with the thread that made it."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, str, object]] = []
        recorder = self

        class Stream:
            def __init__(self, device=None) -> None:
                recorder.record("Stream", torch.device(device))

            def synchronize(self) -> None:
                recorder.record("synchronize", None)

        @contextlib.contextmanager
        def stream(chosen):
            recorder.record("stream", chosen)
            yield

        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.record("set_device", d))
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)

    def record(self, call: str, argument) -> None:
        self.calls.append((threading.current_thread().name, call, argument))


def _run_preload(device) -> preloading.Preload:
    """A preload of a model vLLM never loaded: its thread sets up, then finds it cannot preload."""
    preload = preloading.Preload(torch.nn.Linear(2, 2), ["weight"], device=device)
    deadline = time.monotonic() + 60
    while preload.state == "running":
        assert time.monotonic() < deadline, "the preload never ended"
        time.sleep(0.01)
    return preload


@pytest.mark.timeout(120)
def test_the_preloading_thread_makes_its_workers_device_current_before_preloading(monkeypatch):
    cuda = RecordedCuda(monkeypatch)
    preload = _run_preload(torch.device("cuda", 1))
    assert preload.state == "unsupported", preload.error  # it got as far as preloading
    thread, call, device = cuda.calls[0]
    assert thread.startswith("jaxrlhf-preload") and thread != threading.current_thread().name
    assert (call, device) == ("set_device", torch.device("cuda", 1))
    assert [c[1:] for c in cuda.calls[1:2]] == [("Stream", torch.device("cuda", 1))]
    assert all(c[0] == thread for c in cuda.calls)


@pytest.mark.timeout(120)
def test_a_cpu_workers_preload_leaves_cuda_alone(monkeypatch):
    cuda = RecordedCuda(monkeypatch)
    assert _run_preload(torch.device("cpu")).state == "unsupported"
    assert cuda.calls == []
