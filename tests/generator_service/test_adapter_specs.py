"""LoRA adapter updates without an engine (generator_service/updates/adapter.py): the tensors an
adapter must carry, derived from the served model's safetensors headers and the adapter's
settings; the refusals of bad settings, of bad tensors (through the same assembler as full
updates) and of an update of the other kind than the server takes; and the adapter folder the
service writes, which PEFT loads to the merged model's logits."""

from __future__ import annotations

import json
import math

import grpc
import numpy as np
import pytest

from generator_service.updates.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LORA_TARGETS,
    LoraSettings,
    adapter_specs,
    update_specs,
    write_adapter_folder,
)
from generator_service.updates.assemble import WeightAssembler
from generator_service.updates.tensors import (
    PreloadTensor,
    WeightUpdateError,
    expected_tensors,
    read_safetensors_header,
)

ALL = tuple(LORA_TARGETS)
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def base(tiny_llama):
    return expected_tensors(tiny_llama)


def test_an_adapter_carries_both_factors_of_every_target_in_every_layer(base):
    specs = adapter_specs(base, LoraSettings(4, 8.0, ALL), max_rank=8)
    # tiny_llama: 2 layers, hidden 128, 4 heads and 2 KV heads of 32, MLP 256.
    assert len(specs) == 2 * 7 * 2
    expected = {
        "self_attn.q_proj": (128, 128),
        "self_attn.k_proj": (64, 128),
        "self_attn.v_proj": (64, 128),
        "self_attn.o_proj": (128, 128),
        "mlp.gate_proj": (256, 128),
        "mlp.up_proj": (256, 128),
        "mlp.down_proj": (128, 256),
    }
    for layer in range(2):
        for module, (out_features, in_features) in expected.items():
            a = specs[f"{PREFIX}.{layer}.{module}.lora_A.weight"]
            b = specs[f"{PREFIX}.{layer}.{module}.lora_B.weight"]
            assert a.shape == (4, in_features) and b.shape == (out_features, 4)
            assert a.dtype == b.dtype == "F32"  # the served tensor's
    subset = adapter_specs(base, LoraSettings(1, 1.0, ("v_proj", "q_proj")), max_rank=8)
    assert sorted(subset) == sorted(
        f"{PREFIX}.{layer}.self_attn.{t}.lora_{f}.weight"
        for layer in range(2)
        for t in ("q_proj", "v_proj")
        for f in "AB"
    )


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (LoraSettings(16, 32.0, ALL), r"adapter rank 16 is outside \[1, 8\]"),
        (LoraSettings(0, 1.0, ALL), r"adapter rank 0 is outside \[1, 8\]"),
        (LoraSettings(4, 0.0, ALL), "alpha 0.0 must be finite and > 0"),
        (LoraSettings(4, math.nan, ALL), "alpha nan must be finite and > 0"),
        (LoraSettings(4, 8.0, ("q_proj", "qkv_proj")), r"\['qkv_proj'\] are not"),
        (LoraSettings(4, 8.0, ("embed_tokens",)), r"\['embed_tokens'\] are not"),
        (LoraSettings(4, 8.0, ("q_proj", "q_proj")), "must be distinct names"),
        (LoraSettings(4, 8.0, ()), "at least one"),
    ],
)
def test_bad_adapter_settings_are_refused_by_name(base, settings, problem):
    with pytest.raises(WeightUpdateError, match=problem) as refused:
        adapter_specs(base, settings, max_rank=8)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_update_of_the_other_kind_than_the_server_takes_is_a_failed_precondition(base):
    adapter = LoraSettings(4, 8.0, ALL)
    with pytest.raises(WeightUpdateError, match="takes LoRA adapters only") as refused:
        update_specs(base, None, max_lora_rank=8)  # full weights to a LoRA server
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(WeightUpdateError, match="takes full weights only") as refused:
        update_specs(base, adapter, max_lora_rank=0)  # an adapter to a full-weights server
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert update_specs(base, None, 0) is base
    assert update_specs(base, adapter, 8) == adapter_specs(base, adapter, 8)


