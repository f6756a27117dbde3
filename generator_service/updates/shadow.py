"""The shadow of a model that a preload loads an update into (worker_preload.py), inside
vLLM's worker.

vLLM's in-place `reload_weights` cannot overlap generation: while it loads, the live modules'
parameters are replaced by meta tensors. A preload instead loads into a *shadow* of the model
(`build_shadow`):

- a clone of every module whose subtree holds parameters (shallow: the same class,
  configuration and `quant_method` objects), with new tensors laid out as the
  checkpoint-layout metadata vLLM recorded at the first load (`LAYERWISE_INFO`), on the meta
  device until their layer is preloaded (`materialize`);
- the tensors keep their class and attributes (the weight loaders, rebound to the shadow
  module), and a tensor shared by two live modules (the tied `lm_head` and the embedding) is
  one shadow tensor (and gets one storage);
- modules without parameters (attention, rotary embedding, logits processor) are not cloned:
  the shadow reads them, never writes them;
- a module vLLM recorded nothing for, or a parameter with no recorded layout (other than a
  bias vLLM builds after its metadata), cannot be preloaded (`PreloadUnsupported`).

Nothing of the live model is written here. A preload's shadow modules are emptied as soon as its
commit is planned (`release_shadows`), so that the preload is freed by reference counting when it
is dropped, not by Python's rare full collection.
"""

from __future__ import annotations

import types
import weakref

import torch


class PreloadUnsupported(RuntimeError):
    """This engine's model cannot be preloaded (the reason says why); reload it in the pause."""


def build_shadow(model: torch.nn.Module) -> tuple[torch.nn.Module, list, dict]:
    """The shadow of `model` (see the module docstring), its (live, shadow) module pairs, and
    the device of each of its tensors (by id). The tensors are on the meta device until
    `materialize` gives them storage."""
    builder = _ShadowBuilder()
    try:
        root = builder.clone(model)
    except BaseException:
        release_shadows(builder.shadows.values())
        raise
    return root, builder.pairs, builder.devices


