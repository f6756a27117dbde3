"""What a LoRA adapter update must be ("lora" mode), and its folder in PEFT's layout.

An adapter update (WeightChunk.lora or SharedWeights.lora set) carries, for every decoder
layer of the served model and every target module of its `LoraSettings`, PEFT's two factors:
`lora_A` [rank, in] and `lora_B` [out, rank], named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{t}.lora_A.weight` (`adapter_specs`, derived
from the served model's safetensors headers). It goes through the same checks as a full update
(streamed: assemble.py; in a shared file: tensors.py `check_shared_layout`; names, shapes,
dtypes, each tensor once and complete); its values must also be finite. It is then written, as
vLLM loads an adapter (`adapter_model.safetensors` + `adapter_config.json`), into a folder of
its own, made under a temporary name and renamed (`write_adapter_folder`, reading either update
file): vLLM reads the folder when the adapter is added, and again whenever it reloads an
adapter evicted from its cache.

Only Llama's seven linear layers may be targets (vLLM's packed q/k/v and gate/up take them as
PEFT names them); embeddings and the head are not (tied in the served models). Pure Python
and numpy (no torch).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass

import grpc
import numpy as np

from generator_service.updates.tensors import PreloadTensor, TensorSpec, WeightUpdateError
from jaxrlhf_wire.dtypes import WIRE_DTYPES

# The linear layers an adapter may target, by block (Llama's names, as PEFT's keys carry them).
LORA_TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_BASE_LINEAR = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight")
# Rows read at a time when scanning a factor for NaN or Inf (bounds the scan's memory).
_SCAN_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class LoraSettings:
    """An adapter's settings (the LoraAdapter message): scale alpha / rank, or alpha / sqrt(rank)
    with `use_rslora`."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @classmethod
    def of(cls, message) -> LoraSettings:
        """From a LoraAdapter message."""
        return cls(message.rank, message.alpha, tuple(message.target_modules), message.use_rslora)

    def describe(self) -> str:
        targets, rslora = list(self.target_modules), ", rsLoRA" if self.use_rslora else ""
        return f"rank {self.rank}, alpha {self.alpha:g}, targets {targets}{rslora}"


def adapter_name(layer: int, block: str, target: str, factor: str) -> str:
    """PEFT's key of one factor ("A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{factor}.weight"


def check_settings(settings: LoraSettings, max_rank: int) -> None:
    """INVALID_ARGUMENT naming the problem: a rank outside [1, max_rank], alpha not finite and
    > 0, targets empty, repeated or not among `LORA_TARGETS`."""
    if not 1 <= settings.rank <= max_rank:
        raise _invalid(
            f"adapter rank {settings.rank} is outside [1, {max_rank}] (the server's "
            "--max-lora-rank)"
        )
    if not (math.isfinite(settings.alpha) and settings.alpha > 0):
        raise _invalid(f"adapter alpha {settings.alpha} must be finite and > 0")
    targets = settings.target_modules
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        raise _invalid(
            f"adapter target_modules {list(targets)}: must be distinct names among "
            f"{list(LORA_TARGETS)}, at least one" + (f" ({unknown} are not)" if unknown else "")
        )


def adapter_specs(
    base: dict[str, TensorSpec], settings: LoraSettings, max_rank: int
) -> dict[str, TensorSpec]:
    """The tensors an adapter with `settings` must carry for the served model whose tensors are
    `base` (`check_settings` first): for each layer and target, A [rank, in] and B [out, rank],
    in the served tensor's dtype code. INVALID_ARGUMENT for a target the model lacks."""
    check_settings(settings, max_rank)
    specs: dict[str, TensorSpec] = {}
    found: set[str] = set()
    for name, spec in sorted(base.items(), key=lambda item: _layer_order(item[0])):
        match = _BASE_LINEAR.fullmatch(name)
        if match is None or len(spec.shape) != 2:
            continue
        layer, block, target = int(match[1]), match[2], match[3]
        if target not in settings.target_modules or LORA_TARGETS[target] != block:
            continue
        found.add(target)
        out_features, in_features = spec.shape
        a, b = (adapter_name(layer, block, target, factor) for factor in "AB")
        specs[a] = TensorSpec(a, (settings.rank, in_features), spec.dtype)
        specs[b] = TensorSpec(b, (out_features, settings.rank), spec.dtype)
    missing = [t for t in settings.target_modules if t not in found]
    if missing:
        raise _invalid(f"adapter targets {missing}: the served model has no such layers")
    return specs