def _adapter(base, settings: LoraSettings, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: (rng.standard_normal(spec.shape) * 0.2).astype(np.float32)
        for name, spec in adapter_specs(base, settings, 8).items()
    }


def _assemble(specs, tensors: dict[str, np.ndarray], num_tensors: int | None = None):
    """Every tensor through the assembler as one chunk; its complete tensors (or its refusal)."""
    assembler = WeightAssembler(specs, current_version=0)
    for name, value in tensors.items():
        count = len(tensors) if num_tensors is None else num_tensors
        assembler.add(1, count, name, "float32", value.shape, 0, value.tobytes())
    return assembler.finish()


def test_bad_adapter_tensors_are_refused_by_the_assembler(base):
    settings = LoraSettings(4, 8.0, ("q_proj", "down_proj"))
    specs = adapter_specs(base, settings, 8)
    good = _adapter(base, settings)
    assert len(_assemble(specs, good)) == len(specs)
    name = f"{PREFIX}.0.mlp.down_proj.lora_A.weight"
    with pytest.raises(WeightUpdateError, match=r"has shape \[256, 4\], expected \[4, 256\]"):
        _assemble(specs, {**good, name: good[name].T.copy()})
    extra = f"{PREFIX}.0.self_attn.k_proj.lora_A.weight"
    with pytest.raises(WeightUpdateError, match="unknown tensor .*k_proj.lora_A"):
        _assemble(specs, {**good, extra: good[name]}, num_tensors=len(specs))
    missing = dict(good)
    del missing[name]
    with pytest.raises(WeightUpdateError, match=f"num_tensors is {len(specs) - 1}") as refused:
        _assemble(specs, missing)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(WeightUpdateError, match="1 never started") as refused:
        _assemble(specs, missing, num_tensors=len(specs))
    assert refused.value.code == grpc.StatusCode.DATA_LOSS


def _update_file(tmp_path, tensors: dict[str, np.ndarray], dtype: str = "float32"):
    """The tensors laid out as the update file holds them (page-aligned regions)."""
    path, preloaded, position = tmp_path / "update.bin", [], 0
    with open(path, "wb") as file:
        for name, value in tensors.items():
            data = value.tobytes()
            file.seek(position)
            file.write(data)
            preloaded.append(PreloadTensor(name, dtype, value.shape, position, len(data)))
            position += -(-len(data) // 4096) * 4096
    return str(path), preloaded


def test_non_finite_factors_are_refused_and_leave_no_folder(base, tmp_path):
    settings = LoraSettings(4, 8.0, ("q_proj",))
    tensors = _adapter(base, settings)
    name = f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"
    tensors[name][3, 1] = np.nan
    path, preloaded = _update_file(tmp_path, tensors)
    root = tmp_path / "adapters"
    with pytest.raises(WeightUpdateError, match=f"tensor {name} holds non-finite") as refused:
        write_adapter_folder(str(root), "v1-1", path, preloaded, settings, "tiny")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert list(root.iterdir()) == []
    # bfloat16 (viewed through int16): an Inf is found too.
    inf = np.array([0x0000, 0x7F80, 0x3F80], np.uint16).view(np.int16)  # 0, +Inf, 1.0
    path, preloaded = _update_file(tmp_path, {"x": inf}, dtype="bfloat16")
    with pytest.raises(WeightUpdateError, match="tensor x holds non-finite"):
        write_adapter_folder(str(root), "v2-2", path, preloaded, settings, "tiny")


def test_the_written_folder_is_an_adapter_peft_loads_to_the_merged_logits(
    base, tiny_llama, tmp_path
):
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    from safetensors.numpy import load_file

    settings = LoraSettings(4, 6.0, ("q_proj", "o_proj", "up_proj"), use_rslora=True)
    tensors = _adapter(base, settings, seed=3)
    path, preloaded = _update_file(tmp_path, tensors)
    folder = write_adapter_folder(str(tmp_path / "adapters"), "v1-1", path, preloaded,
                                  settings, str(tiny_llama))  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v1-1"]
    config = json.loads((tmp_path / "adapters" / "v1-1" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 6.0, True)
    assert set(read_safetensors_header(f"{folder}/{ADAPTER_WEIGHTS}")) - {"__metadata__"} == set(
        tensors
    )
    weights = load_file(tiny_llama / "model.safetensors")
    merged = merge(weights, tensors, settings)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])

    def logits(model) -> np.ndarray:
        with torch.no_grad():
            return model(ids).logits.numpy()

    load = transformers.AutoModelForCausalLM.from_pretrained
    adapted = peft.PeftModel.from_pretrained(load(tiny_llama, dtype=torch.float32), folder)
    plain = load(tiny_llama, dtype=torch.float32).eval()
    by_peft, before = logits(adapted.eval()), logits(plain)
    plain.load_state_dict({k: torch.from_numpy(v) for k, v in merged.items()}, strict=False)
    plain.tie_weights()
    by_merge = logits(plain)
    assert np.abs(by_peft - by_merge).max() < 1e-4
    assert np.abs(by_peft - before).max() > 1e-2  # the adapter matters


