"""Preloaded swaps, inside vLLM's worker: an update converted into the engine's own layout while
generation goes on, then committed in a short pause.

vLLM's in-place `reload_weights` cannot overlap generation: while it loads, the live modules'
parameters are replaced by meta tensors. Preloading instead loads into a *shadow* of the model
(shadow.py: clones of the modules that hold parameters, with fresh tensors laid out as vLLM
recorded at the first load):

- `Preload`: in a thread of the worker, layer by layer: the layer's shadow modules get storage,
  the model's own `load_weights` loads the layer's tensors into them (the names, the fusion into
  qkv_proj / gate_up_proj, the tie, the dtype cast: exactly the code of a first load), and each
  module whose tensors are all loaded goes through its `quant_method.
  process_weights_after_loading` at once (on the CPU backend this packs every linear weight
  into a oneDNN handler held by `cpu_linear` and frees the checkpoint-layout copy, whose memory
  the next layer then reuses; the tied head is packed from the *new* embedding). Processing
  runs with the OpenMP thread count of the worker's own thread (`Preload._engine_threads`), not
  the preload's `threads`: a oneDNN handler packs its weight in a layout chosen for the thread
  count it was made under, and the engine runs it under the worker's count. Made under another
  count, some shapes come out wrong (vLLM 0.32's CPU backend: a [192, 64] fp32 weight made
  under 1 thread and run under 2 gives outputs off by ~40, with every weight right; the bed
  model's qkv_proj, whose preloaded swaps served garbage while the engine ran 2 threads). The
  thread then compiles the commit: a `copy_` into each live tensor with data (same shape, dtype and
  device, or preloading fails), and the attributes processing replaced (only those in
  `SWAPPED_ATTRIBUTES`; any other makes preloading fail rather than commit something it does not
  understand).
- `Preload.commit`, with the engine paused: the copies in place (captured graphs keep pointing at
  the same storage) and the attribute swaps. The replaced attributes are kept until `drop`, so
  their memory is freed after the engine resumes, not during the pause.

Nothing of the live model is written before the commit, so a preload that fails (a bad tensor,
a layout that does not match, an unsupported model) leaves the serving weights untouched.

Memory: one more copy of the weights while a preload is held (on CPU: the packed form of every
linear weight, the embedding, and one layer at a time in the checkpoint layout), from the
worker's allocator, which keeps what the previous preload freed for the next one
(`memory.keep_freed_memory`), and freed by reference counting when it is dropped
(`shadow.release_shadows`). `--no-preload` (generator_service) keeps the one-copy reload.

Unsupported (preloading refuses; the engine then reloads in the pause as before): quantized
models, LoRA, a model not loaded by vLLM's recorded metadata, and torch.compile on CPU (the
swapped `cpu_linear` closures would be baked into compiled code).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from generator_service import failpoints
from generator_service.updates.shadow import (
    PreloadUnsupported,
    build_shadow,
    materialize,
    release_shadows,
)

logger = logging.getLogger(__name__)

# Module attributes that post-load processing may replace and the commit swaps in: the CPU
# backend's packed GEMM closure, and its unpacked conv weight.
SWAPPED_ATTRIBUTES = frozenset({"cpu_linear", "_cpu_unpacked_conv_weight"})
# Attributes of the shadow modules that preloading itself sets or that processing uses as a flag.
_OWN_ATTRIBUTES = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
     "_already_called_process_weights_after_loading"}
)  # fmt: skip


# A checkpoint tensor's layer: "model.layers.3" of "model.layers.3.mlp.up_proj.weight" (the
# shadow modules under that name are preloaded together); other tensors form one more group.
LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


# A preload waiting this long for the next tensor of its update fails (the server drops a preload
# whose update failed, so this only ends a preload nobody feeds nor drops).
FEED_TIMEOUT_S = 600.0


def preloading_cuda_device(device: torch.device | str) -> torch.device | None:
    """The CUDA device a preload's thread makes current: its worker's `device` (None for a worker
    not on CUDA: nothing to set). torch's current device belongs to a thread and a new thread's
    is GPU 0, so without it a tensor-parallel rank above 0 would make its stream, and run its
    kernels, on GPU 0. Call it in the worker's thread: "cuda" without an index means that
    thread's current device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _layer_of(name: str) -> str:
    """The `LAYER` of a checkpoint tensor's name ("" for the tensors outside the layers)."""
    match = LAYER.match(name)
    return match.group(1) if match else ""