def update_specs(
    base: dict[str, TensorSpec], lora: LoraSettings | None, max_lora_rank: int
) -> dict[str, TensorSpec]:
    """The tensors an update must carry on a server whose model has tensors `base`: those, or
    with `lora`, on a "lora" server (`max_lora_rank` > 0), the adapter's (`adapter_specs`).
    FAILED_PRECONDITION for an update of the other kind than the server takes."""
    if (lora is not None) != (max_lora_rank > 0):
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this server takes LoRA adapters only (started with --max-lora-rank "
            f"{max_lora_rank}), not full weights: set the update's lora (WeightChunk.lora "
            "or SharedWeights.lora)"
            if max_lora_rank
            else "this server takes full weights only, not LoRA adapters: start it with "
            "--max-lora-rank to serve adapters",
        )
    return base if lora is None else adapter_specs(base, lora, max_lora_rank)


def _layer_order(name: str) -> tuple[int, str]:
    match = _BASE_LINEAR.fullmatch(name)
    return (int(match[1]) if match else -1, name)


def peft_config(settings: LoraSettings, base_model: str) -> dict:
    """`adapter_config.json` of an adapter with `settings` (what PEFT and vLLM both load)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "target_modules": list(settings.target_modules),
        "use_rslora": settings.use_rslora,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def check_finite(name: str, wire_dtype: str, data: bytes | memoryview) -> None:
    """INVALID_ARGUMENT when the tensor's bytes `data` (in `wire_dtype`) hold a NaN or an Inf."""
    view = np.frombuffer(data, WIRE_DTYPES[wire_dtype].view)
    for start in range(0, view.size, _SCAN_ELEMENTS):
        part = view[start : start + _SCAN_ELEMENTS]
        if wire_dtype == "bfloat16":  # the high half of a float32
            part = (part.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        if not np.isfinite(part).all():
            raise _invalid(f"tensor {name} holds non-finite values (NaN or Inf)")


def safetensors_bytes(tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> list[bytes]:
    """A safetensors file of (name, wire dtype, shape, bytes), as the pieces to write in order."""
    header: dict[str, dict] = {}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {
            "dtype": WIRE_DTYPES[dtype].safetensors,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return [len(encoded).to_bytes(8, "little"), encoded, *(data for *_, data in tensors)]


def write_adapter_folder(
    root: str,
    name: str,
    update_path: str,
    tensors: list[PreloadTensor],
    settings: LoraSettings,
    base_model: str,
) -> str:
    """Reads the adapter's complete, checked `tensors` from the update file `update_path`,
    refuses non-finite values (INVALID_ARGUMENT), and writes them with their config into the
    folder `root/name` (made as a hidden temporary folder, then renamed: never seen half
    written); returns its absolute path."""
    os.makedirs(root, exist_ok=True)
    final = os.path.abspath(os.path.join(root, name))
    temporary = os.path.join(root, f".{name}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    os.mkdir(temporary)
    try:
        contents = []
        with open(update_path, "rb") as update_file:
            for tensor in tensors:
                data = os.pread(update_file.fileno(), tensor.nbytes, tensor.position)
                check_finite(tensor.name, tensor.wire_dtype, data)
                contents.append((tensor.name, tensor.wire_dtype, tensor.shape, data))
        with open(os.path.join(temporary, ADAPTER_WEIGHTS), "wb") as file:
            file.writelines(safetensors_bytes(contents))
        with open(os.path.join(temporary, ADAPTER_CONFIG), "w") as file:
            json.dump(peft_config(settings, base_model), file, indent=1)
        os.rename(temporary, final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return final


def _invalid(message: str) -> WeightUpdateError:
    return WeightUpdateError(grpc.StatusCode.INVALID_ARGUMENT, message)