class _ShadowBuilder:
    """The shadows made so far of one model's modules and tensors (`build_shadow`)."""

    def __init__(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
        from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

        self._recorded = LAYERWISE_INFO
        self._skipped = SKIP_TENSORS  # built by vLLM after its metadata (`bias`)
        self._sentinel = layer_ref_sentinel
        self.shadows: dict[int, torch.nn.Module] = {}  # id(live module) -> its shadow
        self.tensors: dict[int, torch.Tensor] = {}  # id(live tensor) -> its shadow (ties stay ties)
        self.devices: dict[int, torch.device] = {}  # id(shadow tensor) -> its device
        self.pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []

    def clone(self, live_module: torch.nn.Module) -> torch.nn.Module:
        """The shadow of `live_module` and of its subtree (the module itself when its subtree
        holds no parameters)."""
        if id(live_module) in self.shadows:
            return self.shadows[id(live_module)]
        if not _subtree_has_parameters(live_module):
            return live_module  # read only (configuration), never written
        info = self._recorded.get(live_module)
        if info is None:
            raise PreloadUnsupported(
                f"vLLM recorded no reload metadata for {type(live_module).__name__}"
            )
        shadow = _empty_clone(live_module)
        self.shadows[id(live_module)] = shadow
        self._add_tensors(live_module, shadow, info)
        for name, child in live_module._modules.items():
            shadow._modules[name] = None if child is None else self.clone(child)
        self.pairs.append((live_module, shadow))
        return shadow

    def _add_tensors(self, live_module: torch.nn.Module, shadow: torch.nn.Module, info) -> None:
        """The shadow's parameters and buffers, as vLLM recorded them (`info`)."""
        device = info.restore_device
        recorded_params, recorded_buffers = info.restore_metadata
        names = [n for n, p in live_module._parameters.items() if p is not None]
        for name in dict.fromkeys([*recorded_params, *names]):
            live = live_module._parameters.get(name)
            shadow._parameters[name] = self._tensor_for(
                live_module, shadow, name, live, recorded_params.get(name), device
            )
        for name, recorded in recorded_buffers.items():
            live = live_module._buffers.get(name)
            shadow._buffers[name] = self._tensor_for(
                live_module, shadow, name, live, recorded, device
            )
        for name, buffer in live_module._buffers.items():
            if buffer is not None and name not in shadow._buffers:
                shadow._buffers[name] = buffer  # not loaded (not in the checkpoint)

    def _tensor_for(self, live_module, shadow, name, live, recorded, device) -> torch.Tensor:
        """The shadow of the live tensor `live` (None: none) called `name` in `live_module`,
        laid out as `recorded` (None: not recorded), on `device` once materialized."""
        key = id(live) if live is not None else None
        if key is not None and key in self.tensors:
            return self.tensors[key]
        owners = (live_module, self._sentinel)
        if recorded is not None:
            new = _shadow_tensor(recorded, recorded.size(), recorded.stride(), "meta", owners,
                                 shadow)  # fmt: skip
            self.devices[id(new)] = device
        elif name in self._skipped and live is not None:
            # Not recorded (vLLM builds `bias` after the metadata): the live layout is the
            # checkpoint's, as processing leaves an unquantized bias alone.
            new = _shadow_tensor(live, live.size(), live.stride(), "meta", owners, shadow)
            self.devices[id(new)] = live.device
        else:
            raise PreloadUnsupported(
                f"{type(live_module).__name__}.{name} has no recorded checkpoint layout"
            )
        if key is not None:
            self.tensors[key] = new
        return new


def _empty_clone(live_module: torch.nn.Module) -> torch.nn.Module:
    """A module of `live_module`'s class and attributes, with no parameters, buffers or
    children yet, and not marked as processed."""
    shadow = live_module.__class__.__new__(live_module.__class__)
    shadow.__dict__.update(live_module.__dict__)
    shadow.__dict__["_parameters"] = {}
    shadow.__dict__["_buffers"] = {}
    shadow.__dict__["_modules"] = {}
    shadow.__dict__["_non_persistent_buffers_set"] = set(live_module._non_persistent_buffers_set)
    shadow.__dict__.pop("_already_called_process_weights_after_loading", None)
    return shadow


def _subtree_has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _unwrapped_loader(loader):
    """A weight loader without vLLM's layerwise-reload wrappers (left on the recorded metadata
    by an earlier in-place reload)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _shadow_tensor(template: torch.Tensor, shape, stride, device, owners, shadow) -> torch.Tensor:
    """A fresh tensor of `template`'s class and attributes with the given layout; methods bound
    to one of `owners` (the live module, vLLM's sanitising sentinel) are rebound to `shadow`."""
    tensor = torch.empty_strided(tuple(shape), tuple(stride), dtype=template.dtype, device=device)
    tensor.__class__ = template.__class__
    attributes = dict(template.__dict__)
    for key, value in attributes.items():
        if key in ("weight_loader", "_weight_loader"):
            value = _unwrapped_loader(value)
        if isinstance(value, types.MethodType) and any(value.__self__ is o for o in owners):
            value = value.__func__.__get__(shadow)
        attributes[key] = value
    tensor.__dict__ = attributes
    return tensor


def release_shadows(modules) -> None:
    """Empties each shadow module, once the preload has planned its commit (or failed): its
    tensors' weight loaders are bound to it, a reference cycle that would keep it, its
    checkpoint-layout tensors and the packed linears its processing made (and the next
    commit retires) alive until Python's rare full collection, and a long-lived worker's
    memory grew with its swaps until the kernel killed it. What the commit needs (the new
    tensors, the new attributes) it holds itself."""
    for module in modules:
        module.__dict__.clear()


def materialize(modules, devices: dict, made: weakref.WeakValueDictionary) -> None:
    """Gives storage to the meta tensors of `modules` (on their device in `devices`); a tensor
    two modules share gets one (`made`: meta id -> its tensor, while it lives)."""
    for module in modules:
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_meta:
                    continue
                real = made.get(id(tensor))
                if real is None:
                    real = torch.empty_strided(
                        tuple(tensor.size()), tuple(tensor.stride()), dtype=tensor.dtype,
                        device=devices[id(tensor)],
                    )  # fmt: skip
                    real.__class__ = tensor.__class__
                    real.__dict__ = dict(tensor.__dict__)
                    made[id(tensor)] = real
                table[name] = real
