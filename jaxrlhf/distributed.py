"""The learner over several processes: who drives, how host data is shared, how arrays move.

With `config.distributed.enabled` the learner runs as N `jax.distributed` processes with one
mesh over all their devices. The design:

- Process 0 is the driver: it alone talks to the generators (the rollout producer, weight
  publishing's attempts, evaluation's Generate calls; in a publish every process sends its
  own slices, as the driver announces) and writes files (metrics, summary, plots,
  the HF export). The other processes follow: whatever host data the driver gets (a rollout
  batch, the serving version, evaluation responses) it broadcasts (`broadcast`), so that every
  process then computes the same host-side inputs (scores, pairs, advantages).
- Every process places its own part of each batch (`shard_global`: each process holds the whole
  host batch, small next to the model, and supplies its devices' shards), runs the same jitted
  programs (collectives need every process), and reads results back whole (`to_host`).
- Orbax checkpoints are saved and restored by every process (each writes its shards).

In one process all of this reduces to plain single-host code.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlhf.sharding import batch_sharding


def process_index() -> int:
    return jax.process_index()


def return_freed_host_memory(threshold: int = 1 << 20) -> None:
    """Host buffers of `threshold` bytes or more are mapped on their own and unmapped when
    freed (glibc's mmap threshold, fixed), so a process's host memory is what it holds now.

    By default glibc raises its threshold after each large free, and later buffers of that
    size stay in the heap after they are freed: weight publishing, which makes one chunk (or,
    gathered, one tensor) after another, would then keep the heap of several of them mapped
    (bench/publish_memory.py, gathered: 2 layers instead of 1 at the follower). A no-op where
    there is no glibc.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # glibc's mallopt parameter number
    libc.mallopt(m_mmap_threshold, int(threshold))


def is_driver() -> bool:
    """Whether this process talks to the generators and writes the run's files."""
    return jax.process_index() == 0


def broadcast(value: Any) -> Any:
    """The driver's `value` (any picklable object) on every process; itself in one process."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(value), np.uint8) if is_driver() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size)))
    buffer = np.zeros(size, np.uint8)
    if is_driver():
        buffer[:] = payload
    data = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return pickle.loads(data.tobytes())


def all_succeeded(ok: bool) -> bool:
    """Whether `ok` holds on every process (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok, np.bool_))))


def shard_global(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Places a host batch that every process holds whole: rows split over (data, fsdp), each
    process supplying only its own devices' shards."""
    out = {}
    for name, value in batch.items():
        value = np.asarray(value)
        sharding = batch_sharding(mesh, value.ndim, value.shape[0])
        out[name] = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
    return out


def to_host(array: jax.Array) -> np.ndarray:
    """A (possibly multi-process) array whole on this host (a host array as it is).

    An array no process can address whole is gathered so that each process holds it once,
    split over its local devices along the first axis (not once per device, as a replicated
    gather would: with fake CPU devices those copies are host memory), then copied into one
    host array."""
    if isinstance(array, np.ndarray):
        return array
    if array.is_fully_addressable:
        return np.asarray(array)
    if array.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    gather = _gather_per_process(frozenset(array.sharding.device_set), array.shape[:1])
    gathered = gather(array)
    host = np.empty(array.shape, array.dtype)
    copied = set()
    for shard in gathered.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        if key not in copied:
            copied.add(key)
            host[shard.index] = np.asarray(shard.data)
    return host


@functools.cache
def _gather_per_process(devices: frozenset, leading: tuple[int, ...]) -> Callable:
    """A jitted identity whose result each process holds whole: split over its local devices
    along the first axis when they divide it, else replicated over them."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    processes = len({d.process_index for d in ordered})
    grid = np.array(ordered).reshape(processes, len(ordered) // processes)
    mesh = Mesh(grid, ("process", "local"))
    split = bool(leading) and leading[0] % grid.shape[1] == 0
    sharding = NamedSharding(mesh, PartitionSpec("local") if split else PartitionSpec())
    return jax.jit(lambda x: x, out_shardings=sharding)


_AGAIN, _DONE, _FAILED, _PLAN = 1, 0, 2, 3


class _Stream:
    """An iterator over one of `driven_streams`' streams that can be run to its end later."""

    def __init__(self, stream: Iterator[Any]):
        self._stream = stream

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        return next(self._stream)

    def drain(self) -> None:
        for _ in self._stream:
            pass


def driven_streams(make_stream: Callable[[], Iterator[Any]], consume: Callable[[Callable], Any]):
    """`consume(stream_factory)` on the driver, where each call of `stream_factory()` (a retry
    may call it again) gives `make_stream()`, while every other process produces the same
    streams in step: the streams gather sharded arrays (collectives), so every process must
    iterate each of them to its end. Returns `consume`'s result on the driver, None elsewhere.

    Before each stream the driver broadcasts "again", at the end "done" (or "failed": the other
    processes then raise too); a stream the driver's consumer left unfinished is run to its end
    first. In one process: `consume(make_stream)`.
    """
    if jax.process_count() == 1:
        return consume(make_stream)
    if not is_driver():
        while True:
            signal = int(broadcast(None))
            if signal == _DONE:
                return None
            if signal == _FAILED:
                raise RuntimeError("the driver (process 0) failed to publish the weights")
            _Stream(make_stream()).drain()
    current: list[_Stream] = []

    def factory() -> _Stream:
        if current:
            current.pop().drain()
        broadcast(_AGAIN)
        current.append(_Stream(make_stream()))
        return current[-1]

    try:
        result = consume(factory)
    except BaseException:
        if current:
            current.pop().drain()
        broadcast(_FAILED)
        raise
    if current:
        current.pop().drain()
    broadcast(_DONE)
    return result


def driven_plans(consume: Callable[[Callable[[Any], None]], Any], follow: Callable[[Any], None]):
    """`consume(announce)` on the driver, where each `announce(plan)` (any picklable value)
    hands `plan` to every other process, which runs `follow(plan)` at once, beside the driver's
    own work; the processes need not act in step otherwise (weight publishing with no gather:
    each attempt's plan, then every process sends its own part). Returns `consume`'s result on
    the driver, None elsewhere. At the end the driver broadcasts "done" (or "failed": the other
    processes then raise too). In one process: `consume` with an `announce` that does nothing.
    """
    if jax.process_count() == 1:
        return consume(lambda plan: None)
    if not is_driver():
        while True:
            signal = broadcast(None)
            if signal == _DONE:
                return None
            if signal == _FAILED:
                raise RuntimeError("the driver (process 0) failed to publish the weights")
            follow(signal[1])
    try:
        result = consume(lambda plan: broadcast((_PLAN, plan)))
    except BaseException:
        broadcast(_FAILED)
        raise
    broadcast(_DONE)
    return result
