"""Transient faults of a publish do not end the run (issue 44, item 4), against the service's
real gRPC code (`RecordingReplica`) with its failpoints:

- the answer of an update is lost (the connection drops while the server swaps it in: the
  learner sees UNAVAILABLE) although the server applied it: the retry finds the replica serving
  this very update (GeneratorStatus.update_id) and counts it delivered, whether it looks before
  resending or its resent update is refused as not newer;
- a progressive shared update whose writes stall past the server's --senders-timeout is
  answered ABORTED: the replica is marked failed, not the run, and it rejoins with the weights.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from generator_service import failpoints
from jaxrlhf.fleet.pool import GeneratorPool
from tests.generator_service.replicas import RecordingReplica

pytestmark = pytest.mark.timeout(120)


def layout_of(model_dir) -> tuple[dict, list, dict[str, np.ndarray]]:
    """The served model's tensor specs, the learner's layout of them, and weights for them."""
    from generator_service.updates.tensors import expected_tensors

    specs = expected_tensors(model_dir)
    layout = [(t.name, tuple(t.shape), np.float32) for t in specs.values()]
    return specs, layout, {name: np.ones(shape, np.float32) for name, shape, _ in layout}


class CuttableProxy:
    """A TCP forwarder on 127.0.0.1 in front of `target`; `cut()` drops every connection open
    now (the clients see their calls end UNAVAILABLE), later ones pass."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self._lock:
            dropped, self._open = self._open, []
        for end in dropped:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()

    def close(self) -> None:
        self._listener.close()
        self.cut()


@pytest.mark.parametrize("hold_s", [0.2, 2.0])
def test_a_publish_whose_answer_was_lost_is_delivered_not_refused(hold_s, tiny_llama, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    """The swap is held `hold_s` by the failpoint; the connection drops meanwhile. Held 0.2 s,
    the swap is done before the retry (0.5 s of back-off): the pool sees it in the status and
    sends nothing more. Held 2 s, the retry reaches the server first and is refused as not
    newer once the swap lands: the status shows the same update, so it too is delivered. (A
    pool that judged the refusal alone ended the run here: "not newer" is a defect.)"""
    armed = tmp_path / "failpoints"
    armed.write_text(f"reload_weights 1 sleep={hold_s}\n")
    monkeypatch.setenv(failpoints.ENV, str(armed))
    specs, layout, weights = layout_of(tiny_llama)
    replica = RecordingReplica(specs)
    proxy = CuttableProxy(replica.address)
    pool = GeneratorPool([proxy.address], transport="stream", retries=1, probe_interval=0.1)
    try:
        pool.wait_until_serving(timeout=30)
        result: dict = {}

        def publish() -> None:
            try:
                result["stats"] = pool.publish_weights(lambda: iter(weights.items()),
                                                       len(layout), 1)  # fmt: skip
            except Exception as error:  # noqa: BLE001 - re-raised below
                result["error"] = error

        thread = threading.Thread(target=publish)
        thread.start()
        assert replica.engine.swapping.wait(30), "the swap never began"
        proxy.cut()
        thread.join(60)
        swaps = [version for version, _ in replica.engine.swaps]
    finally:
        pool.close()
        proxy.close()
        replica.stop()
    assert "error" not in result, result.get("error")
    stats = result["stats"]
    assert stats.swapped == (proxy.address,) and stats.failed == () and stats.attempts <= 2
    assert swaps == [1]  # applied once: the lost attempt
    assert pool.metrics()["failures"] == 0


def test_a_stalled_progressive_update_fails_the_replica_not_the_run(tiny_llama, tmp_path):
    """The learner's writes of a progressive shared update stall 1.5 s past the server's 0.5 s
    --senders-timeout: ABORTED. The publish returns (none took it, but the replica answers, so
    it can come back), the replica is failed, then rejoins with the next publish."""
    specs, layout, weights = layout_of(tiny_llama)
    replica = RecordingReplica(specs, senders_timeout=0.5)
    replica.engine.update_dir = str(tmp_path)
    logged: list[str] = []
    pool = GeneratorPool([replica.address], transport="shared", retries=0, probe_interval=0.1,
                         log=logged.append)  # fmt: skip

    def stalling():
        for index, item in enumerate(weights.items()):
            if index == 1:
                time.sleep(1.5)
            yield item

    try:
        pool.wait_until_serving(timeout=30)
        stats = pool.publish_weights(stalling, len(layout), 1, specs=layout)
        failed = pool.metrics()["failures"]
        deadline = time.monotonic() + 30
        while not pool.needs_weights():
            assert time.monotonic() < deadline, "the failed replica never answered again"
            time.sleep(0.05)
        again = pool.publish_weights(lambda: iter(weights.items()), len(layout), 2,
                                     specs=layout, rejoining_only=True)  # fmt: skip
    finally:
        pool.close()
        replica.stop()
    assert stats.swapped == () and stats.failed == (replica.address,) and failed == 1
    assert any("ABORTED" in message and "stalled" in message for message in logged), logged
    assert again.swapped == (replica.address,) and replica.engine.policy_version == 2
