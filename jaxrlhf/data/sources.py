"""Where a dataset split comes from: a Hugging Face hub name or a local path.

`load_split(source, split)` decides by whether `source` exists on disk:

- an existing `.jsonl` / `.json` / `.parquet` file: that file is the split (whatever its name);
- an existing folder written by `Dataset.save_to_disk`: that dataset is the split;
- an existing folder written by `DatasetDict.save_to_disk`: its split named `split`;
- any other existing folder: the files `{split}.jsonl`, `{split}.json`, `{split}.parquet` or
  `{split}-*.parquet` (also `-*.jsonl`), or a `{split}/` subfolder of such files, looked up in the
  folder and in its `data/` subfolder (the layout of a downloaded hub snapshot); with a config
  `name`, a `{name}/` subfolder is searched first (`openai/gsm8k` keeps `main/` and `socratic/`);
- otherwise `source` is a hub name handed to `datasets.load_dataset`, unless it looks like a path
  (starts with `.`, `/` or `~`, has more than one `/`, or ends with a data-file extension): then it
  is a FileNotFoundError, never a hub lookup.

`datasets` is imported only when a split is loaded, so code that merely imports the task modules
runs where the library is absent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
_PATH_LIKE_SUFFIXES = {*DATA_FILE_SUFFIXES, ".arrow", ".csv", ".tsv", ".txt", ".gz", ".zst"}
_BUILDER = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
_SAVE_TO_DISK_FILES = {"dataset_info.json", "state.json", "dataset_dict.json"}


class SplitNotFoundError(ValueError):
    """The source exists but has no split of that name; `available` lists the ones it has."""

    def __init__(self, source: str, split: str, available: Iterable[str]):
        self.available = sorted(available)
        listed = ", ".join(repr(s) for s in self.available) or "none found"
        super().__init__(f"{source!r} has no split {split!r}; its splits: {listed}")


def looks_like_path(source: str) -> bool:
    """Whether `source` is meant as a local path rather than a hub name ("owner/name")."""
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or "\\" in source
        or Path(source).suffix.lower() in _PATH_LIKE_SUFFIXES
    )


def load_split(source: str, split: str, *, name: str | None = None) -> datasets.Dataset:
    """The `split` of `source` (a hub name or a local path, see the module docstring)."""
    if not source:
        raise ValueError("dataset source is empty: give a hub name or a local path")
    path = Path(source).expanduser()
    if path.exists():
        return _load_local(path, source, split, name)
    if looks_like_path(source):
        raise FileNotFoundError(
            f"dataset path {source!r} does not exist (resolved to {path.resolve()}); "
            "give an existing .jsonl/.json/.parquet file or folder, or a hub name such as "
            "'openai/gsm8k'"
        )
    import datasets

    loaded = datasets.load_dataset(source, name)
    return _pick_split(loaded, source, split)


def require_columns(
    dataset: datasets.Dataset, columns: Sequence[str], *, source: str, split: str, hint: str = ""
) -> None:
    """Raise a ValueError naming the first of `columns` that `dataset` lacks."""
    for column in columns:
        if column not in dataset.column_names:
            raise ValueError(
                f"{source!r} (split {split!r}) has no column {column!r}; its columns: "
                f"{', '.join(dataset.column_names)}" + (f". {hint}" if hint else "")
            )


def first_rows(
    dataset: datasets.Dataset, columns: Sequence[str], limit: int | None = None
) -> list[dict]:
    """The first `limit` rows (all when None) as dicts of the given columns only.

    Selecting columns first keeps large unused ones (pre-tokenized `_token` lists) unconverted.
    """
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset.select_columns(list(columns)).to_list()


def _load_local(path: Path, source: str, split: str, name: str | None) -> datasets.Dataset:
    import datasets

    if path.is_file():
        return _load_files([path], source)
    if (path / "dataset_dict.json").is_file():
        return _pick_split(datasets.load_from_disk(str(path)), source, split)
    if (path / "state.json").is_file():
        return datasets.load_from_disk(str(path))
    roots = [path / name, path / name / "data"] if name and (path / name).is_dir() else []
    roots += [path, path / "data"]
    available: set[str] = set()
    for root in roots:
        files = _split_files(root, split)
        if files:
            return _load_files(files, source)
        available |= _splits_in(root)
    raise SplitNotFoundError(source, split, available)


def _split_files(root: Path, split: str) -> list[Path]:
    """Data files of one split under `root`, in the first format that has any."""
    if not root.is_dir():
        return []
    for suffix in DATA_FILE_SUFFIXES:
        files = [root / f"{split}{suffix}", *root.glob(f"{split}-*{suffix}")]
        if (root / split).is_dir():
            files += (root / split).glob(f"*{suffix}")
        files = sorted(f for f in files if f.is_file())
        if files:
            return files
    return []


def _splits_in(root: Path) -> set[str]:
    if not root.is_dir():
        return set()
    found = set()
    for entry in root.iterdir():
        if entry.is_file() and entry.suffix in DATA_FILE_SUFFIXES:
            if entry.name not in _SAVE_TO_DISK_FILES:
                found.add(entry.name.removesuffix(entry.suffix).split("-", 1)[0])
        elif entry.is_dir() and entry.name != "data":
            if any(f.suffix in DATA_FILE_SUFFIXES for f in entry.iterdir() if f.is_file()):
                found.add(entry.name)
    return found


def _load_files(files: list[Path], source: str) -> datasets.Dataset:
    import datasets

    suffix = files[0].suffix.lower()
    if suffix not in _BUILDER:
        raise ValueError(
            f"{source!r}: unsupported file type {suffix!r}; expected one of "
            f"{', '.join(DATA_FILE_SUFFIXES)}, or a folder"
        )
    return datasets.load_dataset(
        _BUILDER[suffix], data_files=[str(f) for f in files], split="train"
    )


def _pick_split(loaded, source: str, split: str) -> datasets.Dataset:
    if split not in loaded:
        raise SplitNotFoundError(source, split, loaded.keys())
    return loaded[split]
