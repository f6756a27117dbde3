"""Experiment records on disk: each run's files, loose in its folder or packed with the others.

A run writes its records into its own folder, `{folder}/{run}/` (e.g. `results/claims/b` and
`grpo/N4/seed0`): `RUN_FILES`, loose, while the experiment runs. Committed records are packed:
`{folder}/records.jsonl.xz` holds one JSON line per run,
`{"files": {"metrics.jsonl": TEXT, ...}, "run": "grpo/N4/seed0"}`, runs sorted by path, keys
sorted, xz-compressed (no timestamp: packing the same records gives the same bytes). xz, not
gzip: the committed records take 9 MB so, against 21 MB gzipped.

A pack keeps `metrics.jsonl` compact (`compact`): each float to `DIGITS` significant digits, the
rest of each line as the run wrote it. A run's per-update timings and losses carry 17 digits, of
which six are more than any table reads (accuracies, times and ratios print to three or four);
the other files are packed byte for byte. Packing twice gives the same bytes.

Every reader goes through `files`, `text` and `runs`, which see loose and packed runs alike. A
run whose loose folder holds any of `RUN_FILES` is that folder, whole: a run in progress, or
one run again (`--rerun`), in a clone whose records are packed. Else the pack's copy is the run
(the nearest pack above its folder: packs do not nest). So a packed run resumes an experiment in
any clone like a loose one (`runner.finished_with`).

    python -m jaxrlhf.experiments.records pack results/claims/b-tuning
    python -m jaxrlhf.experiments.records unpack results/claims/b-tuning
    python -m jaxrlhf.experiments.records list results/claims/b-tuning

`pack` merges the folder's finished loose runs (with a summary.json) into its pack, then removes
the loose files it packed (other files, e.g. checkpoints, stay); a run in progress stays loose
(`--partial`: pack unfinished runs too, e.g. a stopped one kept as a record). A run both loose
and packed must hold the same files, else `pack` stops and names it (`--replace`: the loose run
replaces the packed one). `unpack` writes the packed runs back out, loose, and removes the pack.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
from collections.abc import Sequence
from pathlib import Path

PACK = "records.jsonl.xz"
# A run's records (`jaxrlhf.main`'s metrics.jsonl and summary.json, the runner's log and
# experiment.json). A folder holding any of them is a run.
RUN_FILES = ("experiment.json", "metrics.jsonl", "run.log", "summary.json")

DIGITS = 6  # significant digits of each float a packed metrics.jsonl keeps
Runs = dict[str, dict[str, str]]  # {run path relative to the pack's folder: {name: text}}
_cache: dict[Path, tuple[tuple[int, int], Runs]] = {}


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")  # any bytes, back as they were (`_encode`)


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _rounded(value):
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{DIGITS}g}")
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


def compact(name: str, content: str) -> str:
    """A run file as packed: `metrics.jsonl` with each float to `DIGITS` significant digits,
    each line re-written as `json.dumps` writes it (as the runs do) with its own line end; a
    line that is not ASCII JSON (e.g. the torn last line of a killed run) stays as it was. The
    other files unchanged. compact(compact(x)) == compact(x)."""
    if name != "metrics.jsonl":
        return content
    lines = []
    for line in content.split("\n"):
        body = line.rstrip("\r")
        try:
            record = json.loads(body) if body.strip() and body.isascii() else None
        except ValueError:
            record = None
        if record is None:
            lines.append(line)
        else:
            lines.append(json.dumps(_rounded(record)) + line[len(body) :])
    return "\n".join(lines)


def read_pack(folder: str | Path) -> Runs:
    """The runs packed in `folder` ({} without a pack)."""
    path = Path(folder) / PACK
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {}
    key = (stat.st_mtime_ns, stat.st_size)
    if path not in _cache or _cache[path][0] != key:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        _cache[path] = (key, {line["run"]: line["files"] for line in lines})
    return _cache[path][1]


def write_pack(folder: str | Path, runs: Runs) -> Path:
    """Writes `runs` as `folder`'s pack (atomically: a reader sees the old pack or the new)."""
    path = Path(folder) / PACK
    lines = [json.dumps({"files": runs[run], "run": run}, sort_keys=True) + "\n"
             for run in sorted(runs)]  # fmt: skip
    temporary = path.with_name(PACK + ".tmp")
    with lzma.open(temporary, "wb", preset=6) as f:
        f.write("".join(lines).encode("ascii"))
    os.replace(temporary, path)
    _cache.pop(path, None)
    return path


def loose_files(folder: str | Path) -> dict[str, str]:
    """The `RUN_FILES` loose in a run's folder ({} when none)."""
    found = {}
    for name in RUN_FILES:
        path = Path(folder) / name
        if path.is_file():
            found[name] = _decode(path.read_bytes())
    return found


def _pack_above(folder: Path) -> tuple[Path, str] | None:
    """The folder of the nearest pack above `folder`, and `folder`'s path relative to it."""
    folder = Path(os.path.abspath(folder))
    for parent in folder.parents:
        if (parent / PACK).is_file():
            return parent, folder.relative_to(parent).as_posix()
    return None


def files(folder: str | Path) -> dict[str, str]:
    """A run's files by name ({} when there is no such run): loose, else packed."""
    loose = loose_files(folder)
    if loose:
        return loose
    found = _pack_above(Path(folder))
    return dict(read_pack(found[0]).get(found[1], {})) if found else {}


