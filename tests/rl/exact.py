"""Helpers for the exact-resume tests: a run's saved train state, array by array, and its
per-step records without the figures that depend on the clock."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp


def checkpoint_steps(output_dir: Path) -> list[int]:
    """The steps of the complete checkpoints of a run (Orbax's temporary folders left out)."""
    folder = Path(output_dir) / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def checkpoint_leaves(output_dir: Path, step: int) -> dict[str, np.ndarray]:
    """Every array of the train state saved at `step` (params, optimizer state, ...), by path."""
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(Path(output_dir) / "checkpoints" / str(step) / "state")
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def assert_same_state(want_dir: Path, got_dir: Path, step: int) -> None:
    """The train states two runs saved at `step` are equal bit for bit."""
    want, got = checkpoint_leaves(want_dir, step), checkpoint_leaves(got_dir, step)
    assert want.keys() == got.keys()
    for path, array in want.items():
        assert got[path].dtype == array.dtype and np.array_equal(got[path], array), path


def timed(key: str) -> bool:
    """Whether a record's figure depends on the clock (seconds, rates) or on the generators'
    load (`generator_*`), or names a version (numbered from the serving one when a run starts):
    every other figure of two exact runs must be equal. `weight_sync_bytes` counts the
    publishes `weight_sync_s` counts (those the step saw finish), so it moves with it."""
    clocked = key.endswith("_s") or key in ("learner_idle_fraction", "generation_tokens_per_s",
                                            "weight_sync_bytes")  # fmt: skip
    return clocked or key.startswith("generator_") or key == "policy_version"


def records(output_dir: Path) -> list[dict]:
    """metrics.jsonl, without the figures `timed` names."""
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not timed(k)} for line in lines]
