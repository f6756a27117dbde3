"""Update files and shared weight files are owned by a lock, not a PID (`jaxrlhf_wire.files`).

Containers that share /dev/shm but not a PID namespace see none of each other's processes: a
file's PID says nothing there. Simulated here with a live child whose file is renamed to a PID
that runs nowhere: the cleaner keeps it while the child lives, and removes it once the child is
gone. The count of a progressive shared file, kept under its own lock on the data file, is
stored and read meanwhile without waiting on the owner's lock.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxrlhf_wire.files import read_progress_count, remove_stale_files, write_progress_count

GONE = 999999999  # above any pid_max: a PID no process has, in this namespace or any

# Creates the file of `kind` in the folder given, says its path, and waits to be killed.
CHILD = """
import sys
folder, kind = sys.argv[1:]
if kind == "update":
    from generator_service.updates.bytes_file import UpdateFile
    made = UpdateFile(folder)
else:
    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile
    made = SharedWeightsFile(folder, [("w", (1024,), "float32")])
print(made.path, flush=True)
sys.stdin.read()
"""


def _prefix(kind: str) -> str:
    if kind == "update":
        from generator_service.updates.bytes_file import UpdateFile

        return UpdateFile.PREFIX
    from jaxrlhf.fleet.rpc.weights_file import PREFIX

    return PREFIX


@pytest.mark.parametrize("kind", ["update", "shared"])
def test_a_live_owner_in_another_pid_namespace_keeps_its_file(tmp_path, kind):
    prefix = _prefix(kind)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), kind],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        made = Path(child.stdout.readline().strip())
        assert made.exists(), "the child made no file"
        # Its files as another namespace would show them: named by a PID that runs nowhere here.
        ours, theirs = f"{prefix}{child.pid}-", f"{prefix}{GONE}-"
        for path in tmp_path.glob(made.stem + ".*"):
            path.rename(tmp_path / path.name.replace(ours, theirs))
        data = tmp_path / made.name.replace(ours, theirs)

        remove_stale_files(str(tmp_path), prefix)
        assert data.exists(), "the file of a live process was deleted by its name's PID"
        with open(data, "r+b") as file:  # the count's lock is not the owner's
            write_progress_count(file.fileno(), 7, timeout=1.0)
            assert read_progress_count(file.fileno()) == 7
    finally:
        child.kill()
        child.communicate()  # waits, and closes its pipes
    remove_stale_files(str(tmp_path), prefix)
    assert list(tmp_path.iterdir()) == [], "the dead owner's files stayed"
    _make(kind, tmp_path).close()
    assert list(tmp_path.iterdir()) == [], "a closed file left its lock file behind"


def _make(kind: str, folder: Path):
    if kind == "update":
        from generator_service.updates.bytes_file import UpdateFile

        return UpdateFile(str(folder))
    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile

    return SharedWeightsFile(str(folder), [("w", (1024,), "float32")])
