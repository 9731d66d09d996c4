"""The participant's two ways of writing a file durably.  `replace_file`: a crash at any point leaves
either the old or the new contents whole (write a temporary file beside it, fsync it, rename it over
the old one, fsync the directory, so the rename itself survives a power cut).  `GroupCommitFile`: an
append-only file of lines written in group commits (what is queued while a write is in flight goes
out in the next one, one fsync for all): the evidence file and the continuation index."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path


def replace_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_append(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


class GroupCommitFile:
    """`append` queues bytes and returns a future that is done once they are on disk, or failed with
    the OSError that kept them off it.  `after_write(size)` runs after each durable write with the
    write lock held (no other write is in flight), and returns True when it may have replaced the
    file by a rename (a compaction): the descriptor then follows the new file."""

    def __init__(self, path: Path, after_write: Callable[[int], bool] | None = None) -> None:
        self.path = path
        self._after_write = after_write
        self._lock = threading.Lock()
        self._fd = _open_append(path)
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    def append(self, data: bytes) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not data:
            done.set_result(None)
            return done
        self._pending.append((data, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return done

    async def commit(self, data: bytes) -> None:
        """`append`, then wait until the bytes are durable."""
        await asyncio.shield(self.append(data))  # a cancelled caller does not cancel the write

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self.write, b"".join(data for data, _ in batch))
            except BaseException as exc:
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc if isinstance(exc, Exception) else OSError(str(exc)))
                if not isinstance(exc, Exception):
                    raise
            else:
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)

    def write(self, data: bytes) -> None:
        """Writes and fsyncs `data` now, blocking (what each group commit runs in a thread)."""
        with self._lock:
            start = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:  # a short write (a disk filling up) goes on where it stopped
                    view = view[os.write(self._fd, view) :]
                os.fsync(self._fd)
            except OSError:
                # Whatever part reached the file is taken back: the callers are told it failed, and
                # the next write must not be glued to half a record (a line no reader would trust).
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                raise
            replaced = self._after_write is not None and self._after_write(os.fstat(self._fd).st_size)
            # After a rename the open descriptor names the old file: write to the new one.
            if replaced and os.fstat(self._fd).st_ino != os.stat(self.path).st_ino:
                os.close(self._fd)
                self._fd = _open_append(self.path)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
