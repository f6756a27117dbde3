"""Code that runs inside vLLM's worker process (`worker_extension_cls`), reached by collective_rpc.

Loading a preloaded update: the update file (updates/bytes_file.py) is mapped into memory and
every tensor handed to vLLM's in-place `reload_weights` is a view of its region
(`weights_iterator`), so nothing is read or copied before vLLM copies each tensor into its
parameter, exactly as when it reloads tensors already in memory. (Reloading from a folder instead
would go through vLLM's checkpoint reader, which copies every tensor, and would repoint the model
config at the update folder.)

Tied heads: on the CPU backend every linear layer packs its weight into a kernel-specific copy
after loading. vLLM 0.32's in-place `reload_weights` repacks the layers it reloads, but a
*tied* `lm_head` has no checkpoint tensor of its own, so it is not reloaded and keeps the packed
copy of the *old* embedding: logits come from stale weights while the input embedding is new.
After the reload we repack every head whose weight is shared with another module.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Sequence

import numpy as np
import torch

from generator_service.memory import keep_freed_memory
from jaxrlhf_wire.dtypes import WIRE_DTYPES
from jaxrlhf_wire.files import aligned

logger = logging.getLogger(__name__)

# Wire dtype -> torch dtype. The bytes are viewed through the wire table's numpy dtype of the
# same width (numpy has no bfloat16: int16) and reinterpreted by torch.
_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
assert set(_TORCH_DTYPES) == set(WIRE_DTYPES), "every wire dtype needs its torch dtype"


def map_preloaded_tensors(
    path: str, tensors: Sequence[Sequence]
) -> tuple[list[mmap.mmap], list[tuple[str, torch.Tensor]]]:
    """Maps the regions of the update file at `path` that hold `tensors` ([name, wire dtype,
    shape, byte position], as the server sends them, each at a page-aligned position); returns
    the maps and a (name, tensor view) per entry.

    Tensors that lie one after the other (each at the first aligned position after the last)
    share one map: a whole update is one map; a part of an update fed to a preload while the rest
    is still arriving maps only its own regions. The views go through numpy because numpy holds
    the map's buffer while a view lives, so a map cannot be closed under a tensor
    (torch.frombuffer does not). MAP_POPULATE maps every page in one call instead of faulting
    them in one by one.
    """
    entries = sorted(
        (position, name, wire_dtype, tuple(shape))
        for name, wire_dtype, shape, position in tensors
    )  # fmt: skip
    runs: list[list] = []  # [start, end, entries]
    for entry in entries:
        position, _, wire_dtype, shape = entry
        end = position + math.prod(shape) * WIRE_DTYPES[wire_dtype].itemsize
        if runs and position <= aligned(runs[-1][1]):
            runs[-1][1] = max(runs[-1][1], end)
            runs[-1][2].append(entry)
        else:
            runs.append([position, end, [entry]])
    maps, by_name = [], {}
    fd = os.open(path, os.O_RDWR)
    try:
        for start, end, members in runs:
            base = start - start % mmap.ALLOCATIONGRANULARITY
            mapped = None
            if end > base:
                mapped = mmap.mmap(
                    fd,
                    end - base,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    offset=base,
                )
                maps.append(mapped)
            for position, name, wire_dtype, shape in members:
                view_dtype = WIRE_DTYPES[wire_dtype].view
                count = math.prod(shape)
                array = (
                    np.frombuffer(mapped, view_dtype, count, position - base)
                    if count
                    else np.empty(0, view_dtype)
                )
                tensor = torch.from_numpy(array).view(_TORCH_DTYPES[wire_dtype]).view(shape)
                by_name[name] = tensor
    finally:
        os.close(fd)
    return maps, [(name, by_name[name]) for name, *_ in tensors]


def _closer(maps: list[mmap.mmap], views: list, what: str):
    """A function that drops `views` and closes `maps` (once no view of them is left)."""

    def close() -> None:
        views.clear()
        for mapped in maps:
            try:
                mapped.close()
            except BufferError:
                # Something still holds a view; the map goes when the last one is freed.
                logger.warning("a view of the weight update file outlived the %s", what)

    return close


GIB = 1 << 30


def _model_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters as loaded (before CPU packing dropped some)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    total = 0
    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            total += sum(t.numel() * t.element_size() for t in info.restore_metadata[0].values())
    return total


def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Re-runs the post-load processing of each lm_head tied to another module; returns how many."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    other_parameters = {
        id(parameter)
        for module in model.modules()
        if not isinstance(module, ParallelLMHead)
        for parameter in module.parameters(recurse=False)
    }
    refreshed = 0
    for module in model.modules():
        if (
            isinstance(module, ParallelLMHead)
            and isinstance(module.quant_method, UnquantizedEmbeddingMethod)
            and id(module.weight) in other_parameters
        ):
            module.quant_method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


class WeightReloadExtension:
    """Mixed into the vLLM worker class; `self` is the worker."""

    _jaxrlhf_preload = None  # the preloaded update (preloading.Preload), if any
    _jaxrlhf_preload_id = 0  # the engine's number for it

    def jaxrlhf_reseed(self, seed: int) -> None:
        """Re-seeds the RNG the sampler draws from (requests carry no generator of their own)."""
        torch.manual_seed(seed)

    def jaxrlhf_reload_weights(self, path: str, tensors: list) -> int:
        """Reloads the preloaded tensors (see `map_preloaded_tensors`) in place; returns tied heads
        fixed."""
        maps, views = map_preloaded_tensors(path, tensors)
        try:
            self.reload_weights(weights_iterator=views, is_checkpoint_format=True)
        finally:
            _closer(maps, views, "reload")()
        return refresh_tied_heads(self.model_runner.get_model())

    def jaxrlhf_begin_preload(self, expected: list, threads: int = 1, preload_id: int = 0) -> str:
        """Starts preloading an update of the tensors named `expected`, which `jaxrlhf_feed_preload`
        hands in as they arrive; returns "" or why this model cannot be preloaded."""
        from generator_service.updates.worker_preload import Preload

        if self._jaxrlhf_preload is not None:
            self.jaxrlhf_drop_preloaded()  # left by a swap that failed before dropping it
        config = self.vllm_config
        if config.model_config.quantization is not None or config.lora_config is not None:
            return "quantized and LoRA models are reloaded in the pause"
        if not torch.cuda.is_available() and not config.model_config.enforce_eager:
            return "compiled CPU models are reloaded in the pause"
        if not torch.cuda.is_available():
            keep_freed_memory(trim_bytes=2 * _model_bytes(self.model_runner.get_model()) + GIB)
        self._jaxrlhf_preload = Preload(self.model_runner.get_model(), expected, threads,
                                    device=self.device)  # fmt: skip
        self._jaxrlhf_preload_id = preload_id
        return ""

    def jaxrlhf_feed_preload(self, path: str, tensors: list, preload_id: int = 0) -> bool:
        """Hands the preload begun as `preload_id` the `tensors` (see `map_preloaded_tensors`),
        whose bytes are now all in `path`; False (and nothing mapped) if that preload is gone."""
        preload = self._jaxrlhf_preload
        if preload is None or self._jaxrlhf_preload_id != preload_id:
            return False
        maps, views = map_preloaded_tensors(path, tensors)
        preload.feed(views, _closer(maps, views, "preload"))
        return True

    def jaxrlhf_preload_status(self, preload_id: int = 0) -> dict:
        """{"state": "running" | "done" | "failed" | "unsupported" | "none", "error", "seconds",
        and the seconds of its phases} of the preload begun as `preload_id` (0: of any); "none"
        when the worker has no preload, or another one."""
        preload = self._jaxrlhf_preload
        if preload is not None and preload_id and preload_id != self._jaxrlhf_preload_id:
            error = f"the worker preloads update {self._jaxrlhf_preload_id}, not {preload_id}"
            return {"state": "none", "error": error, "seconds": 0.0}
        return (
            {"state": "none", "error": "", "seconds": 0.0} if preload is None else preload.status()
        )

    def jaxrlhf_commit_preloaded(self, preload_id: int = 0) -> float:
        """Puts the preload begun as `preload_id` (0: any) live (the engine is paused); returns its
        seconds. Raises, changing nothing, when the worker has no preload or another one."""
        if self._jaxrlhf_preload is None:
            raise RuntimeError("no preloaded update to commit")
        if preload_id and preload_id != self._jaxrlhf_preload_id:
            raise RuntimeError(
                f"asked to commit preload {preload_id}, but the worker has "
                f"{self._jaxrlhf_preload_id}"
            )
        return self._jaxrlhf_preload.commit()

    def jaxrlhf_drop_preloaded(self) -> None:
        """Stops and frees the preloaded update, if any (idempotent)."""
        preload, self._jaxrlhf_preload = self._jaxrlhf_preload, None
        if preload is not None:
            preload.drop()
