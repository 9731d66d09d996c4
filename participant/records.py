"""Checksummed records: the line format of the files the Gym side appends to (`executions.jsonl`,
`continuations.jsonl`, the resources server's `resources.jsonl`) and of the small files it replaces
whole (`driver.json`, `checkpoints/<id>.json`), and the one reader that tells a crash from damage.

A record is one line, a JSON object whose first member is the CRC-32 of the rest of the line:

    {"crc":"<8 lower-case hex digits>",<the record's own members>}\\n

The checksum covers every byte after the comma up to the newline, so a record is checked byte for
byte, never re-serialised, and each line is still JSON (`jq` reads it; the `crc` member is the only
addition).  CRC-32 catches every flipped bit and every burst of up to 32 bits.

Reading (`RecordReader`) decides between three cases, and never guesses:

- **a torn tail**: bytes after the last newline.  Records are written whole-line-at-a-time and the
  newline comes last, so this is a write a crash cut short, never acknowledged: it is no record, and
  the owner cuts it off when it opens the file for appending (`cut_torn_tail`), so the next record
  starts a line of its own;
- **a whole record**: a line whose checksum holds;
- **damage**: a whole line (its newline was written after it) that fails its checksum or is no
  record.  That is not what a crash leaves: the file is refused (`FileDamaged`, one line naming the
  file and the byte the record starts at), and nothing is dropped or rewritten.

Files written before records carried a checksum stay readable: a line without one (**legacy**) is
read as it was, but only before the first checksummed line (after it, a line without a checksum is
damage), and a legacy line that is not JSON is skipped only when it is the start of a record that an
older version ended with a newline after a crash (it then began like one of the file's own records:
`legacy_starts`); a flipped bit in the checksum's own opening cannot make a line look like one.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

log = logging.getLogger("participant.records")
T = TypeVar("T")

CRC_OPEN: Final = b'{"crc":"'
# `{"crc":"` + 8 hex digits + `",`: where the record's own members begin.
_BODY_AT: Final = len(CRC_OPEN) + 8 + 2
_HEX: Final = frozenset(b"0123456789abcdef")


class FileDamaged(RuntimeError):
    """A durable file holds a record that no crash could have left: one line naming the file and the
    byte its damaged record starts at.  Nothing was changed; what to do is the operator's call."""

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        super().__init__(f"{path}: damaged record at byte {offset}: {reason}")


def seal(record: bytes) -> bytes:
    """The line of `record` (a JSON object's bytes, no newline): its checksum first, a newline last."""
    if len(record) < 3 or record[:1] != b"{" or record[-1:] != b"}" or b"\n" in record:
        raise ValueError("a record is a non-empty JSON object on one line")
    body = record[1:]
    return b'{"crc":"%08x",' % zlib.crc32(body) + body + b"\n"


def seal_json(record: str) -> bytes:
    return seal(record.encode())


def _checked(path: Path, offset: int, line: bytes) -> bytes:
    """The record of a checksummed whole line (`line` without its newline), or FileDamaged."""
    digits = line[len(CRC_OPEN) : _BODY_AT - 2]
    if (
        len(line) < _BODY_AT + 1
        or line[_BODY_AT - 2 : _BODY_AT] != b'",'
        or not set(digits) <= _HEX
        or int(digits, 16) != zlib.crc32(line[_BODY_AT:])
    ):
        raise FileDamaged(path, offset, "its checksum does not match its bytes")
    return b"{" + line[_BODY_AT:]


@dataclass(frozen=True, slots=True)
class Record:
    offset: int  # the byte its line starts at
    data: bytes  # the record's JSON object (the checksum taken out)
    sealed: bool  # False: a line written before records carried a checksum


class RecordReader:
    """Iterates the whole records of one file in order (FileDamaged on damage); afterwards `end` is
    the length of its whole lines, `size` its length (`end < size`: a torn tail), and `legacy_torn`
    the offsets of torn lines an older version ended with a newline."""

    def __init__(self, path: Path, legacy_starts: tuple[bytes, ...] = ()) -> None:
        self.path = path
        self.legacy_starts = legacy_starts
        self.end = 0
        self.size = 0
        self.legacy_torn: list[int] = []

    @property
    def torn_tail(self) -> bool:
        return self.end < self.size

    def _legacy_torn(self, line: bytes) -> bool:
        return any(line[: len(s)] == s[: len(line)] for s in self.legacy_starts)

    def __iter__(self) -> Iterator[Record]:
        sealed_seen = False
        offset = 0
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below, also when the caller stops early
        except FileNotFoundError:
            return
        try:
            for raw in f:
                at, offset = offset, offset + len(raw)
                self.size = offset
                if raw[-1:] != b"\n":
                    return  # a torn tail: no record (the owner cuts it off)
                self.end = offset
                line = raw[:-1]
                if line.startswith(CRC_OPEN):
                    sealed_seen = True
                    yield Record(at, _checked(self.path, at, line), True)
                    continue
                if sealed_seen:
                    raise FileDamaged(self.path, at, "a line without a checksum after checksummed ones")
                try:
                    parsed = json.loads(line)
                except ValueError:
                    if self._legacy_torn(line):
                        self.legacy_torn.append(at)  # ended by an older version after a crash
                        continue
                    raise FileDamaged(self.path, at, "not a record (no checksum, not JSON)") from None
                if not isinstance(parsed, dict):
                    raise FileDamaged(self.path, at, "not a record (no checksum, not a JSON object)")
                yield Record(at, line, False)
        finally:
            f.close()


def cut_torn_tail(reader: RecordReader) -> int:
    """The owner's recovery when it opens a file to append to: a torn tail (a write a crash cut short)
    is cut off and the file synced, so the next record starts a line of its own.  Returns the bytes
    cut (after the reader has been iterated to its end)."""
    if not reader.torn_tail:
        return 0
    cut = reader.size - reader.end
    fd = os.open(reader.path, os.O_WRONLY)
    try:
        os.ftruncate(fd, reader.end)
        os.fsync(fd)
    finally:
        os.close(fd)
    log.warning(
        "%s: cut off a torn last record at byte %d (%d bytes a crash left mid-write; never acknowledged)",
        reader.path,
        reader.end,
        cut,
    )
    return cut


def read_document(path: Path, data: bytes) -> tuple[bytes, bool]:
    """The one record of a file replaced whole (`data`, its bytes) and whether it was checksummed; a
    file without a checksum (written by an older version) is returned as it is, for its reader to
    parse.  FileDamaged when it is empty, cut short, or fails its checksum."""
    if not data:
        raise FileDamaged(path, 0, "the file is empty")
    if not data.startswith(CRC_OPEN):
        return data, False
    newline = data.find(b"\n")
    if newline < 0:
        raise FileDamaged(path, 0, f"cut short at byte {len(data)} (no end of record)")
    if newline != len(data) - 1:
        raise FileDamaged(path, newline + 1, "bytes after its one record")
    return _checked(path, 0, data[:-1]), True


def parsed_records(reader: RecordReader, parse: Callable[[bytes], T]) -> Iterator[tuple[Record, T]]:
    """Each whole record of `reader` with `parse(record.data)`; a record `parse` refuses (ValueError,
    TypeError, KeyError: not a record of this file) is FileDamaged at its offset."""
    for record in reader:
        try:
            value = parse(record.data)
        except (ValueError, TypeError, KeyError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise FileDamaged(reader.path, record.offset, f"not a record of this file ({reason})") from None
        yield record, value
