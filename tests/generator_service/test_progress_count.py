"""The count of a progressive shared file (`jaxrlhf_wire.files`), stored by the learner and read
by the server from another process: never torn, never decreasing, never a value that was not
stored, and a store in progress is waited for, not read half-way."""

from __future__ import annotations

import fcntl
import multiprocessing
import os

import pytest

from jaxrlhf_wire.files import (
    PROGRESS_BYTES,
    ProgressLockedError,
    read_progress_count,
    write_progress_count,
)

# Stores of the hammering writer: runs of every byte boundary of the low 7 bytes (r * 256**j - 1
# then r * 256**j: j bytes go from ff to 00 and one more changes), each run in a higher top byte,
# so that the whole sequence only grows. A torn read of any of these transitions mixes bytes of
# two stored values into one that was never stored (255 -> 256 torn: 0 or 511).
HAMMER_RUNS = 32


def hammered_counts() -> list[int]:
    counts = []
    for run in range(HAMMER_RUNS):
        for byte in range(1, PROGRESS_BYTES - 1):
            for step in range(1, 256):
                boundary = (run << 56) + step * (1 << (8 * byte))
                counts += [boundary - 1, boundary]
    return counts


def _hammer(path: str) -> None:
    """The writer process: stores every count of `hammered_counts`, in order."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for count in hammered_counts():
            write_progress_count(fd, count)
    finally:
        os.close(fd)


@pytest.fixture
def count_file(tmp_path):
    path = tmp_path / "shared.bin"
    path.write_bytes(bytes(4096))
    return path


def test_a_reader_sees_only_stored_counts_in_order_while_a_process_hammers_them(count_file):
    counts = hammered_counts()
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    stored = {0, *counts}
    writer = multiprocessing.get_context("spawn").Process(target=_hammer, args=(str(count_file),))
    fd = os.open(count_file, os.O_RDONLY)
    seen, locked, last = set(), 0, 0
    try:
        writer.start()
        while writer.is_alive() or last != counts[-1]:
            count = read_progress_count(fd)
            if count is None:  # a store holds the lock
                locked += 1
                continue
            assert count in stored, f"read {count:#x}, which was never stored (torn)"
            assert count >= last, f"read {count:#x} after {last:#x}: the count went back"
            seen.add(count)
            last = count
            if not writer.is_alive() and writer.exitcode != 0:
                break
    finally:
        os.close(fd)
        writer.join(timeout=60)
    assert writer.exitcode == 0
    assert last == counts[-1]
    # The reads overlapped the stores, else nothing was tested: some came while a store held
    # the lock (when a read without it is torn), and the values changed under the reader.
    assert locked > 0 and len(seen) > 2, (len(seen), locked)


def test_a_store_caught_half_way_is_waited_for_not_read(count_file):
    """A writer holding the lock has stored one byte of 256 over 255: the file's first bytes say
    0 (a decrease the server refuses) while the store is in progress. The reader does not take
    them; once the store ends it reads 256."""
    writer = os.open(count_file, os.O_WRONLY)
    reader = os.open(count_file, os.O_RDONLY)
    try:
        write_progress_count(writer, 255)
        assert read_progress_count(reader) == 255
        fcntl.flock(writer, fcntl.LOCK_EX)
        os.pwrite(writer, (256).to_bytes(PROGRESS_BYTES, "little")[:1], 0)  # low byte first
        assert os.pread(reader, PROGRESS_BYTES, 0) == bytes(PROGRESS_BYTES)  # torn: 0
        assert read_progress_count(reader) is None
        os.pwrite(writer, (256).to_bytes(PROGRESS_BYTES, "little"), 0)
        fcntl.flock(writer, fcntl.LOCK_UN)
        assert read_progress_count(reader) == 256
    finally:
        os.close(writer)
        os.close(reader)


def test_a_store_waits_for_a_read_in_progress_and_gives_up_by_name(count_file):
    """A reader stopped while it holds the lock (it holds it for one pread, so only a stopped
    process does): the store waits, then raises naming the problem, the count unchanged."""
    writer = os.open(count_file, os.O_WRONLY)
    reader = os.open(count_file, os.O_RDONLY)
    try:
        write_progress_count(writer, 7)
        fcntl.flock(reader, fcntl.LOCK_SH)
        with pytest.raises(ProgressLockedError, match="locked for 0.2 s"):
            write_progress_count(writer, 8, timeout=0.2)
        fcntl.flock(reader, fcntl.LOCK_UN)
        assert read_progress_count(reader) == 7
        write_progress_count(writer, 8)
        assert read_progress_count(reader) == 8
    finally:
        os.close(writer)
        os.close(reader)


def test_a_file_too_short_for_its_count_is_an_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x01\x02")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="ends before its count"):
            read_progress_count(fd)
    finally:
        os.close(fd)
