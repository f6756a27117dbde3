"""The RLHF stage builds its learner while its generator starts; when the build fails, the
error comes at once and the generator that was starting is stopped (issue 59), instead of
after the generator's start (up to 600 s)."""

from __future__ import annotations

import threading
import time

import pytest

from jaxrlhf.fleet.service import StartCancelled, start_server
from jaxrlhf.stages import rlhf
from tests.conftest import tiny_model


def test_a_cancelled_start_stops_the_server_process(tmp_path):
    cancel = threading.Event()
    cancel.set()  # the caller failed before the engine came up
    started = time.perf_counter()
    with pytest.raises(StartCancelled):
        start_server(tiny_model("llama"), tmp_path / "generator.log", cancel=cancel)
    assert time.perf_counter() - started < 30  # an engine start takes ~25 s more


def test_a_learner_that_fails_to_build_cancels_the_generator_start(tmp_path, monkeypatch):
    config = rlhf_config(tmp_path)
    starts = []

    def slow_start(model, log_path, args, cpus=None, cancel=None):
        starts.append(cancel)
        if cancel.wait(120):  # a start that would take two minutes
            raise StartCancelled("cancelled")
        raise AssertionError("the start ran to its end")

    def failing_build(config, model_path, reward):
        time.sleep(0.5)  # the start is under way
        raise ValueError("config.model.path: no such model")

    monkeypatch.setattr(rlhf, "start_server", slow_start)
    monkeypatch.setattr(rlhf, "build_learner", failing_build)
    started = time.perf_counter()
    with pytest.raises(ValueError, match="no such model"):
        with rlhf.learner_while_generators_start(config, tmp_path, lambda line: None, None):
            pass
    assert time.perf_counter() - started < 10
    assert len(starts) == 1 and starts[0].is_set()


def rlhf_config(tmp_path):
    from configs.default import get_config

    config = get_config()
    config.output_dir = str(tmp_path)
    config.generator.addresses = ""  # the stage starts its own generator
    return config
