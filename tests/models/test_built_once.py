"""`built_once`: model folders built by several processes at once are never seen half-written."""

import threading
import time

from jaxrlhf.models.built import COMPLETE, built_once


def _slow_build(calls: list):
    def build(folder):
        calls.append(folder)
        (folder / "a.bin").write_bytes(b"a" * 1000)
        time.sleep(0.3)  # the other builder starts meanwhile
        (folder / "b.bin").write_bytes(b"b" * 1000)

    return build


def test_builders_racing_on_one_folder_both_get_it_whole(tmp_path):
    target, calls, results = tmp_path / "model", [], []
    threads = [
        threading.Thread(target=lambda: results.append(built_once(target, _slow_build(calls))))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target, target] and len(calls) == 2  # both built, one copy kept
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE, "a.bin", "b.bin"]
    assert (target / "b.bin").read_bytes() == b"b" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary folder left


def test_a_whole_folder_is_reused_and_a_half_built_one_replaced(tmp_path):
    target, calls = tmp_path / "model", []
    target.mkdir()
    (target / "a.bin").write_bytes(b"partial")  # an interrupted build: no marker
    built_once(target, _slow_build(calls))
    assert (target / "a.bin").read_bytes() == b"a" * 1000 and len(calls) == 1
    built_once(target, _slow_build(calls))
    assert len(calls) == 1
