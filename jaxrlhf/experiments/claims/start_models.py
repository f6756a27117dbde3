"""The claims' start models, committed: the builds of the test bed every claim run starts from.

The bed is built from its recipe on first use and cached by the recipe's digest
(`jaxrlhf.models.bed`). One machine builds the same bytes every time, but two machines need not:
the same recipe and code started at 32.93% of test on the machine of 2026-12-01 to 05 and at
32.45% on that of 2026-12-06, and the larger sizes, chosen on a steep part of their SFT curve,
differ more (`bed-l` at 41.7% of validation there, 48.5% here). A claim runs over several
sessions, and a session may get another machine. So the builds the claims use are committed
under `results/claims/start-models/{name}-{digest16}/` (the cache's folder of the build, its
`FILES` copied; the builds of 2026-12-06), and
before a claim runs, `install` puts them in the cache in place of any other build of the same
recipe. Pieces run on any machine then start from the same weights; what still differs is
the machine's float arithmetic (each claim's report lists its runs' start accuracies, and a
seed is paired only within one: `analysis.matched_seeds`).

Beside each build, `start.json` holds its greedy accuracies before training, as its first runs
recorded them. A finished run whose start differs began from another build (an earlier
machine's): `other_start` finds it, and `--rerun-other-starts` reruns such runs (a seed split
across two builds, made whole one run at a time).
"""

from __future__ import annotations

import filecmp
import functools
import json
import re
import shutil
from pathlib import Path

from jaxrlhf.experiments import REPO, records
from jaxrlhf.models.built import COMPLETE, cache_dir, replaced

COMMITTED = REPO / "results" / "claims" / "start-models"
FILES = ("bed.json", "chat_template.jinja", "config.json", "generation_config.json",
         "model.safetensors", "tokenizer.json", "tokenizer_config.json")  # fmt: skip
START = "start.json"  # beside each committed build (module docstring)
START_KEYS = ("test_accuracy_start", "eval_accuracy_start")


def same_file(a: Path, b: Path) -> bool:
    return b.exists() and filecmp.cmp(a, b, shallow=False)


def install(committed: Path = COMMITTED, root: Path | None = None) -> list[str]:
    """Puts each committed start model into the bed's cache (`root`: default the cache's
    models/bed), replacing a build of the same name whose files differ. Returns a line per
    model, to print.

    A run may be reading the cache's folder meanwhile (another claim's piece, started from it):
    the folder is replaced in one step (`built.replaced`), never deleted first, so that its
    path names a whole model, the old or the new, at every moment; two installs at once take
    turns, and the second finds the first's copy."""
    root = root if root is not None else cache_dir() / "models" / "bed"
    lines = []
    for source in sorted(p for p in committed.glob("*") if (p / "model.safetensors").exists()):
        target = root / source.name
        other = (target / COMPLETE).exists() and not same_build(source, target)
        copy = functools.partial(copy_build, source)
        if not replaced(target, copy, keep=functools.partial(same_build, source)):
            lines.append(f"{source.name}: the committed start model (already in the cache)")
        elif other:
            lines.append(f"{source.name}: the cache held another build of this recipe (this "
                         f"machine's); replaced by the committed start model")  # fmt: skip
        else:
            lines.append(f"{source.name}: the committed start model, copied into the cache")
    return lines


def same_build(source: Path, folder: Path) -> bool:
    """Whether `folder` holds the build's `FILES` of `source`, byte for byte."""
    return all(same_file(source / name, folder / name) for name in FILES)


def copy_build(source: Path, folder: Path) -> None:
    """Copies the build's `FILES` of `source` into `folder`."""
    for name in FILES:
        shutil.copy2(source / name, folder / name)


def model_of(overrides: dict) -> str:
    """The start model a claim run's overrides name (the bed when none)."""
    return overrides.get("model.path", "bed")


def committed_build(model: str, committed: Path = COMMITTED) -> Path:
    """The committed build of `model` (e.g. "bed-m"): its folder `{model}-{digest16}`."""
    name = re.compile(re.escape(model) + r"-[0-9a-f]{16}")
    (build,) = [p for p in committed.glob(f"{model}-*") if name.fullmatch(p.name)] or [None]
    if build is None:
        raise FileNotFoundError(f"no committed start model {model!r} in {committed}")
    return build


def other_start(folder: Path, model: str, committed: Path = COMMITTED) -> bool:
    """Whether `folder` holds a finished run (summary.json) that began from another build of
    `model` than the committed one: a start accuracy differing from the build's `start.json`
    by 0.01 points or more (the resolution `analysis.start_of` pairs at)."""
    summary = records.text(folder, "summary.json")
    if summary is None or not list(committed.glob(f"{model}-*")):
        return False  # unfinished, or a model with no committed builds (e.g. packaged SmolLM2)
    ran = json.loads(summary)
    recorded = json.loads((committed_build(model, committed) / START).read_text())
    return any(ran.get(k) is None or round(ran[k] - recorded[k], 4) != 0 for k in START_KEYS)
