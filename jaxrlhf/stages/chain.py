"""A recipe as one command: the stages its RLHF stage needs, in order, each skipped when finished.

`python -m jaxrlhf.main --config=configs/nobots.py` (a recipe config with no stage after the
colon: `config.recipe.whole`) runs every stage whose output the RLHF stage reads, directly or
through another stage: No Robots and TL;DR make the SFT model (`model.path` = `ROOT/sft`) and
the reward model (`task.reward_model` = `ROOT/reward`, itself trained from `ROOT/sft`), then
run RLHF; GSM8k starts from an SFT-ed hub model and runs RLHF alone. Each stage's config is
`configs/X.py:<stage>` with the command line's overrides, except the keys that link the stages:

- `output_dir` moves the recipe's root: the stages write `DIR/sft`, `DIR/reward`, `DIR/rlhf`
  (default `runs/<task>/...`; every path under the root moves with it);
- `model.path` is the model the first stage starts from (the base model of SFT, GSM8k's SFT-ed
  model); the later stages start from the earlier stages' outputs;
- `task.reward_model` (or any other input key) pointing elsewhere than the recipe's stage output
  leaves that stage out;
- `stage` is the recipe's business (run one stage with `configs/X.py:<stage>`).

A stage is finished when its folder holds `summary.json` (a whole JSON object, written last by
every stage) and a whole `hf_export/`: `config.json` and every safetensors file its index (or
`model.safetensors`) names, each as long as its header says. A stage killed half-way leaves
neither or only part of them, and is not finished.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_collections

from jaxrlhf.config import config_keys
from jaxrlhf.models.safetensors_io import read_header

# The keys through which a stage reads another stage's output folder.
INPUT_KEYS = ("model.path", "task.reward_model", "loss_params.value_model_path")
# Command-line overrides that say how the stages link (module docstring), not applied as is.
LINK_KEYS = ("output_dir", "model.path", "stage")


@dataclasses.dataclass
class StageRun:
    """One stage of a run: its config and whether its folder already holds a finished run."""

    stage: str
    config: ml_collections.ConfigDict
    finished: bool


def is_whole_recipe(config: ml_collections.ConfigDict) -> bool:
    """Whether `config` is a recipe named without a stage (`configs/X.py`)."""
    recipe = config.get("recipe")
    return bool(recipe and recipe.get("whole"))


def recipe_runs(
    overrides: dict[str, Any], stage_config: Callable[[str], ml_collections.ConfigDict]
) -> list[StageRun]:
    """The stages a recipe's RLHF stage needs, then RLHF, each with its config.

    `overrides`: the command line's `--config.KEY=VALUE` (flat, dotted keys); `stage_config(s)`:
    the recipe's config of stage `s` without them (`configs/X.py:s`)."""
    recipe_root = stage_config("rlhf").recipe.root
    root = str(overrides.get("output_dir", recipe_root)).rstrip("/") or "/"

    def build(stage: str) -> ml_collections.ConfigDict:
        config = stage_config(stage)
        _move_root(config, recipe_root, root)
        for key, value in overrides.items():
            if key not in LINK_KEYS and not key.startswith("recipe."):
                set_key(config, key, value)
        return config

    configs = {"rlhf": build("rlhf")}
    order: list[str] = []

    def visit(stage: str) -> None:
        for key in INPUT_KEYS:
            for earlier in ("sft", "reward"):
                if get_key(configs[stage], key) == f"{root}/{earlier}" and earlier not in order:
                    configs[earlier] = build(earlier)
                    visit(earlier)
                    order.append(earlier)

    visit("rlhf")
    order.append("rlhf")
    if "model.path" in overrides:
        configs[order[0]].model.path = overrides["model.path"]
    return [StageRun(s, configs[s], is_finished(configs[s].output_dir)) for s in order]


def is_finished(folder: str | Path) -> bool:
    """Whether `folder` holds a finished stage (module docstring)."""
    folder = Path(folder)
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and export_is_complete(folder / "hf_export")


def export_is_complete(folder: str | Path) -> bool:
    """Whether `folder` is a whole Hugging Face export: config.json and full safetensors files."""
    folder = Path(folder)
    try:
        json.loads((folder / "config.json").read_text())
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = set(json.loads(index.read_text())["weight_map"].values())
        else:
            files = {"model.safetensors"}
        return all(_safetensors_is_complete(folder / name) for name in files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _safetensors_is_complete(path: Path) -> bool:
    """The file is as long as its header says (a copy cut short is not)."""
    header, data_start = read_header(path)
    end = max((spec["data_offsets"][1] for spec in header.values()), default=0)
    return path.stat().st_size == data_start + end


def _move_root(config: ml_collections.ConfigDict, old: str, new: str) -> None:
    """Every string of `config` naming `old` or a path under it now names the same under `new`."""
    if old == new:
        return
    for key in list(config_keys(config)):
        value = get_key(config, key)
        if isinstance(value, str) and (value == old or value.startswith(old + "/")):
            set_key(config, key, new + value[len(old) :])


def get_key(config: ml_collections.ConfigDict, key: str) -> Any:
    """`config["a"]["b"]` for key "a.b" (None when a part is missing)."""
    for part in key.split("."):
        if not isinstance(config, ml_collections.ConfigDict) or part not in config:
            return None
        config = config[part]
    return config


def set_key(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for part in path:
        config = config[part]
    config[last] = value
