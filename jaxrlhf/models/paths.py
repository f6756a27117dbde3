"""Where a `config.model.path` (or any model argument) points."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# Written last into a folder `built_once` built: the folder is whole.
COMPLETE = ".complete"
# The test bed's sizes (`jaxrlhf.models.bed.SIZES`, checked equal by its tests).
BED_NAMES = ("bed", "bed-m", "bed-l")


def built_once(folder: str | os.PathLike, build: Callable[[Path], None]) -> Path:
    """`folder`, built by `build(tmp)` into a temporary sibling and renamed into place, unless
    it is already whole. Processes building the same folder at once (parallel test workers,
    two runs) never see a half-written one: the first rename wins, the others' copies go."""
    folder = Path(folder)
    if (folder / COMPLETE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        build(tmp)
        (tmp / COMPLETE).write_text("")
        if folder.exists() and not (folder / COMPLETE).exists():
            shutil.rmtree(folder, ignore_errors=True)  # a half-built folder from before
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / COMPLETE).exists():  # not another builder's whole folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_model(path: str) -> Path:
    """ "smollm2" = the packaged model (converted once), "tiny" = a tiny random model (256
    positions), "tiny-long" = the same with 1024 positions (long responses in benches), "bed",
    "bed-m", "bed-l" = the test bed's sizes (trained once on the arithmetic task,
    `jaxrlhf.models.bed`), a stage's output dir = its exported `hf_export/`, else a Hugging
    Face folder or hub name."""
    if path in BED_NAMES:
        from jaxrlhf.models.bed import bed_path

        return bed_path(path)
    if path == "smollm2":
        from jaxrlhf.models.smollm2 import smollm2_path

        return smollm2_path()
    if path == "tiny":
        from jaxrlhf.models.smollm2 import cache_dir
        from jaxrlhf.models.tiny import make_tiny_model

        return make_tiny_model(cache_dir() / "models" / "tiny-llama")
    if path == "tiny-long":
        from jaxrlhf.models.smollm2 import cache_dir
        from jaxrlhf.models.tiny import make_tiny_model

        return make_tiny_model(
            cache_dir() / "models" / "tiny-llama-1024", max_position_embeddings=1024
        )
    from jaxrlhf.models.hf_io import resolve_model_path

    exported = Path(path).expanduser() / "hf_export"
    if (exported / "config.json").exists():
        return exported
    return resolve_model_path(path)
