"""A recipe as one command: the stages its RLHF stage needs, in order, each skipped only when
its folder holds a finished run made by the settings and inputs the command would use now.

`python -m jaxrlhf.main --config=configs/nobots.py` (a recipe config with no stage after the
colon: `config.recipe.whole`) runs every stage whose output the RLHF stage reads, directly or
through another stage: No Robots and TL;DR make the SFT model (`model.path` = `ROOT/sft`) and
the reward model (`task.reward_model` = `ROOT/reward`, itself trained from `ROOT/sft`), then
run RLHF; GSM8k starts from an SFT-ed hub model and runs RLHF alone.

Overrides reach the stage they name. Each stage's config is `configs/X.py:<stage>`, then:

- a plain `--config.KEY=V` reaches the RLHF stage (the stage a whole recipe is named for);
- `--config.sft.KEY=V` and `--config.reward.KEY=V` reach that stage alone (a whole recipe's
  config carries each earlier stage's config under its name: `configs/_recipe.py`);
- the keys of `SHARED_KEYS` reach every stage: `output_dir` moves the recipe's root (the stages
  write `DIR/sft`, `DIR/reward`, `DIR/rlhf`, and every path under the root moves with it);
  `model.path` is the model the first stage starts from (the later stages start from the
  earlier ones' outputs); `resume` continues stages killed half-way; the data sources and
  splits are one for the whole recipe;
- `task.reward_model` (or another input key) pointing elsewhere than the recipe's stage output
  leaves that stage out; `stage` is the recipe's business (run one stage with
  `configs/X.py:<stage>`); `recipe.rerun_from=STAGE` reruns that stage and every later one.

A stage is finished when its folder holds `summary.json` with its `made_by` record
(`jaxrlhf.stages.provenance`) and a whole `hf_export/`, the record's config equals the one the
command would run, and each stage output it read is the one the recipe has now (same digest). A
finished stage that differs in either way, or whose record is unreadable or from an older version
of this project, is neither skipped nor rerun: the command refuses (`Plan.refusals`).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_collections

from jaxrlhf.config import config_keys
from jaxrlhf.models.safetensors_io import read_header
from jaxrlhf.stages import provenance
from jaxrlhf.stages.provenance import INPUT_KEYS, Record, get_key, read_record

EARLIER_STAGES = ("sft", "reward")  # the stages a recipe may run before RLHF, in order
# Keys that reach every stage of a recipe (module docstring); every other plain key reaches
# the RLHF stage alone.
SHARED_KEYS = (
    "output_dir", "model.path", "resume", "task.source", "task.preference_source",
    "task.train_split", "task.eval_split", "task.test_split", "task.validation_fraction",
)  # fmt: skip
RERUN_KEY = "recipe.rerun_from"


@dataclasses.dataclass
class StageRun:
    """One stage of a run: its config, the command line's keys it got, and what the command
    does with it: "finished" (skipped), "runs", "resumes", "reruns" (its folder emptied first)
    or "refused" (`problem` says why)."""

    stage: str
    config: ml_collections.ConfigDict
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    status: str = "runs"
    problem: str = ""
    record: Record = dataclasses.field(default_factory=lambda: Record("absent"))

    @property
    def finished(self) -> bool:
        return self.status == "finished"


class RecipeError(ValueError):
    """A command line the recipe cannot run as written (one line)."""


def is_whole_recipe(config: ml_collections.ConfigDict) -> bool:
    """Whether `config` is a recipe named without a stage (`configs/X.py`)."""
    recipe = config.get("recipe")
    return bool(recipe and recipe.get("whole"))


def stage_overrides(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The command line's keys split by the stage they reach (module docstring): {"shared":
    ..., "sft": ..., "reward": ..., "rlhf": ...}, each without its stage's prefix."""
    split: dict[str, dict[str, Any]] = {"shared": {}, "sft": {}, "reward": {}, "rlhf": {}}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if head in EARLIER_STAGES and rest:
            split[head][rest] = value
        elif key in SHARED_KEYS:
            split["shared"][key] = value
        elif key != "stage" and not key.startswith("recipe."):
            split["rlhf"][key] = value
    return split


