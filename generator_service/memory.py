"""glibc's allocator, told to keep freed memory for reuse (the server and the engine's worker)."""

from __future__ import annotations

import ctypes


def keep_freed_memory(trim_bytes: int) -> None:
    """Makes glibc keep up to `trim_bytes` of freed heap memory for reuse instead of returning
    it to the system, and serve blocks up to 32 MiB (its largest threshold) from the heap.

    - The server: gRPC reads every weight chunk (a few MiB) into freshly allocated buffers.
      With glibc's defaults, the freed ones are handed back to the kernel, and each message
      faults in and zeroes new pages: about a third of the server's CPU time while receiving
      an update. Kept, they are reused. The heap then stays at its peak, which is a few chunks.
    - The worker (preloaded swaps, updates/worker_preload.py): each preload allocates a copy of the
      weights and their packed form, freed once committed; kept, the next preload reuses those pages
      instead of faulting in (and zeroing) new ones, which made a preload 2-5x slower and its time
      erratic on a CPU backend. The worker's resident memory then stays at its peak: the model plus
      one preload.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, trim_bytes)
    mallopt(m_top_pad, 64 << 20)