def text(folder: str | Path, name: str) -> str | None:
    """One of a run's files (`RUN_FILES`), or None when the run has no such file."""
    return files(folder).get(name)


def runs(root: str | Path) -> list[Path]:
    """The run folders at or below `root`, loose and packed, sorted."""
    root = Path(os.path.abspath(root))
    found = {path.parent for name in RUN_FILES for path in root.rglob(name) if path.is_file()}
    above = _pack_above(root)
    if above is not None:
        inside = above[1]
        found |= {above[0] / run for run in read_pack(above[0])
                  if run == inside or run.startswith(inside + "/")}  # fmt: skip
    for pack in root.rglob(PACK):
        found |= {pack.parent / run for run in read_pack(pack.parent)}
    return sorted(found)


def _loose_runs(folder: Path) -> Runs:
    """`folder`'s loose runs, as they are packed (`compact`)."""
    out = {}
    for run in runs(folder):
        loose = loose_files(run)
        if loose and run != folder:
            named = {name: compact(name, content) for name, content in loose.items()}
            out[run.relative_to(folder).as_posix()] = named
    return out


def _check_not_nested(folder: Path) -> None:
    if _pack_above(folder) is not None:
        raise ValueError(f"{_pack_above(folder)[0] / PACK} already packs {folder}'s runs")
    inner = [p for p in folder.rglob(PACK) if p.parent != folder]
    if inner:
        raise ValueError(f"{folder} holds packs of its own ({inner[0]}): packs do not nest")


def unfinished(folder: str | Path) -> list[str]:
    """`folder`'s loose runs without a summary.json (in progress, failed or stopped)."""
    folder = Path(os.path.abspath(folder))
    return sorted(run.relative_to(folder).as_posix() for run in runs(folder)
                  if run != folder and (loose := loose_files(run))
                  and "summary.json" not in loose)  # fmt: skip


def pack(folder: str | Path, replace: bool = False, partial: bool = False) -> list[str]:
    """Packs `folder`'s loose runs into its pack (module docstring); returns the runs packed.
    Runs without a summary.json stay loose (`unfinished`) unless `partial`."""
    folder = Path(os.path.abspath(folder))
    _check_not_nested(folder)
    stored, loose = read_pack(folder), _loose_runs(folder)
    packed = {run: {name: compact(name, content) for name, content in named.items()}
              for run, named in stored.items()}  # fmt: skip
    if not partial:
        loose = {run: named for run, named in loose.items() if "summary.json" in named}
    differ = sorted(run for run in loose if run in packed and packed[run] != loose[run])
    if differ and not replace:
        raise ValueError(f"runs loose and packed with different files in {folder}: "
                         f"{', '.join(differ)} (--replace: the loose ones replace "
                         "them)")  # fmt: skip
    if loose or packed != stored:  # a pack from before `compact` is compacted once
        write_pack(folder, packed | loose)
        if {run: read_pack(folder)[run] for run in loose} != loose:
            raise RuntimeError(f"{folder / PACK} does not read back what was packed")
    for run in loose:
        for name in loose[run]:
            (folder / run / name).unlink()
        _remove_empty(folder / run, folder)
    return sorted(loose)


def _remove_empty(path: Path, top: Path) -> None:
    """Removes `path` and its parents below `top` while they are empty."""
    while path != top and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        path = path.parent


def unpack(folder: str | Path) -> list[str]:
    """Writes `folder`'s packed runs back out, loose, and removes its pack; returns the runs.
    A loose file that differs from the packed one (once compacted) is an error, and nothing is
    overwritten; one that agrees is kept as it is (it may hold the full digits)."""
    folder = Path(os.path.abspath(folder))
    packed = read_pack(folder)
    for run, named in packed.items():
        for name, content in named.items():
            path = folder / run / name
            if path.exists() and compact(name, _decode(path.read_bytes())) != content:
                raise ValueError(f"{path} differs from the packed run {run}: not unpacked")
    for run, named in packed.items():
        (folder / run).mkdir(parents=True, exist_ok=True)
        for name, content in named.items():
            if not (folder / run / name).exists():
                (folder / run / name).write_bytes(_encode(content))
    if packed:
        (folder / PACK).unlink()
    return sorted(packed)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxrlhf.experiments.records",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("command", choices=("pack", "unpack", "list"))
    parser.add_argument("folders", nargs="+", help="folders of records, e.g. results/claims/b")
    parser.add_argument("--replace", action="store_true",
                        help="pack: loose runs replace packed ones that differ")  # fmt: skip
    parser.add_argument("--partial", action="store_true",
                        help="pack: runs without a summary.json too")  # fmt: skip
    args = parser.parse_args(argv)
    for folder in args.folders:
        if args.command == "list":
            for run in runs(folder):
                note = "" if text(run, "summary.json") is not None else " (no summary.json)"
                print(f"{run}{note}")
            continue
        try:
            if args.command == "pack":
                done = pack(folder, args.replace, args.partial)
            else:
                done = unpack(folder)
        except ValueError as error:
            raise SystemExit(f"records {args.command}: {error}") from None
        print(f"{folder}: {args.command}ed {len(done)} runs")
        left = unfinished(folder) if args.command == "pack" else []
        if left:
            print(f"{folder}: left loose, without a summary.json (--partial packs them): "
                  f"{', '.join(left)}")  # fmt: skip


if __name__ == "__main__":
    main()
