"""Orbax checkpoints of a run: the train state (sharded arrays) plus JSON metadata.

The metadata holds everything else a resumed run needs to continue exactly: policy version,
data position, RNG state, config. Saves are atomic (Orbax writes to a temporary folder and
renames it when complete), so a run killed mid-save resumes from the previous checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves every `save_every` steps (and on demand), keeps the newest `max_to_keep`."""

    def __init__(self, directory: str | Path, save_every: int, max_to_keep: int = 2):
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=max(1, save_every),
                max_to_keep=max_to_keep,
                create=True,
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int) -> bool:
        return self.manager.should_save(step)

    def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
        """Saves if `step` is due (or `force`); returns whether a save was started."""
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def restore(self, step: int | None, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restores the state with the shapes, dtypes and shardings of `like` (a state pytree)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
        )
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], restored["meta"]

    def meta(self, step: int | None = None) -> dict[str, Any]:
        """The metadata alone of checkpoint `step` (None: the newest), read before the state
        is restored (what it was saved from can be checked first)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
