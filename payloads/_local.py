"""`LocalDirPayloadStore`: one file per payload under a directory (the embedded case, the default).

Layout: `ROOT/sha256/<first two hex digits>/<hex>`.  A payload is either whole under its name or
absent, and durable once `put_many` returns.  A put of one payload writes a temporary file in its
directory, fsyncs it, renames it into place and fsyncs the directory.  A put of several is one group
commit (`ROOT/batches/`): their bytes go into ONE batch file, fsync'd, named and its directory
fsync'd (two syncs for the whole batch where each payload cost two: about 0.6 ms of system CPU a
payload here), then each payload's own file is written and renamed into place without a sync of its
own: the batch file is what makes them durable.  Every so often (`RETIRE_AFTER_BATCHES`, and at close)
one `syncfs` makes every payload file written since durable and the batch files behind them are
removed; a batch file still there when its writer is gone (a crash: its writer's lock on it is
released with the process) is replayed by the next process that opens the store writable, which
writes each of its payloads again where the file is not whole and syncs them, then removes it.  Until
then a read that misses a payload looks in the batch files.  Readers never see a partial payload
file; a crash leaves at most a temporary file, which `scan` ignores and collection removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import threading
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from time import time_ns
from typing import Any, Final

from payloads._errors import PayloadStoreError, PayloadStoreUnavailable
from payloads._store import PayloadStore, StoredPayload, check_digest
from protocol.digests import sha256_digest

_ALGORITHM_DIR: Final = "sha256"
_BATCH_DIR: Final = "batches"
_BATCH_SUFFIX: Final = ".batch"
_TMP_PREFIX: Final = ".tmp-"
# Batch files a writer keeps before one `syncfs` retires them (each holds its payloads a second time
# until then).
RETIRE_AFTER_BATCHES: Final = 32
# The steps of a batched put, named as each is reached: None, or a test's gate
# (tests/payloads/test_batched_puts.py stops a writer at each and SIGKILLs it there).
BATCH_STEPS: Final = (
    "batch_written",
    "batch_synced",
    "batch_named",
    "batch_durable",
    "files_written",
)
RETIRE_STEPS: Final = ("retire_synced", "retired")
at_step: Callable[[str], None] | None = None


def _reached(step: str) -> None:
    if at_step is not None:
        at_step(step)


# Errors an operator can clear (space, quota, the device): worth retrying; the rest are for good.
_TRANSIENT: Final = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ESTALE}
)


def _error(exc: OSError, what: str) -> PayloadStoreError:
    if exc.errno in _TRANSIENT:
        return PayloadStoreUnavailable(f"{what}: {exc.strerror or exc}")
    return PayloadStoreError(f"{what}: {exc.strerror or exc}")


class LocalDirPayloadStore(PayloadStore):
    kind = "local"

    def __init__(self, root: str | os.PathLike[str], name: str | None = None, *, fsync: bool = True) -> None:
        super().__init__(name)
        self.root = Path(root).absolute()  # a relative path is the working directory's at open
        self.fsync = fsync
        # Created by the first put, not here: a reader (`ledger audit` of a read-only log) opens a
        # store that is not there, or not writable, and finds nothing in it.
        self._base = self.root / _ALGORITHM_DIR
        try:
            if self.root.exists() and not self.root.is_dir():
                raise PayloadStoreError(f"payload store {self.root} is not a directory")
            # Once this process has seen the directory, its vanishing is a loss to say, never to paper
            # over by making it again: the payloads claimed from it are gone.
            self._seen = self._base.is_dir()
        except OSError as exc:  # a path the file system cannot hold (a name too long)
            raise PayloadStoreError(f"payload store {self.root}: {exc.strerror}") from None
        self._batches = self.root / _BATCH_DIR
        # This process's batch files not retired yet, each open and share-locked (`_replay` skips a
        # locked one: its writer is alive), oldest first.
        self._unretired: list[tuple[Path, int]] = []
        self._lock = threading.Lock()
        self.retire_after_batches = RETIRE_AFTER_BATCHES
        if fsync and self._batches.is_dir() and os.access(self._batches, os.W_OK):
            self._replay()

    @property
    def where(self) -> str:
        return str(self.root)

    def path_of(self, digest: str) -> Path:
        hex_ = check_digest(digest).partition(":")[2]
        return self._base / hex_[:2] / hex_

    def put_many(self, items: Mapping[str, bytes]) -> None:
        try:
            with self._lock:
                fresh: dict[Path, bytes] = {}
                for digest, content in items.items():
                    path = self.path_of(digest)
                    try:
                        if path.stat().st_size == len(content):
                            os.utime(path)  # content-addressed: already there; its time renewed
                            continue
                    except FileNotFoundError:
                        pass
                    fresh[path] = content
                if not fresh:
                    return
                touched = self._directories_for(fresh)
                if self.fsync and len(fresh) > 1:
                    self._put_batched(fresh, touched)
                else:
                    self._put_each(fresh, touched)
        except OSError as exc:
            raise _error(exc, f"storing payloads under {self.root}") from None

    def _directories_for(self, fresh: Mapping[Path, bytes]) -> set[Path]:
        """Makes the shard directories the payloads go in; the directories whose entries changed."""
        touched: set[Path] = set()
        for path in fresh:
            if not path.parent.is_dir():
                if not self._base.is_dir():
                    if self._seen:
                        raise PayloadStoreError(
                            f"the payload directory {self._base} is gone: the payloads stored in it "
                            "are lost; nothing more is stored"
                        )
                    self._base.mkdir(parents=True, exist_ok=True)
                    touched.update((self.root, self.root.parent))
                path.parent.mkdir(exist_ok=True)
                touched.add(self._base)
        return touched

    def _put_each(self, fresh: Mapping[Path, bytes], touched: set[Path]) -> None:
        """Each payload's file written, fsync'd and renamed into place; then each directory fsync'd."""
        for path, content in fresh.items():
            _write_whole(path, content, sync=self.fsync)
            touched.add(path.parent)
            self._seen = True
        if self.fsync:
            for directory in touched:
                _fsync_dir(directory)

    def _put_batched(self, fresh: Mapping[Path, bytes], touched: set[Path]) -> None:
        """The group commit: the batch file made durable (its fsync, its name, its directory's
        fsync), then each payload's file renamed into place unsynced.  Durable on return: a crash
        from here on is replayed from the batch file."""
        # The batch file's own path durable first: the store's directory and the batch directory
        # where either is new (the shard directories are synced with their payloads' files).
        if not self._batches.is_dir():
            self._batches.mkdir(parents=True, exist_ok=True)
            touched.add(self.root)
        for directory in touched & {self.root, self.root.parent}:
            _fsync_dir(directory)
        name = f"{time_ns()}-{os.getpid()}-{uuid.uuid4().hex[:8]}{_BATCH_SUFFIX}"
        batch = self._batches / name
        tmp = self._batches / f"{_TMP_PREFIX}{name}"
        index = [[f"sha256:{path.name}", len(content)] for path, content in fresh.items()]
        head = json.dumps({"payloads": index}, separators=(",", ":")).encode() + b"\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, head)
                for content in fresh.values():
                    _write_all(fd, content)
                _reached("batch_written")
                os.fsync(fd)
                _reached("batch_synced")
            finally:
                os.close(fd)
            os.replace(tmp, batch)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _reached("batch_named")
        # Held share-locked until retired: a process that replays batch files skips a live writer's.
        held = os.open(batch, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_SH)
        self._unretired.append((batch, held))
        _fsync_dir(self._batches)
        _reached("batch_durable")
        for path, content in fresh.items():
            _write_whole(path, content, sync=False)
        self._seen = True
        _reached("files_written")
        if len(self._unretired) >= self.retire_after_batches:
            self._retire()

    def _retire(self) -> None:
        """Makes every payload file written since the oldest unretired batch durable, then removes
        those batch files: one `syncfs` of the store's filesystem (each file's and its directory's
        fsync where there is none)."""
        if not self._unretired:
            return
        batches, self._unretired = self._unretired, []
        try:
            if not _syncfs(self.root):
                for batch, _ in batches:
                    self._sync_payloads_of(batch)
            _reached("retire_synced")
            for batch, _ in batches:
                with contextlib.suppress(FileNotFoundError):
                    batch.unlink()
            _reached("retired")
        except BaseException:
            self._unretired = batches + self._unretired  # still theirs to retire (or to replay)
            raise
        for _, held in batches:
            os.close(held)

    def _sync_payloads_of(self, batch: Path) -> None:
        directories: set[Path] = set()
        for digest, _, _ in _read_batch(batch):
            path = self.path_of(digest)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            directories.add(path.parent)
        for directory in directories:
            _fsync_dir(directory)

    def _orphans(self) -> Iterator[Path]:
        """Each batch file no live writer holds (its writer died before retiring it), held
        exclusively while the caller reads it."""
        try:
            names = sorted(
                p
                for p in self._batches.iterdir()
                if p.name.endswith(_BATCH_SUFFIX) and not p.name.startswith(_TMP_PREFIX)
            )
        except OSError:
            return
        for batch in names:
            try:
                fd = os.open(batch, os.O_RDONLY)
            except FileNotFoundError:
                continue  # retired, or replayed meanwhile by another process
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer's
                if batch.exists():
                    yield batch
            finally:
                os.close(fd)

    def _replay(self) -> None:
        """Every orphaned batch file: each of its payloads made whole and durable under its own
        name, then the batch file removed."""
        for batch in self._orphans():
            try:
                payloads = list(_read_batch(batch))
                touched = self._directories_for({self.path_of(d): b"" for d, _, _ in payloads})
                for digest, _, content in payloads:
                    path = self.path_of(digest)
                    if _holds(path, digest, len(content)):
                        _fsync_file(path)
                    else:
                        _write_whole(path, content, sync=True)
                    touched.add(path.parent)
                for directory in touched:
                    _fsync_dir(directory)
                batch.unlink()
            except _BadBatch as exc:
                raise PayloadStoreError(
                    f"{exc}; not replayed (it was whole when named: the disk changed it); move it aside "
                    "to open the store without it (a payload only it held is then not stored)"
                ) from None
            except OSError as exc:
                raise PayloadStoreError(f"replaying the batch file {batch}: {exc}") from None

    def _in_batches(self, digests: Collection[str]) -> dict[str, bytes]:
        """Payloads of `digests` in orphaned batch files (a crash lost their own files; a reader
        that may not write finds them there until a writer replays them)."""
        wanted, found = set(digests), {}
        for batch in self._orphans():
            with contextlib.suppress(OSError, ValueError):
                for digest, _, content in _read_batch(batch):
                    if digest in wanted:
                        found[digest] = content
            if len(found) == len(wanted):
                break
        return found

    def close(self) -> None:
        """Retires this process's batch files (one `syncfs`)."""
        with self._lock:
            try:
                self._retire()
            except OSError as exc:
                raise _error(exc, f"syncing payloads under {self.root}") from None

    def get_many(self, digests: Collection[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        missed: list[str] = []
        for digest in digests:
            try:
                found[digest] = self.path_of(digest).read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                missed.append(digest)  # no payload file under its name: in a batch file, or not stored
            except OSError as exc:
                raise _error(exc, f"reading payload {digest}") from None
        if missed:
            found.update(self._in_batches(missed))
        return found

    def contains(self, digests: Collection[str]) -> set[str]:
        found = {d for d in digests if self.path_of(d).is_file()}
        missed = [d for d in digests if d not in found]
        return found | set(self._in_batches(missed)) if missed else found

    def delete(self, digests: Collection[str]) -> int:
        removed = 0
        for digest in set(digests):
            try:
                self.path_of(digest).unlink()
                removed += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _error(exc, f"deleting payload {digest}") from None
        return removed

    def scan(self) -> Iterator[StoredPayload]:
        try:
            shards = sorted(e.path for e in os.scandir(self._base) if e.is_dir())
        except FileNotFoundError:
            return  # nothing was ever stored
        except OSError as exc:
            raise _error(exc, f"listing {self._base}") from None
        for shard in shards:
            try:
                entries = list(os.scandir(shard))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX) or not entry.is_file():
                    continue  # a put in progress, or no payload file (as `contains` says)
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                yield StoredPayload(f"sha256:{entry.name}", st.st_size, st.st_mtime)

    def leftovers(self, older_than: float) -> list[Path]:
        """Temporary files of puts that never finished (a crash mid-put), last modified before `older_than`."""
        found: list[Path] = []
        if not self._base.is_dir():
            return found
        for shard in [*self._base.iterdir(), self._batches]:
            if shard.is_dir():
                for path in shard.glob(f"{_TMP_PREFIX}*"):
                    try:
                        if path.stat().st_mtime < older_than:
                            found.append(path)
                    except FileNotFoundError:
                        continue
        return found


def _fsync_dir(directory: Path) -> None:
    _fsync_file(directory)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, content: bytes) -> None:
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view) :]


