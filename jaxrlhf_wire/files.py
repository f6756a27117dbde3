"""Tensor regions in files: the learner's shared weight files and the service's staging file.

Both lay tensors out raw, each region starting on a page boundary (`ALIGNMENT`), so that the
engine gets aligned views when it maps the file; and both name their files PREFIX<pid>-*.bin,
so that a new file's creator can remove the files of processes that died.
"""

from __future__ import annotations

import os
from pathlib import Path

ALIGNMENT = 4096
# A shared weight file written while the server stages it (SharedWeights.progressive) counts
# its written tensors in its first bytes, as a little-endian uint64; this count means the
# writer gave up.
PROGRESS_BYTES = 8
PROGRESS_ABANDONED = (1 << 64) - 1


def aligned(position: int) -> int:
    """`position` rounded up to the next multiple of `ALIGNMENT`."""
    return position + -position % ALIGNMENT


def remove_stale_files(directory: str, prefix: str) -> None:
    """Deletes the files named PREFIX<pid>-*.bin in `directory` whose process no longer runs
    (shared files of dead learners, staging files of dead servers)."""
    for path in Path(directory).glob(f"{prefix}*.bin"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, another user's
