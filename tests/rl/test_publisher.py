"""The publisher in the background: version v is sent from a copy of v's parameters while the
learner goes on, at most one publish at a time, its error raised where the learner next needs
it done, and the step's times split into the publish's and the learner's wait."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrlhf.fleet.transport import PublishStats
from jaxrlhf.rl import publisher as publisher_module
from jaxrlhf.rl.publisher import Publisher


class Producer:
    def __init__(self):
        self.versions = []

    def wait_admitted(self):
        pass

    def weights_served(self, version):
        self.versions.append(version)


def test_a_publish_runs_beside_the_next_step_from_a_copy_of_its_weights(monkeypatch):
    release = {1: threading.Event(), 2: threading.Event()}
    sent = {}

    def publish(learner, pool, version, dtype, rollback=False, rejoining_only=False,
                params=None):  # fmt: skip
        assert release[version].wait(10), "never released"
        # Read only now, after the learner's next step replaced (and deleted) its parameters.
        sent[version] = (threading.current_thread().name, np.asarray(params["w"]))
        if version == 2:
            raise RuntimeError("no replica took version 2")

    monkeypatch.setattr(publisher_module, "publish", publish)
    learner = SimpleNamespace(state=SimpleNamespace(params={"policy": {"w": jnp.ones(3)}}))
    producer, cfg = Producer(), SimpleNamespace(sync_every=1, total_steps=10)
    publisher = Publisher(learner, None, "bfloat16", 0, 0, 0, background=True)

    publisher.after_update(cfg, producer)  # version 1: started, not waited for
    assert publisher.version == 1 and publisher.served == 0 and producer.versions == []
    # The learner's next update donates its parameters (deleted here) and makes new ones.
    learner.state.params["policy"]["w"].delete()
    learner.state.params = {"policy": {"w": jnp.full(3, 7.0)}}
    first = publisher.take_times()
    assert first["weight_sync_s"] == 0.0 and first["publish_blocked_s"] < 5.0

    threading.Timer(0.3, release[1].set).start()
    started = time.perf_counter()
    publisher.after_update(cfg, producer)  # version 2 waits for 1 to finish, then starts
    assert time.perf_counter() - started >= 0.25
    assert publisher.served == 1 and producer.versions == [1]
    second = publisher.take_times()
    assert second["publish_blocked_s"] >= 0.25 and second["weight_sync_s"] >= 0.25
    thread, weights = sent[1]
    assert thread.startswith("publish") and weights.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(weights, np.ones(3, ml_dtypes.bfloat16))  # v1's, not v2's

    release[2].set()
    with pytest.raises(RuntimeError, match="version 2"):
        publisher.finish()  # where the learner next needs it done
    assert publisher.served == 1 and producer.versions == [1]
    np.testing.assert_array_equal(sent[2][1], np.full(3, 7.0, ml_dtypes.bfloat16))
    publisher.close()


def test_without_the_background_a_publish_is_in_the_step(monkeypatch):
    threads = []

    def publish(learner, pool, version, dtype, rollback=False, rejoining_only=False,
                params=None):  # fmt: skip
        threads.append((threading.current_thread(), params))
        time.sleep(0.05)
        return PublishStats(version, 1, 12, seconds=0.125, attempts=1, pause_seconds=0.0625)

    monkeypatch.setattr(publisher_module, "publish", publish)
    learner = SimpleNamespace(state=SimpleNamespace(params={"policy": {"w": jnp.ones(3)}}))
    producer, cfg = Producer(), SimpleNamespace(sync_every=2, total_steps=10)
    publisher = Publisher(learner, None, None, 0, 0, 0)
    publisher.after_update(cfg, producer)  # not due (sync_every 2)
    assert publisher.take_times() == {"weight_sync_s": 0.0, "publish_blocked_s": 0.0,
                                      "generator_pause_s": 0.0, "weight_sync_bytes": 0}  # fmt: skip
    publisher.after_update(cfg, producer)
    assert threads == [(threading.main_thread(), None)]  # the learner's own parameters
    assert publisher.served == 2 and producer.versions == [2]
    times = publisher.take_times()
    # The publish's own figures (its PublishStats), and the learner blocked for its call.
    assert (times["weight_sync_s"], times["generator_pause_s"]) == (0.125, 0.0625)
    assert times["weight_sync_bytes"] == 12
    assert times["publish_blocked_s"] >= 0.05