def _write_whole(path: Path, content: bytes, *, sync: bool) -> None:
    """`content` under `path`: a temporary file in its directory (fsync'd with `sync`), renamed."""
    tmp = path.parent / f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, content)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        # A put that failed (a full disk, a file past the size limit) leaves no part of itself
        # behind: every retry within the outage budget would leave another.
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _holds(path: Path, digest: str, size: int) -> bool:
    """Whether `path` is a whole payload file of `digest`."""
    try:
        return path.stat().st_size == size and sha256_digest(path.read_bytes()) == digest
    except OSError:
        return False


class _BadBatch(ValueError):
    """A batch file that is not one whole batch (a disk's damage: it is named only once whole)."""


def _read_batch(batch: Path) -> list[tuple[str, int, bytes]]:
    """Each payload a batch file holds: its digest, size and bytes, every payload hashed against its
    name; `_BadBatch` naming the byte where the file stops being a whole batch."""
    data = batch.read_bytes()
    end = data.find(b"\n")
    try:
        if end < 0:
            raise ValueError("no end of line")
        index = json.loads(data[:end])["payloads"]
        entries = [(str(check_digest(digest)), int(size)) for digest, size in index]
    except (ValueError, KeyError, TypeError, PayloadStoreError) as exc:
        raise _BadBatch(f"batch file {batch}: its index (byte 0) is not one ({exc})") from None
    at, found = end + 1, []
    for digest, size in entries:
        content = data[at : at + size]
        if len(content) != size or sha256_digest(content) != digest:
            raise _BadBatch(f"batch file {batch}: the payload at byte {at} is not the whole {digest}")
        found.append((digest, size, content))
        at += size
    if at != len(data):
        raise _BadBatch(f"batch file {batch}: {len(data) - at} bytes past its payloads, from byte {at}")
    return found


_LIBC: Any = None


def _syncfs(root: Path) -> bool:
    """`syncfs(2)` of the filesystem `root` is on: every file written there durable, with one
    journal commit; False where the C library has no `syncfs` (then each file is synced)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _LIBC = False
    call = getattr(_LIBC, "syncfs", None) if _LIBC else None
    if call is None:
        return False
    fd = os.open(root, os.O_RDONLY)
    try:
        if call(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        os.close(fd)
    return True


__all__ = ["LocalDirPayloadStore"]