def merge(weights: dict[str, np.ndarray], adapter: dict[str, np.ndarray],
          settings: LoraSettings) -> dict[str, np.ndarray]:  # fmt: skip
    """The base `weights` with the adapter merged in: W + s B A (PEFT's scale)."""
    rank = settings.rank
    scale = settings.alpha / (math.sqrt(rank) if settings.use_rslora else rank)
    merged = dict(weights)
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        merged[target] = (weights[target] + scale * (b.astype(np.float64) @ a)).astype(np.float32)
    return merged


def test_lora_mode_s_command_line(capsys):
    from generator_service.__main__ import engine_config, option_error, parse_args

    base = ["--model", "m"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--max-lora-rank", "4"])
    assert "--max-lora-rank: invalid choice: 4 (choose from 1, 8, 16" in capsys.readouterr().err
    args = parse_args([*base, "--max-lora-rank", "16"])
    assert option_error(args) is None
    config = engine_config(args)
    assert (config.swap_mode, config.max_lora_rank, config.max_loras) == ("lora", 16, 4)
    assert not config.preload and config.lora_cache_size == 6
    assert engine_config(parse_args(base)).preload  # preloading stays the default elsewhere
    problems = {
        ("--preload",): "--preload with --max-lora-rank: adapters are loaded by vLLM",
        ("--swap-mode", "in-flight"): "--swap-mode in-flight with --max-lora-rank",
        ("--max-loras", "0"): "--max-loras=0: must be >= 1",
        ("--max-loras", "3", "--max-cpu-loras", "2"): "--max-cpu-loras=2: must be >= --max-loras",
    }
    for extra, problem in problems.items():
        assert problem in option_error(parse_args([*base, "--max-lora-rank", "8", *extra]))
    assert "give --max-lora-rank too" in option_error(parse_args([*base, "--max-loras", "2"]))
    assert option_error(parse_args([*base, "--max-lora-rank", "8", "--no-preload"])) is None


def test_the_adapter_folders_of_servers_no_longer_running_are_swept(tmp_path):
    """A server killed before its shutdown leaves `jaxrlhf-lora-<pid>/`: the next server's
    `adapters_root` deletes it, and keeps those of running processes (this one) and other
    names."""
    import os
    import subprocess
    import sys

    from generator_service.updates.adapters import ADAPTERS_PREFIX, adapters_root

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    for name in (f"{ADAPTERS_PREFIX}{gone}", f"{ADAPTERS_PREFIX}{os.getppid()}", "other"):
        (tmp_path / name / "v1-1").mkdir(parents=True)
    root = adapters_root(str(tmp_path))
    assert root == str(tmp_path / f"{ADAPTERS_PREFIX}{os.getpid()}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{ADAPTERS_PREFIX}{os.getppid()}", "other"]
    )
