"""Models built locally once (the packaged SmolLM2 converted, tiny random models, the test bed)
and the cache folder they live in.

Below every module that builds one (`smollm2`, `tiny`), and the one that resolves a model name
to its folder (`paths`), so that none of them imports another to share this.

A folder is put in place whole, by a rename of a temporary sibling that holds the whole model
and its `COMPLETE` marker: a reader (a run loading the model, vLLM mapping its weights) never
sees half of one, and takes no lock. Writers of one folder take turns, under an flock(2) lock on
a file beside it (`.NAME.lock`, left there): a process that would build or install a folder
while another does waits, then finds it whole, instead of doing the same minutes of work again.
A folder that is replaced (`replaced`: the claims' start models put over another build of their
recipe) is exchanged with its new version in one step (Linux's renameat2 RENAME_EXCHANGE), so
that its path names a whole folder at every moment, the old or the new; the old goes after (a
reader that opened its files keeps them). Where the filesystem cannot exchange, the old folder
is renamed aside first: its path is then missing for a moment, and a reader going through
`built_once` waits on the lock and finds the new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_dir() -> Path:
    """Root of generated artefacts: $JAXRLHF_CACHE, else ~/.cache/jaxrlhf."""
    return Path(os.environ.get("JAXRLHF_CACHE", Path.home() / ".cache" / "jaxrlhf"))


# Written last into a folder `built_once` built: the folder is whole.
COMPLETE = ".complete"


def built_once(folder: str | os.PathLike, build: Callable[[Path], None]) -> Path:
    """`folder`, built by `build(tmp)` into a temporary sibling and renamed into place, unless
    it is already whole. Processes that need the same folder at once (parallel test workers,
    two runs) build it once: the others wait for it (module docstring)."""
    folder = Path(folder)
    if (folder / COMPLETE).exists():
        return folder
    with _writing(folder):
        if not (folder / COMPLETE).exists():  # not built meanwhile by the lock's last holder
            _put(folder, build)
    return folder


def replaced(folder: str | os.PathLike, build: Callable[[Path], None],
             keep: Callable[[Path], bool]) -> bool:  # fmt: skip
    """Puts `build(tmp)` in place of `folder` unless `folder` is whole and `keep(folder)`, both
    checked under the writers' lock (of two processes replacing it at once, the second keeps
    the first's). Readers see the old folder or the new, never half of one (module docstring).
    Returns whether it was replaced."""
    folder = Path(folder)
    with _writing(folder):
        if (folder / COMPLETE).exists() and keep(folder):
            return False
        _put(folder, build)
    return True


@contextlib.contextmanager
def _writing(folder: Path) -> Iterator[None]:
    """Holds the lock of `folder`'s writers (module docstring), waiting for it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder.parent / f".{folder.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # the lock goes with it


def _put(folder: Path, build: Callable[[Path], None]) -> None:
    """`build(tmp)` into a temporary sibling, marked whole, then put in `folder`'s place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        build(tmp)
        (tmp / COMPLETE).write_text("")
        _swap_in(tmp, folder)  # `tmp` then holds what was at `folder`, if anything
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(new: Path, folder: Path) -> None:
    """Puts the folder `new` at `folder`, and whatever was there at `new` (module docstring):
    renamed when nothing is there, else exchanged, else the old one renamed aside first."""
    try:
        os.rename(new, folder)  # nothing there (or an empty folder)
        return
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if _exchange(new, folder):
        return
    aside = new.with_name(new.name + "-old")
    os.rename(folder, aside)
    os.rename(new, folder)
    os.rename(aside, new)


def _exchange(a: Path, b: Path) -> bool:
    """Exchanges the folders at `a` and `b` in one step (renameat2 with RENAME_EXCHANGE, Linux
    3.15 and later); False where the C library or the filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]  # fmt: skip
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
