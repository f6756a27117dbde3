"""Models built locally once (the packaged SmolLM2 converted, tiny random models, the test bed)
and the cache folder they live in.

Below every module that builds one (`smollm2`, `tiny`), and the one that resolves a model name
to its folder (`paths`), so that none of them imports another to share this.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """Root of generated artefacts: $JAXRLHF_CACHE, else ~/.cache/jaxrlhf."""
    return Path(os.environ.get("JAXRLHF_CACHE", Path.home() / ".cache" / "jaxrlhf"))


# Written last into a folder `built_once` built: the folder is whole.
COMPLETE = ".complete"


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
