"""`LocalDirPayloadStore`: one file per payload under a directory (the embedded case, the default).

Layout: `ROOT/sha256/<first two hex digits>/<hex>`.  A put writes a temporary file in the target
directory, fsyncs it, renames it into place and fsyncs the directory, so a payload is either whole
under its name or absent, and durable once `put_many` returns (one directory fsync per directory the
batch touched, not one per file).  Readers never see a partial file; a crash leaves at most a
temporary file, which `scan` ignores and collection removes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Final

from payloads._errors import PayloadStoreError, PayloadStoreUnavailable
from payloads._store import PayloadStore, StoredPayload, check_digest

_ALGORITHM_DIR: Final = "sha256"
_TMP_PREFIX: Final = ".tmp-"
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

    @property
    def where(self) -> str:
        return str(self.root)

    def path_of(self, digest: str) -> Path:
        hex_ = check_digest(digest).partition(":")[2]
        return self._base / hex_[:2] / hex_

    def put_many(self, items: Mapping[str, bytes]) -> None:
        touched: set[Path] = set()
        try:
            for digest, content in items.items():
                path = self.path_of(digest)
                try:
                    if path.stat().st_size == len(content):
                        os.utime(path)  # content-addressed: already there; its time renewed
                        continue
                except FileNotFoundError:
                    pass
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
                tmp = path.parent / f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    try:
                        view = memoryview(content)
                        while view:
                            view = view[os.write(fd, view) :]
                        if self.fsync:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.replace(tmp, path)
                except OSError:
                    # A put that failed (a full disk, a file past the size limit) leaves no part of
                    # itself behind: every retry within the outage budget would leave another.
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                    raise
                touched.add(path.parent)
                self._seen = True
            if self.fsync:
                for directory in touched:
                    _fsync_dir(directory)
        except OSError as exc:
            raise _error(exc, f"storing payloads under {self.root}") from None

    def get_many(self, digests: Collection[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for digest in digests:
            try:
                found[digest] = self.path_of(digest).read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                continue  # no payload file under its name (as `contains` says): not stored
            except OSError as exc:
                raise _error(exc, f"reading payload {digest}") from None
        return found

    def contains(self, digests: Collection[str]) -> set[str]:
        return {d for d in digests if self.path_of(d).is_file()}

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
        for shard in self._base.iterdir():
            if shard.is_dir():
                for path in shard.glob(f"{_TMP_PREFIX}*"):
                    try:
                        if path.stat().st_mtime < older_than:
                            found.append(path)
                    except FileNotFoundError:
                        continue
        return found


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["LocalDirPayloadStore"]
