"""What made a stage's output: the record a finished stage keeps in its `summary.json`.

A stage that finishes writes `summary.json` (atomically, last) with a `made_by` record:

- `config`: its resolved config, flat (`{"train.learning_rate": 1e-5, ...}`), without the keys
  that cannot change what it trains (`IGNORED`: its output folder, resuming, logging and
  evaluation cadence, where its generators run). Paths under the recipe's root are written as
  `<root>/...`, so that a recipe moved whole to another root reads the same;
- `inputs`: for each key through which it read another stage's output (`INPUT_KEYS`), that
  output's digest, as the other stage's own record gave it when this one finished;
- `output_digest`: SHA-256 of its `hf_export/` (every file, in name order), what a later stage
  records as its input;
- `format`: `FORMAT`. A record of another format (an older version of this project) or none at
  all reads as "config unknown": nothing is guessed from it.

Before it trains, a stage removes its `summary.json` and `hf_export/` (`clear_outputs`): they
belonged to the run being replaced or continued, and a run killed half-way must never read as
finished.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import ml_collections

from jaxrlhf.config import config_keys
from jaxrlhf.config.checks import resolve

FORMAT = 1
SUMMARY = "summary.json"
EXPORT = "hf_export"
# The keys through which a stage reads another stage's output folder.
INPUT_KEYS = ("model.path", "task.reward_model", "loss_params.value_model_path")
# Keys (or sections, with every key under them) that cannot change what a stage trains.
IGNORED = (
    "output_dir", "resume", "recipe", "sft", "reward", "learner_cpus", "checkpoint.every",
    "eval.every", "eval.test_every", "eval.kl_prompts", "train.log_every",
    "train.log_samples_returned",
    "generator.addresses", "generator.auth_token_env", "generator.cpus",
    "generator.generate_timeout_s", "generator.update_timeout_s", "generator.status_timeout_s",
    "generator.probe_interval_s", "distributed.coordinator_address", "distributed.process_id",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Record:
    """What `summary.json`'s `made_by` says (`state` "finished"), or why it says nothing:
    "absent" (no summary.json), "unreadable" (not a whole JSON object), "unknown" (no record
    of this project's format: an older version wrote it)."""

    state: str
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)
    output_digest: str = ""


def is_ignored(key: str) -> bool:
    return any(key == name or key.startswith(name + ".") for name in IGNORED)


def flat_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The keys that decide what the stage trains, flat, JSON's types, paths under the recipe's
    root as `<root>/...` (module docstring)."""
    config = resolve(config.copy_and_resolve_references())  # as the stage reads it
    recipe = config.get("recipe")
    root = str(recipe.root).rstrip("/") if recipe and recipe.get("root") else None
    flat = {}
    for key in config_keys(config):
        if is_ignored(key):
            continue
        value = get_key(config, key)
        if isinstance(value, tuple):
            value = list(value)
        if root and isinstance(value, str) and (value == root or value.startswith(root + "/")):
            value = "<root>" + value[len(root) :]
        flat[key] = value
    return json.loads(json.dumps(flat))  # the types a record reads back


def read_record(folder: str | Path) -> Record:
    """The record of the stage in `folder` (module docstring)."""
    path = Path(folder) / SUMMARY
    if not path.exists():
        return Record("absent")
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return Record("unreadable")
    if not isinstance(summary, dict):
        return Record("unreadable")
    made_by = summary.get("made_by")
    if not isinstance(made_by, dict) or made_by.get("format") != FORMAT:
        return Record("unknown")
    try:
        return Record("finished", dict(made_by["config"]), dict(made_by["inputs"]),
                      str(made_by["output_digest"]))  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return Record("unknown")


def input_digests(config: ml_collections.ConfigDict) -> dict[str, str]:
    """For each input key naming a finished stage's folder, that stage's output digest."""
    digests = {}
    for key in INPUT_KEYS:
        value = get_key(config, key)
        if isinstance(value, str) and value:
            record = read_record(value)
            if record.state == "finished":
                digests[key] = record.output_digest
    return digests


def get_key(config: ml_collections.ConfigDict, key: str) -> Any:
    """`config["a"]["b"]` for key "a.b" (None when a part is missing)."""
    for part in key.split("."):
        if not isinstance(config, ml_collections.ConfigDict) or part not in config:
            return None
        config = config[part]
    return config


def export_digest(folder: str | Path) -> str:
    """SHA-256 over every file of an export (names and bytes, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        with path.open("rb") as file:
            while chunk := file.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def write_summary(config: ml_collections.ConfigDict, summary: dict) -> None:
    """Writes `summary.json` with its `made_by` record, atomically (a reader sees the old file
    or the whole new one)."""
    out = Path(config.output_dir)
    export = out / EXPORT
    made_by = {
        "format": FORMAT,
        "config": flat_config(config),
        "inputs": input_digests(config),
        "output_digest": export_digest(export) if export.is_dir() else "",
    }
    write_json_atomically(out / SUMMARY, {**summary, "made_by": made_by})


def write_json_atomically(path: Path, value: Any) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value, indent=2))
    os.replace(temporary, path)


def clear_outputs(folder: str | Path) -> None:
    """Removes a stage's `summary.json`, then its `hf_export/` (module docstring)."""
    folder = Path(folder)
    (folder / SUMMARY).unlink(missing_ok=True)
    shutil.rmtree(folder / EXPORT, ignore_errors=True)


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key old → new` for each key whose value differs (or that only one of them has)."""
    missing = object()
    lines = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, missing), new.get(key, missing)
        if before != after:
            shown = ["(none)" if v is missing else json.dumps(v) for v in (before, after)]
            lines.append(f"{key} {shown[0]} → {shown[1]}")
    return lines
