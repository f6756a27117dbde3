"""Code that runs inside vLLM's worker process (`worker_extension_cls`), reached by collective_rpc.

Loading a staged update: the staging file (weights.py) is mapped into memory and every tensor
handed to vLLM's in-place `reload_weights` is a view of its region (`weights_iterator`), so
nothing is read or copied before vLLM copies each tensor into its parameter, exactly as when
it reloads tensors already in memory. (Reloading from a folder instead would go through vLLM's
checkpoint reader, which copies every tensor, and would repoint the model config at the
staging folder.)

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

logger = logging.getLogger(__name__)

# Wire dtype -> torch dtype. The bytes are viewed through the wire table's numpy dtype of the
# same width (numpy has no bfloat16: int16) and reinterpreted by torch.
_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
assert set(_TORCH_DTYPES) == set(WIRE_DTYPES), "every wire dtype needs its torch dtype"


def map_staged_tensors(
    path: str, tensors: Sequence[Sequence]
) -> tuple[mmap.mmap, list[tuple[str, torch.Tensor]]]:
    """Maps the staging file at `path`; returns the map and a (name, tensor view) per entry of
    `tensors` ([name, wire dtype, shape, byte position], as the server sends them).

    The views go through numpy because numpy holds the map's buffer while a view lives, so the
    map cannot be closed under a tensor (torch.frombuffer does not). MAP_POPULATE maps every
    page in one call instead of faulting them in one by one.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = mmap.mmap(
            fd,
            0,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    finally:
        os.close(fd)
    views = []
    for name, wire_dtype, shape, position in tensors:
        view_dtype, torch_dtype = WIRE_DTYPES[wire_dtype].view, _TORCH_DTYPES[wire_dtype]
        array = np.frombuffer(mapped, view_dtype, math.prod(shape), position)
        views.append((name, torch.from_numpy(array).view(torch_dtype).view(tuple(shape))))
    return mapped, views


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

    _jaxrlhf_stage = None  # the staged update (staging.Stage), if any

    def jaxrlhf_reseed(self, seed: int) -> None:
        """Re-seeds the RNG the sampler draws from (requests carry no generator of their own)."""
        torch.manual_seed(seed)

    def jaxrlhf_reload_weights(self, path: str, tensors: list) -> int:
        """Reloads the staged tensors (see `map_staged_tensors`) in place; returns tied heads
        fixed."""
        mapped, views = map_staged_tensors(path, tensors)
        try:
            self.reload_weights(weights_iterator=views, is_checkpoint_format=True)
        finally:
            del views
            try:
                mapped.close()
            except BufferError:
                # Something still holds a view; the map goes when the last one is freed.
                logger.warning("a view of the weight staging file outlived the reload")
        return refresh_tied_heads(self.model_runner.get_model())

    def jaxrlhf_stage_weights(self, path: str, tensors: list, threads: int = 1) -> str:
        """Starts staging the update in `path` (see staging.py) in a thread and returns "";
        or returns why this model cannot be staged (it is then reloaded in the pause)."""
        from generator_service.staging import Stage

        if self._jaxrlhf_stage is not None:
            self.jaxrlhf_drop_staged()  # left by a swap that failed before dropping it
        config = self.vllm_config
        if config.model_config.quantization is not None or config.lora_config is not None:
            return "quantized and LoRA models are reloaded in the pause"
        if not torch.cuda.is_available() and not config.model_config.enforce_eager:
            return "compiled CPU models are reloaded in the pause"
        if not torch.cuda.is_available():
            keep_freed_memory(trim_bytes=2 * _model_bytes(self.model_runner.get_model()) + GIB)
        mapped, views = map_staged_tensors(path, tensors)

        def release() -> None:
            views.clear()
            try:
                mapped.close()
            except BufferError:
                logger.warning("a view of the weight staging file outlived the stage")

        self._jaxrlhf_stage = Stage(self.model_runner.get_model(), views, release, threads)
        return ""

    def jaxrlhf_stage_status(self) -> dict:
        """{"state": "running" | "done" | "failed" | "unsupported" | "none", "error", "seconds",
        and the seconds of its phases}."""
        stage = self._jaxrlhf_stage
        return {"state": "none", "error": "", "seconds": 0.0} if stage is None else stage.status()

    def jaxrlhf_commit_staged(self) -> float:
        """Puts the staged update live (the engine is paused); returns its seconds."""
        if self._jaxrlhf_stage is None:
            raise RuntimeError("no staged update to commit")
        return self._jaxrlhf_stage.commit()

    def jaxrlhf_drop_staged(self) -> None:
        """Stops and frees the staged update, if any (idempotent)."""
        stage, self._jaxrlhf_stage = self._jaxrlhf_stage, None
        if stage is not None:
            stage.drop()