def _in_group(module_name: str, prefix: str) -> bool:
    if prefix:
        return module_name == prefix or module_name.startswith(prefix + ".")
    return LAYER.match(module_name + ".") is None


class PreloadError(RuntimeError):
    """A preload failed; the live weights were not touched."""


def _own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: tensor
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]
        if tensor is not None
    }


class Preload:
    """One update being preloaded in a thread of the worker (see the module docstring).

    `expected` names every checkpoint tensor of the update. Their (name, tensor) views come by
    `feed`, all at once or a few at a time while the update is still arriving; each layer is
    loaded as soon as all of its tensors have come, in the order the layers complete. `release`
    (one per feed) is called once those views are no longer read. `state` is "running",
    "done", "failed" (with `error`), "unsupported" (the model cannot be preloaded: reload it in
    the pause) or, after `commit`, "committed"; `seconds` the thread's time; `threads` the CPU
    threads of its torch ops (0: torch's default); `device` the worker's (on CUDA, the thread
    preloads on it: `preloading_cuda_device`). Create it in the worker's thread."""

    def __init__(self, model: torch.nn.Module, expected: Sequence[str], threads: int = 0, *,
                 device: torch.device | str) -> None:  # fmt: skip
        self.model = model
        self._cuda_device = preloading_cuda_device(device)
        self.state = "running"
        self.error = ""
        self.seconds = 0.0
        self.phases: dict[str, float] = {}  # seconds of loading, of processing, of waiting
        self._expected: dict[str, set[str]] = {}
        for name in expected:
            self._expected.setdefault(_layer_of(name), set()).add(name)
        self._arrived: dict[str, list] = {}  # layer -> its (name, view) pairs fed so far
        self._seen: set[str] = set()
        self._complete: collections.deque[str] = collections.deque()  # layers ready to load
        self._releases: list[Callable[[], None]] = []
        self._fed = threading.Condition()
        self._feed_error = ""
        self._threads = threads
        # The worker's OpenMP thread count (this runs in its thread): processing runs with it
        # (module docstring).
        self._engine_threads = torch.get_num_threads()
        self._cancelled = False
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._swaps: list[tuple[torch.nn.Module, str, object]] = []
        self._retired: list[object] = []
        self._stream = None
        self._done = _preload_thread().submit(self._run)

    def feed(self, views: Sequence[tuple[str, torch.Tensor]], release: Callable[[], None]) -> None:
        """More tensors of the update: (checkpoint name, tensor) views, which `release` frees.
        A name that is not expected, or that came before, fails the preload."""
        with self._fed:
            self._releases.append(release)
            if self.state != "running" or self._cancelled:
                self._release_all_locked()
                return
            for name, view in views:
                layer = _layer_of(name)
                wanted = self._expected.get(layer, ())
                if name not in wanted or name in self._seen:
                    self._feed_error = (
                        f"tensor {name} was fed {'twice' if name in self._seen else 'unexpected'}"
                    )
                    break
                self._seen.add(name)
                arrived = self._arrived.setdefault(layer, [])
                arrived.append((name, view))
                if len(arrived) == len(wanted):
                    self._complete.append(layer)
            self._fed.notify_all()

    def status(self) -> dict:
        return {"state": self.state, "error": self.error, "seconds": self.seconds, **self.phases}

    def _run(self) -> None:
        started = time.monotonic()
        try:
            if self._threads > 0:
                # This thread's OpenMP team only (the ICV is per thread). vLLM's CPU worker
                # replaces torch.set_num_threads by a no-op to keep its own threads' binding.
                torch._C.set_num_threads(self._threads)
            if self._cuda_device is not None:
                torch.cuda.set_device(self._cuda_device)  # (this thread's, for its lifetime)
                self._stream = torch.cuda.Stream(self._cuda_device)
                with torch.no_grad(), torch.cuda.stream(self._stream):
                    self._preload()
                self._stream.synchronize()
            else:
                with torch.no_grad():
                    self._preload()
            state = "done"
        except PreloadUnsupported as error:
            self.error, state = str(error), "unsupported"
        except Exception as error:  # noqa: BLE001 - reported through status()
            logger.exception("preloading failed")
            self.error, state = f"{type(error).__name__}: {error}", "failed"
            self._copies, self._swaps = [], []
        self.seconds = time.monotonic() - started
        with self._fed:
            self.state = state  # last: a reader seeing "done" sees everything else
            self._arrived, self._complete = {}, collections.deque()
            self._release_all_locked()

    def _release_all_locked(self) -> None:
        releases, self._releases = self._releases, []
        for release in releases:
            release()

    def _next_layer(self) -> tuple[str, list]:
        """The next layer whose tensors have all been fed (waiting for it), and its views."""
        waited, last_feed = time.monotonic(), time.monotonic()
        seen = len(self._seen)
        with self._fed:
            while not self._complete:
                self._check_cancelled()
                if self._feed_error:
                    raise PreloadError(self._feed_error)
                if len(self._seen) != seen:
                    seen, last_feed = len(self._seen), time.monotonic()
                elif time.monotonic() - last_feed > FEED_TIMEOUT_S:
                    raise PreloadError(
                        f"no tensor of the update came for {FEED_TIMEOUT_S:g} s "
                        f"({len(self._seen)} came)"
                    )
                self._fed.wait(timeout=1.0)
            layer = self._complete.popleft()
            views = self._arrived.pop(layer)
        self.phases["wait"] = self.phases.get("wait", 0.0) + time.monotonic() - waited
        return layer, views

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise PreloadError("cancelled")

    def _preload(self) -> None:
        """Layer by layer (`LAYER`), as each layer's tensors have all come: give the layer's
        shadow modules storage, load its tensors with the model's own `load_weights`, and
        process each module once all of its tensors are loaded, which frees its
        checkpoint-layout copy before the next layer is loaded (so the next reuses that memory
        instead of faulting in fresh pages)."""
        started = time.monotonic()
        shadow, pairs, devices = build_shadow(self.model)
        try:
            self._load_and_plan(started, shadow, pairs, devices)
        finally:
            release_shadows(module for _, module in pairs)

    def _load_and_plan(self, started: float, shadow, pairs, devices) -> None:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        names = {id(module): name for name, module in shadow.named_modules()}
        made: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        loaded: set[int] = set()
        preloaded, pending = [], list(pairs)
        load_seconds = 0.0
        for index in range(len(self._expected)):
            self._check_cancelled()
            prefix, views = self._next_layer()
            members = [
                module for _, module in pending if _in_group(names[id(module)], prefix)
            ]  # fmt: skip
            materialize(members, devices, made)
            start = time.monotonic()
            loaded |= {id(shadow.get_parameter(n)) for n in shadow.load_weights(iter(views))}
            load_seconds += time.monotonic() - start
            views.clear()
            self.phases["layers"] = index + 1  # (groups loaded: a status shows the progress)
            if index == 0:
                self._hold()
            for live, module in list(pending):
                own = [t for t in module._parameters.values() if t is not None]
                if not own or not all(id(t) in loaded for t in own):
                    continue
                quant_method = getattr(module, "quant_method", None)
                if isinstance(quant_method, QuantizeMethodBase):
                    with _openmp_threads(self._engine_threads):
                        quant_method.process_weights_after_loading(module)
                preloaded.append((live, module))
                pending.remove((live, module))
        with self._fed:
            self._release_all_locked()
        for live, module in pending:
            own = {n: t for n, t in module._parameters.items() if t is not None}
            part = [n for n, t in own.items() if id(t) in loaded]
            if part:
                missing = sorted(set(own) - set(part))
                raise PreloadError(
                    f"the update loads only part of {type(live).__name__} (not {missing})"
                )
            # else nothing of it is in the update (attention scales): left as it is
        if not preloaded:
            raise PreloadError("the update loaded no module")
        self._check_cancelled()
        waited = self.phases.get("wait", 0.0)
        self.phases["load"] = load_seconds
        self.phases["process"] = time.monotonic() - started - load_seconds - waited
        self._plan(preloaded)

    def _hold(self) -> None:
        """The `preload_weights` failpoint, after the first layer is loaded (chaos tests only)."""
        hold = failpoints.hit("preload_weights")
        if hold is not None:
            kind, _, value = hold.partition("=")
            if kind != "sleep":
                raise PreloadError(f"the preload_weights failpoint cannot hold {hold!r}")
            time.sleep(float(value))

    def _plan(self, preloaded) -> None:
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for live, module in preloaded:
            new_tensors = _own_tensors(module)
            for name, tensor in _own_tensors(live).items():
                new = new_tensors.get(name)
                if new is None:
                    raise PreloadError(f"processing dropped {type(live).__name__}.{name}")
                if tensor.numel() == 0 and new.numel() == 0:
                    continue  # packed elsewhere (cpu_linear)
                preloaded_as = (tuple(new.shape), new.dtype, new.device)
                served_as = (tuple(tensor.shape), tensor.dtype, tensor.device)
                if preloaded_as != served_as:
                    raise PreloadError(
                        f"{type(live).__name__}.{name}: preloaded as {preloaded_as}, served as "
                        f"{served_as}"
                    )
                if new is not tensor:
                    copies.setdefault(id(tensor), (tensor, new))
            for key, value in module.__dict__.items():
                if key in _OWN_ATTRIBUTES or live.__dict__.get(key, _MISSING) is value:
                    continue
                if key not in SWAPPED_ATTRIBUTES:
                    raise PreloadError(
                        f"processing changed {type(live).__name__}.{key}, which a commit does "
                        "not know how to swap"
                    )
                self._swaps.append((live, key, value))
        self._copies = list(copies.values())

    def commit(self) -> float:
        """Puts the preloaded weights live (the engine must be paused); returns its seconds."""
        if self.state != "done":
            raise PreloadError(f"nothing to commit: the preload is {self.state} {self.error}")
        started = time.monotonic()
        with torch.no_grad():
            for tensor, new in self._copies:
                tensor.data.copy_(new)
            for live, key, value in self._swaps:
                self._retired.append(live.__dict__.get(key))
                live.__dict__[key] = value
        if self._cuda_device is not None:
            torch.cuda.current_stream(self._cuda_device).synchronize()
        self.state = "committed"
        self._copies, self._swaps = [], []
        return time.monotonic() - started

    def drop(self) -> None:
        """Frees the preloaded update and the retired attributes; a preload still running stops
        before its next layer (or while waiting for one) and frees itself (without waiting
        for it: this runs in an RPC that holds the engine's loop). A later preload queues behind
        it on the one preloading thread."""
        with self._fed:
            self._cancelled = True
            self._fed.notify_all()
        self._copies, self._swaps, self._retired = [], [], []


_MISSING = object()


@contextlib.contextmanager
def _openmp_threads(count: int):
    """This thread's torch ops run with `count` OpenMP threads meanwhile (the ICV is per thread;
    vLLM's CPU worker makes torch.set_num_threads a no-op, hence torch._C's)."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None


def _preload_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The worker's one preloading thread, kept for its lifetime: each preload allocates from the
    same glibc arena the last one freed (a new thread each time could take another arena, and fault
    in fresh pages again)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxrlhf-preload")
    return _EXECUTOR
