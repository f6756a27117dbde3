"""Model folders built or installed by several processes at once are never seen half-written
(`jaxrlhf.models.built`): built once, the others waiting for it; replaced in one step while
read (the claims' start models, `start_models.install`)."""

import multiprocessing
import shutil
import threading
import time
from pathlib import Path

import pytest

from jaxrlhf.models.built import COMPLETE, _exchange, built_once

FORK = multiprocessing.get_context("fork")  # the children start from the test's monkeypatches


def _slow_build(calls: list):
    def build(folder):
        calls.append(folder)
        (folder / "a.bin").write_bytes(b"a" * 1000)
        time.sleep(0.3)  # the other builder starts meanwhile
        (folder / "b.bin").write_bytes(b"b" * 1000)

    return build


def test_builders_racing_on_one_folder_build_it_once_and_both_get_it_whole(tmp_path):
    target, calls, results = tmp_path / "model", [], []
    threads = [
        threading.Thread(target=lambda: results.append(built_once(target, _slow_build(calls))))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target, target] and len(calls) == 1  # the second waited for the first
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE, "a.bin", "b.bin"]
    assert (target / "b.bin").read_bytes() == b"b" * 1000
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == ["model"]


def test_a_whole_folder_is_reused_and_a_half_built_one_replaced(tmp_path):
    target, calls = tmp_path / "model", []
    target.mkdir()
    (target / "a.bin").write_bytes(b"partial")  # an interrupted build: no marker
    built_once(target, _slow_build(calls))
    assert (target / "a.bin").read_bytes() == b"a" * 1000 and len(calls) == 1
    built_once(target, _slow_build(calls))
    assert len(calls) == 1


class Watcher:
    """Reads the folder at `path` by path, as a run loading a model does, until stopped, and
    keeps what it should never see: a file of `files` missing or cut short while `path` exists
    (`missing_ok`: the folder itself may be missing for a moment, where the filesystem cannot
    exchange two folders)."""

    def __init__(self, path: Path, files: dict[str, int], missing_ok: bool = True):
        self.path, self.files, self.missing_ok = path, files, missing_ok
        self.seen: list[str] = []
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()

    def _watch(self):
        while not self._stop.is_set():
            if not self.path.exists():
                if not self.missing_ok:
                    self.seen.append("the folder missing")
                continue
            for name, size in self.files.items():
                try:
                    data = (self.path / name).read_bytes()
                except FileNotFoundError:
                    if self.path.exists():
                        self.seen.append(f"{name} missing")
                    continue
                if len(data) != size or len(set(data)) > 1:
                    self.seen.append(f"{name} cut short or mixed")
            self.reads += 1


def _run_at_once(target, count: int = 2) -> list[int]:
    """`target(queue)` in `count` processes started together; their exit codes."""
    start, queue = FORK.Event(), FORK.Queue()
    children = [FORK.Process(target=_when_set, args=(start, target, queue)) for _ in range(count)]
    for child in children:
        child.start()
    start.set()
    for child in children:
        child.join(timeout=120)
    return [child.exitcode for child in children]


def _when_set(start, target, queue):
    start.wait()
    target(queue)


def test_two_processes_needing_one_bed_build_it_once_and_both_get_it_whole(tmp_path, monkeypatch):
    from jaxrlhf.models import bed

    log = tmp_path / "builds.log"

    def build(folder, recipe):  # a slow stand-in for the SFT build
        with open(log, "a") as out:
            out.write(f"{folder}\n")
        (folder / "model.safetensors").write_bytes(b"w" * (1 << 20))
        time.sleep(0.5)
        (folder / "config.json").write_bytes(b"c" * 100)

    monkeypatch.setattr(bed, "build", build)
    recipe, root = bed.Recipe(size="bed", steps=3, batch_size=4), tmp_path / "cache"
    folder = root / f"bed-{recipe.digest()[:16]}"
    files = {"model.safetensors": 1 << 20, "config.json": 100, COMPLETE: 0}
    with Watcher(folder, files) as watcher:
        codes = _run_at_once(lambda queue: bed.bed_path("bed", recipe, root=root))
    assert codes == [0, 0]
    assert len(log.read_text().splitlines()) == 1, "both processes built the bed"
    assert all((folder / name).stat().st_size == size for name, size in files.items())
    assert watcher.seen == []


@pytest.mark.parametrize("exchange", [True, False], ids=["exchanged", "renamed-aside"])
def test_two_processes_installing_a_start_model_over_another_build_while_it_is_read(
    tmp_path, monkeypatch, exchange
):
    from jaxrlhf.experiments.claims import start_models
    from jaxrlhf.models import built

    if not exchange:
        monkeypatch.setattr(built, "_exchange", lambda a, b: False)
    probe = [tmp_path / "x", tmp_path / "y"]
    for folder in probe:
        folder.mkdir()
    exchanges = exchange and _exchange(*probe)
    size = 4 << 20
    committed, cache = tmp_path / "committed", tmp_path / "cache"
    files = {name: size if name == "model.safetensors" else 64 for name in start_models.FILES}
    _write_build(committed / "bed-1111", files, b"N")
    target = cache / "bed-1111"
    for _ in range(4):
        shutil.rmtree(target, ignore_errors=True)  # nothing reads it yet
        _write_build(target, files, b"O")  # this machine's build: other weights
        (target / COMPLETE).write_text("")
        with Watcher(target, files, missing_ok=not exchanges) as watcher:
            codes = _run_at_once(lambda queue: start_models.install(committed, cache))
        assert codes == [0, 0], "an install failed"
        assert watcher.seen == [] and watcher.reads > 0
        assert (target / "model.safetensors").read_bytes() == b"N" * size
        assert (target / COMPLETE).exists()
    assert sorted(p.name for p in cache.iterdir()) == [".bed-1111.lock", "bed-1111"]


def _write_build(folder: Path, files: dict[str, int], fill: bytes):
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in files.items():
        (folder / name).write_bytes((fill if name == "model.safetensors" else b"s") * size)
