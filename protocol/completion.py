"""A finished try in one answer: its `/run` reply, its completion receipt and its token records.

A participant asked for it (`Accept: COMPLETION_MEDIA_TYPE` on `/run`, by a trainer that saw the
`completion_in_run` feature) answers a completed try's `/run` with this frame instead of the reply's
JSON alone, so the trainer gets what it would otherwise fetch with `GET /completion_receipt/...` and
`GET /token_capture/...` in the same exchange.  Nothing of the protocol changes: the trainer checks
the receipt against the reply and the token records against the receipt exactly as it checks fetched
ones, and any part it cannot read it fetches the old way.  An agent that does not know the media type
answers JSON, and the trainer fetches both.

Version 1, little-endian:

    offset 0   b"RLCP"              magic
           4   u8 version (1), 3 zero bytes
           8   u32 R, the reply's length;  u32 C, the receipt's length
          16   the reply: the JSON the agent would have answered `/run` with (a participant's
               canonical JSON of it, which the trainer stores as it came where it hashes to the
               receipt's digest)
      16 + R   the receipt: `CompletionReceipt` as JSON
  16 + R + C   the token records in their binary form (`protocol.token_codec`), to the end
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

COMPLETION_MEDIA_TYPE: Final = "application/vnd.rollout-ledger.completion.v1"
MAGIC: Final = b"RLCP"
VERSION: Final = 1
_PREFIX = struct.Struct("<4sB3xII")


class CompletionFrameError(ValueError):
    """The body is not a completion frame (one line, safe to show)."""


@dataclass(frozen=True, slots=True)
class CompletionParts:
    reply: bytes
    receipt: bytes
    # A view of the frame, not a copy: the largest part, read in place and copied once, into what
    # the trainer stores.
    tokens: memoryview


def encode_completion(reply: bytes, receipt: bytes, tokens: bytes) -> bytes:
    return b"".join((_PREFIX.pack(MAGIC, VERSION, len(reply), len(receipt)), reply, receipt, tokens))


def decode_completion(body: bytes | bytearray) -> CompletionParts:
    if len(body) < _PREFIX.size:
        raise CompletionFrameError(f"completion frame of {len(body)} bytes is shorter than its prefix")
    magic, version, reply_len, receipt_len = _PREFIX.unpack_from(body)
    if magic != MAGIC:
        raise CompletionFrameError(f"not a completion frame (magic {magic!r})")
    if version != VERSION:
        raise CompletionFrameError(f"completion frame version {version} is not {VERSION}")
    start = _PREFIX.size
    tokens_at = start + reply_len + receipt_len
    if tokens_at > len(body):
        raise CompletionFrameError(
            f"completion frame names {reply_len} + {receipt_len} bytes of reply and receipt; "
            f"{len(body) - start} follow its prefix"
        )
    # Read-only even over a bytearray (a body the trainer's transport read in place).
    view = memoryview(body).toreadonly()
    return CompletionParts(
        reply=bytes(view[start : start + reply_len]),
        receipt=bytes(view[start + reply_len : tokens_at]),
        tokens=view[tokens_at:],
    )


__all__ = [
    "COMPLETION_MEDIA_TYPE",
    "CompletionFrameError",
    "CompletionParts",
    "decode_completion",
    "encode_completion",
]