def recipe_runs(
    overrides: dict[str, Any],
    stage_config: Callable[[str], ml_collections.ConfigDict],
    rerun_from: str = "",
) -> list[StageRun]:
    """The stages a recipe's RLHF stage needs, then RLHF, each with its config and status.

    `overrides`: the command line's `--config.KEY=VALUE` (flat, dotted keys); `stage_config(s)`:
    the recipe's config of stage `s` without them (`configs/X.py:s`). Raises RecipeError for an
    override or `rerun_from` naming a stage the recipe does not run."""
    recipe_root = stage_config("rlhf").recipe.root
    split = stage_overrides(overrides)
    root = str(split["shared"].get("output_dir", recipe_root)).rstrip("/") or "/"

    def build(stage: str) -> StageRun:
        config = stage_config(stage)
        _move_root(config, recipe_root, root)
        given = {k: v for k, v in split["shared"].items() if k not in ("output_dir", "model.path")}
        given |= split[stage]
        for key, value in given.items():
            set_key(config, key, value)
        return StageRun(stage, config, given)

    runs = {"rlhf": build("rlhf")}
    order: list[str] = []

    def visit(stage: str) -> None:
        for key in INPUT_KEYS:
            for earlier in EARLIER_STAGES:
                if get_key(runs[stage].config, key) == f"{root}/{earlier}" and earlier not in order:
                    runs[earlier] = build(earlier)
                    visit(earlier)
                    order.append(earlier)

    visit("rlhf")
    order.append("rlhf")
    for stage in EARLIER_STAGES:
        if split[stage] and stage not in order:
            raise RecipeError(f"--config.{stage}.{next(iter(split[stage]))}: this recipe runs "
                              f"no {stage} stage (its stages: {' -> '.join(order)})")  # fmt: skip
    if rerun_from and rerun_from not in order:
        raise RecipeError(f"--config.{RERUN_KEY}={rerun_from}: not a stage of this recipe "
                          f"(its stages: {' -> '.join(order)})")  # fmt: skip
    if "model.path" in split["shared"]:
        runs[order[0]].config.model.path = split["shared"]["model.path"]
        runs[order[0]].overrides["model.path"] = split["shared"]["model.path"]
    ordered = [runs[s] for s in order]
    decide(ordered, root, rerun_from)
    return ordered


def decide(runs: list[StageRun], root: str, rerun_from: str = "") -> None:
    """Sets each stage's status, in order (module docstring)."""
    rerun = [run.stage for run in runs].index(rerun_from) if rerun_from else len(runs)
    by_folder = {f"{root}/{run.stage}": run for run in runs}
    for index, run in enumerate(runs):
        if index >= rerun:
            run.status = "reruns"
            continue
        run.record = read_record(run.config.output_dir)
        steps = checkpoint_steps(Path(run.config.output_dir) / "checkpoints")
        if run.record.state == "finished" and export_is_complete(
            Path(run.config.output_dir) / provenance.EXPORT
        ):
            run.status, run.problem = _finished_or_why_not(run, by_folder)
        elif run.record.state in ("unreadable", "unknown"):
            why = "is not a whole JSON object" if run.record.state == "unreadable" else (
                "has no record of the settings that made it (an older version of jaxrlhf wrote "
                "it)")  # fmt: skip
            run.status, run.problem = "refused", f"its summary.json {why}: config unknown"
        elif steps and run.config.resume:
            run.status = "resumes"
        elif steps:
            run.status = "refused"
            run.problem = f"holds the checkpoints of a run that did not finish (steps {steps})"
        else:
            run.status = "runs"


def _finished_or_why_not(run: StageRun, by_folder: dict[str, StageRun]) -> tuple[str, str]:
    """("finished", "") when the record matches what the command would run, else ("refused",
    the keys that differ, or the input that changed)."""
    changed = provenance.differences(run.record.config, provenance.flat_config(run.config))
    if changed:
        return "refused", "was made with other settings: " + "; ".join(changed)
    for key in INPUT_KEYS:
        upstream = by_folder.get(str(get_key(run.config, key)))
        if upstream is None:
            continue
        folder = upstream.config.output_dir
        if upstream.status == "refused":
            return "refused", ""  # stale with it; the line about the upstream stage says why
        if upstream.status != "finished":
            return "refused", (f"was trained from {folder} ({key}), which this command trains "
                               "again")  # fmt: skip
        if run.record.inputs.get(key) != upstream.record.output_digest:
            return "refused", (f"was trained from another {folder} ({key}) than the one there "
                               "now")  # fmt: skip
    return "finished", ""


def refusals(runs: list[StageRun], command: list[str]) -> list[str]:
    """One line for each refused stage: what is wrong and the ways on."""
    refused = [run for run in runs if run.status == "refused"]
    if not refused:
        return []
    first = refused[0].stage
    rerun = _command(command, f"--config.{RERUN_KEY}={first}")
    ways = (
        f"rerun the {first} stage and those after it with `{rerun}` (their folders are "
        "emptied first), or write this run elsewhere with --config.output_dir=NEW_ROOT"
    )
    lines = []
    for run in (run for run in refused if run.problem):
        where = f"{run.config.output_dir} (the recipe's {run.stage} stage)"
        if run.problem.startswith("holds the checkpoints"):
            lines.append(f"{where} {run.problem}: continue it with "
                         f"`{_command(command, '--config.resume=true')}`, or {ways}")  # fmt: skip
        else:
            lines.append(f"{where} {run.problem}: {ways}")
    return lines


def _command(command: list[str], extra: str) -> str:
    return shlex.join(["python", "-m", "jaxrlhf.main", *command, extra])


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the complete Orbax checkpoints in `directory` (folders named by their step)."""
    if not directory.is_dir():
        return []
    return sorted(int(child.name) for child in directory.iterdir() if child.name.isdigit())


def is_finished(folder: str | Path) -> bool:
    """Whether `folder` holds a finished stage: a whole summary.json and a whole export, made by
    whatever settings (a recipe also compares its record: `decide`)."""
    folder = Path(folder)
    try:
        summary = json.loads((folder / provenance.SUMMARY).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and export_is_complete(folder / provenance.EXPORT)


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


def set_key(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for part in path:
        config = config[part]
    config[last] = value
